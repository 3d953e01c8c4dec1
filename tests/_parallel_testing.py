"""Spawned gloo process groups for the sequence-parallel tests: ``spawn(worker, world)`` runs
``worker(rank, world)`` in ``world`` processes (a time limit; a failure in any process fails the test with its
traceback)."""
from __future__ import annotations

import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIME_LIMIT_S = 300


def spawn(worker, world: int, *args) -> None:
    """Run ``worker(rank, world, *args)`` in ``world`` spawned processes joined in a gloo group."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.start_processes(_entry, args=(world, port, worker, args), nprocs=world, join=False,
                                 start_method="spawn")
    deadline = time.monotonic() + TIME_LIMIT_S
    while not context.join(timeout=max(1.0, deadline - time.monotonic())):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            raise TimeoutError(f"{world} spawned processes did not finish in {TIME_LIMIT_S} s")


def _entry(rank: int, world: int, port: int, worker, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        worker(rank, world, *args)
        dist.barrier()   # rank 0 hosts the store: it must not leave while another rank still talks to it
    finally:
        dist.destroy_process_group()


def collectives_in(call) -> list[str]:
    """The names of the gloo / c10d collectives the profiler sees during ``call()``."""
    with torch.profiler.profile() as prof:
        call()
    return sorted({event.name for event in prof.events() if event.name.startswith(("gloo:", "c10d"))})


def shard(x: torch.Tensor, rank: int, world: int, dim: int = 2) -> torch.Tensor:
    """This rank's contiguous shard of ``x`` along ``dim`` (``torch.tensor_split``: uneven when ``world`` does not
    divide the length)."""
    return x.tensor_split(world, dim=dim)[rank]
