"""Sequence parallelism on several GPUs: correctness against one GPU and forward+backward scaling, under torchrun.

    torchrun --nproc-per-node 4 benchmarks/sequence_parallel.py --part correctness --out sp_out
    torchrun --nproc-per-node P benchmarks/sequence_parallel.py --part scaling --sizes 262144 1048576 --out sp_out
    python benchmarks/sequence_parallel.py --combine sp_out        # efficiency T1 / (P T_P) over the runs' files

``correctness``: every rank draws the same full q, k, v and learned parameters, runs the call on its own GPU as one
process would, then with ``ParallelConfig`` of each Ulysses degree that divides the world and, for the methods with
a ring strategy, a ring over the world (shards of the same tensors); rank 0 tabulates relative L2 and max error of
the output shards and of the q, k, v and (summed over the group) parameter gradients. ``scaling``: one attention
layer's forward+backward at degree = world size (do_bench median on each rank, the slowest rank reported) and, from
the profiler, the time of the all-to-all kernels; run it with ``--nproc-per-node 1`` too for T1. ``overhead`` (one
process): forward+backward with a ``ParallelConfig`` of degree 1 against none, the two alternating over three rounds,
best medians and their ratio. Kept as a script: the runner times one process, not a process group. Runs on CPU with
gloo for a smoke test (``--device cpu --backend torch --dtype fp32`` and small sizes).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys

import torch
import torch.distributed as dist
from tabulate import tabulate

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import flexsparse  # noqa: E402
from flexsparse.bench.scripts import rel_l2  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

CONFIGS = {
    "full": {"method": "full"},
    "llsa": {"method": "llsa", "block_size": 16, "topk": 8},
    "sla": {"method": "sla", "block_size": 64, "topk_ratio": 0.05},
    "sla2": {"method": "sla2", "block_q": 128, "block_k": 64, "topk_ratio": 0.05},
    "topk": {"method": "topk", "block_size": 64, "topk": 8},
    "vsa": {"method": "vsa", "block_size": 64, "topk": 8, "gate": True},
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--part", choices=["correctness", "scaling", "overhead"], default="correctness")
    p.add_argument("--combine", metavar="DIR", help="tabulate the scaling files of DIR and stop")
    p.add_argument("--methods", nargs="+", default=None, help=f"of {list(CONFIGS)} (scaling: llsa sla)")
    p.add_argument("--sizes", type=int, nargs="+", default=None, help="N (correctness: 65536; scaling: 262144)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    p.add_argument("--backend", default="triton")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default="sp_out")
    return p.parse_args(argv)


def setup(device_type: str) -> torch.device:
    """The process group from torchrun's environment (NCCL on CUDA, gloo on CPU) and this rank's device."""
    if device_type != "cuda":
        dist.init_process_group("gloo")
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    # device_id binds NCCL to this GPU: without it the closing barrier guesses the device (and may hang)
    dist.init_process_group("nccl", device_id=device)
    return device


def ulysses(degree: int, device: torch.device) -> flexsparse.ParallelConfig:
    world = dist.get_world_size()
    mesh = init_device_mesh(device.type, (world // degree, degree), mesh_dim_names=("data", "ulysses"))
    return flexsparse.ParallelConfig(mesh)


def ring(device: torch.device) -> flexsparse.ParallelConfig:
    """Every rank on the ring dim (the methods with a ring strategy: ``full``, ``topk``, ``llsa``)."""
    return flexsparse.ParallelConfig(init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("ring",)))


def inputs(args, n: int, name: str, device: torch.device, seed: int):
    """Full q, k, v ``(B, H, N, D)``, the method's learned parameters (moved off their initial values) and the
    upstream gradient, drawn alike on every rank."""
    gen = torch.Generator().manual_seed(seed)
    dtype = DTYPES[args.dtype]
    q, k, v, grad = (torch.randn(args.batch, args.heads, n, args.dim, generator=gen).to(device, dtype)
                     for _ in range(4))
    cfg = CONFIGS[name]
    initial = flexsparse.METHODS[name].init_params(flexsparse.Config.from_dict(cfg), args.dim, args.heads, n)
    params = {key: (value + 0.02 * torch.randn(value.shape, generator=gen)).to(device) for key, value in
              initial.items()}
    return q, k, v, grad, params


def forward_backward(q, k, v, grad, params, cfg, backend, parallel=None):
    """``(o, grads of q, k, v and the parameters)`` of one call."""
    leaves = [x.detach().requires_grad_() for x in (q, k, v, *params.values())]
    local_params = dict(zip(params, leaves[3:]))
    o = flexsparse.attention(*leaves[:3], cfg, backend=backend, params=local_params, parallel=parallel)
    return o.detach(), torch.autograd.grad(o, leaves, grad, allow_unused=True)


def correctness(args, device: torch.device) -> list[dict]:
    world, rank = dist.get_world_size(), dist.get_rank()
    rows = []
    for name in args.methods or list(CONFIGS):
        n = (args.sizes or [65536])[0]
        q, k, v, grad, params = inputs(args, n, name, device, seed=n)
        o, grads = forward_backward(q, k, v, grad, params, CONFIGS[name], args.backend)
        layouts = [(f"ulysses {d}", d, ulysses(d, device)) for d in range(2, world + 1) if world % d == 0]
        layouts = [(label, d, parallel, parallel.ulysses_group) for label, d, parallel in layouts]
        if flexsparse.METHODS[name].ring is not None and world > 1:
            parallel = ring(device)
            layouts.append((f"ring {world}", world, parallel, parallel.ring_group))
        for layout, degree, parallel, group in layouts:
            shard = parallel.shard_index

            def piece(x):
                return x.tensor_split(degree, dim=2)[shard]
            o_p, grads_p = forward_backward(*(piece(x) for x in (q, k, v, grad)), params, CONFIGS[name],
                                            args.backend, parallel)
            errors = {"output": (o_p, piece(o))}
            errors.update({f"d{x}": (got, piece(want)) for x, got, want in zip("qkv", grads_p[:3], grads[:3])})
            for key, got, want in zip(params, grads_p[3:], grads[3:]):
                if want is None:
                    continue
                total = torch.zeros_like(want) if got is None else got.clone()
                dist.all_reduce(total, group=group)
                errors[f"d{key}"] = (total, want)
            for what, (got, want) in errors.items():
                row = {"method": name, "N": n, "layout": layout, "rank": rank, "tensor": what,
                       "rel_l2": rel_l2(got, want), "max_err": (got.float() - want.float()).abs().max().item()}
                rows.append(row)
    every = [None] * world
    dist.all_gather_object(every, rows)
    return [row for part in every for row in part]


def scaling(args, device: torch.device) -> list[dict]:
    world = dist.get_world_size()
    parallel = ulysses(world, device) if world > 1 else None
    rows = []
    for name in args.methods or ["llsa", "sla"]:
        for n in args.sizes or [262144]:
            q, k, v, grad, params = inputs(args, n, name, device, seed=n)
            if parallel is not None:
                q, k, v, grad = (x.tensor_split(world, dim=2)[parallel.ulysses_rank] for x in (q, k, v, grad))

            def step():
                return forward_backward(q, k, v, grad, params, CONFIGS[name], args.backend, parallel)
            ms = _bench_ms(step) if device.type == "cuda" else _wall_ms(step)
            comm = _all_to_all_ms(step, device) if parallel is not None else 0.0
            slowest = torch.tensor([ms, comm], dtype=torch.float64, device=device)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            rows.append({"method": name, "N": n, "P": world, "fwd_bwd_ms": slowest[0].item(),
                         "all_to_all_ms": slowest[1].item()})
    return rows


def overhead(args, device: torch.device) -> list[dict]:
    if dist.get_world_size() != 1:
        raise SystemExit("--part overhead runs in one process (--nproc-per-node 1)")
    parallel = ulysses(1, device)
    rows = []
    for name in args.methods or list(CONFIGS):
        for n in args.sizes or [65536]:
            q, k, v, grad, params = inputs(args, n, name, device, seed=n)
            best = {"none": float("inf"), "degree 1": float("inf")}
            for _ in range(3):
                for label, config in (("none", None), ("degree 1", parallel)):
                    def step():
                        return forward_backward(q, k, v, grad, params, CONFIGS[name], args.backend, config)
                    best[label] = min(best[label], _bench_ms(step) if device.type == "cuda" else _wall_ms(step))
            rows.append({"method": name, "N": n, "none_ms": best["none"], "degree1_ms": best["degree 1"],
                         "ratio": best["degree 1"] / best["none"]})
    return rows


def _bench_ms(step) -> float:
    from triton.testing import do_bench
    return do_bench(step, warmup=5, rep=50)


def _wall_ms(step, repeats: int = 3) -> float:
    import time
    step()
    start = time.perf_counter()
    for _ in range(repeats):
        step()
    return (time.perf_counter() - start) / repeats * 1e3


def _all_to_all_ms(step, device: torch.device) -> float:
    """Time of one step's all-to-all kernels (CUDA) or ops (CPU) in the profiler, in ms."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    total_us = 0.0
    for event in prof.key_averages():
        name = event.key.lower()
        if "alltoall" in name.replace("_", "") or "sendrecv" in name:
            total_us += event.device_time_total if device.type == "cuda" else event.cpu_time_total
    return total_us / 1e3


def combine(folder: str) -> None:
    """Efficiency T1 / (P T_P) from the scaling files of ``folder`` (one per world size)."""
    rows = [row for path in sorted(glob.glob(os.path.join(folder, "scaling_P*.json")))
            for row in json.load(open(path))["rows"]]
    single = {(r["method"], r["N"]): r["fwd_bwd_ms"] for r in rows if r["P"] == 1}
    for row in rows:
        t1 = single.get((row["method"], row["N"]))
        row["efficiency"] = None if t1 is None else t1 / (row["P"] * row["fwd_bwd_ms"])
    print(tabulate(rows, headers="keys", floatfmt=".3g"))


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.combine:
        combine(args.combine)
        return
    device = setup(torch.device(args.device).type)
    try:
        rows = {"correctness": correctness, "scaling": scaling, "overhead": overhead}[args.part](args, device)
        if dist.get_rank() == 0:
            os.makedirs(args.out, exist_ok=True)
            name = f"scaling_P{dist.get_world_size()}" if args.part == "scaling" else args.part
            meta = {"args": vars(args), "torch": torch.__version__, "device": str(device),
                    "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None}
            with open(os.path.join(args.out, f"{name}.json"), "w") as f:
                json.dump({**meta, "rows": rows}, f, indent=1)
            print(tabulate(rows, headers="keys", floatfmt=".3g"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
