"""Sequence parallelism (``flexsparse.ParallelConfig``) on CPU: 2 and 4 spawned gloo processes against one process.

Every registered method (fp64, torch backend; reference backend once) with GQA and a sequence length no degree
divides, and once with a K/V head count no degree divides (the heads replicated): each rank's output, LSE and q, k,
v gradients equal its shard of the one-process ones, and the sum over ranks of each learnable parameter's gradient
equals the one-process gradient. The patched path (``SparseSDPA``) with a token grid, a class token (``joint``) and
its dense fallbacks, the errors, and the absence of communication without a parallel config (or with degree 1) are
checked in the same processes.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import flexsparse as fs
from _parallel_testing import collectives_in, shard, spawn
from flexsparse.integration import RouteSDPA, SparseSDPA
from flexsparse.integration.joint import CallText
from helpers import SMALL_CONFIGS as CONFIGS

BATCH, HEADS, KV_HEADS, N, D = 2, 4, 2, 97, 16
TOL = dict(rtol=1e-9, atol=1e-11)


def test_every_registered_method_has_a_case():
    assert set(CONFIGS) == set(fs.METHODS)


def ulysses_mesh(world: int) -> fs.ParallelConfig:
    return fs.ParallelConfig(init_device_mesh("cpu", (world,), mesh_dim_names=("ulysses",)))


def learned_params(name: str, cfg: dict, heads: int = HEADS) -> dict[str, torch.Tensor]:
    """The method's parameters moved off their initial values (fp64, requiring gradients)."""
    initial = fs.METHODS[name].init_params(fs.Config.from_dict(cfg), D, heads, N)
    return {key: (value.double() + 0.1 * torch.randn(value.shape, dtype=torch.float64)).requires_grad_()
            for key, value in initial.items()}


def one_and_parallel(name: str, cfg: dict, backend: str, parallel: fs.ParallelConfig, piece, heads: int = HEADS,
                     kv_heads: int = KV_HEADS, **call):
    """``(one-process results, this rank's parallel results)``, each ``(o, lse, grads of q, k, v, params)``, on
    inputs of ``heads`` query and ``kv_heads`` K/V heads drawn alike on every rank; ``piece(x)``: this rank's part
    of the sequence of ``x``; ``call``: more arguments of both ``fs.attention`` calls."""
    q = torch.randn(BATCH, heads, N, D, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(BATCH, kv_heads, N, D, dtype=torch.float64, requires_grad=True) for _ in range(2))
    params = learned_params(name, cfg, heads)
    grad_o, grad_lse = torch.randn(BATCH, heads, N, D, dtype=torch.float64), torch.randn(BATCH, heads, N,
                                                                                        dtype=torch.float64)
    o, lse = fs.attention(q, k, v, cfg, backend=backend, return_lse=True, params=params, **call)
    leaves = [q, k, v, *params.values()]
    one = (o, lse, torch.autograd.grad((o * grad_o).sum() + (lse * grad_lse).sum(), leaves, allow_unused=True))
    q_r, k_r, v_r = (piece(x).detach().requires_grad_() for x in (q, k, v))
    params_r = {key: value.detach().clone().requires_grad_() for key, value in params.items()}
    o_r, lse_r = fs.attention(q_r, k_r, v_r, cfg, backend=backend, return_lse=True, params=params_r,
                              parallel=parallel, **call)
    loss = (o_r * piece(grad_o)).sum() + (lse_r * piece(grad_lse)).sum()
    grads = torch.autograd.grad(loss, [q_r, k_r, v_r, *params_r.values()], allow_unused=True)
    return one, (o_r, lse_r, grads)


def check_method(name, cfg, backend, parallel, rank, world, piece=None, **call):
    """This rank's results equal its part of the one-process results (``piece``: default, ``shard``); ``call``:
    ``one_and_parallel``'s head counts and more arguments of both calls."""
    piece = piece or (lambda x: shard(x, rank, world))
    (o, lse, grads), (o_r, lse_r, grads_r) = one_and_parallel(name, cfg, backend, parallel, piece, **call)
    where = f"{name} on {backend}, rank {rank} of {world}"
    torch.testing.assert_close(o_r, piece(o), **TOL, msg=lambda m: f"{where}, output: {m}")
    torch.testing.assert_close(lse_r, piece(lse), **TOL, msg=lambda m: f"{where}, LSE: {m}")
    for label, got, want in zip("qkv", grads_r[:3], grads[:3]):
        torch.testing.assert_close(got, piece(want), **TOL, msg=lambda m: f"{where}, d{label}: {m}")
    for index, (got, want) in enumerate(zip(grads_r[3:], grads[3:])):
        if want is None:   # a parameter this config does not use
            assert got is None, f"{where}: parameter {index} has a gradient only in the parallel run"
            continue
        total = torch.zeros_like(want) if got is None else got.clone()
        dist.all_reduce(total)
        torch.testing.assert_close(total, want, **TOL, msg=lambda m: f"{where}, parameter {index} gradient: {m}")


def _worker(rank: int, world: int) -> None:
    """Every check of this file in one group of processes (a spawn costs ~10 s)."""
    torch.manual_seed(0)   # the same inputs on every rank
    parallel = ulysses_mesh(world)
    for name, cfg in CONFIGS.items():
        check_method(name, cfg, "torch", parallel, rank, world)
    check_method("sla2", CONFIGS["sla2"], "reference", parallel, rank, world)
    # 3 KV heads replicated to 3 * world: each query head must meet its own KV head's copy
    check_method("topk", CONFIGS["topk"], "torch", parallel, rank, world, heads=3 * world, kv_heads=3)
    for name in ("llsa", "sla2"):       # joint text+visual: the text tokens in the last rank's shard
        check_method(name, CONFIGS[name], "torch", parallel, rank, world, joint=fs.Joint("suffix", 11))
    check_patched(rank, world)
    check_communication(rank, world)
    check_ring(rank, world)


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.exhaustive)])
def test_every_method_patched_or_not_equals_one_process_and_communicates_only_when_parallel(world):
    spawn(_worker, world)


def check_patched(rank: int, world: int) -> None:
    grid, n = (8, 12), 96
    for cfg in (CONFIGS["llsa"], CONFIGS["vsa"]):
        one = SparseSDPA(cfg, head_dim=D, num_heads=HEADS, token_grid=grid).double()
        with torch.no_grad():
            for p in one.parameters():
                p.add_(0.1 * torch.randn_like(p))
        sharded = SparseSDPA(cfg, head_dim=D, num_heads=HEADS, token_grid=grid, parallel=ulysses_mesh(world))
        sharded.double().load_state_dict(one.state_dict())
        q, k, v = (torch.randn(BATCH, HEADS, n, D, dtype=torch.float64) for _ in range(3))
        got = sharded(*(shard(x, rank, world) for x in (q, k, v)))
        torch.testing.assert_close(got, shard(one(q, k, v), rank, world), **TOL)
        cross_k, cross_v = (torch.randn(BATCH, HEADS, 40, D, dtype=torch.float64) for _ in range(2))
        got = sharded(shard(q, rank, world), shard(cross_k, rank, world), shard(cross_v, rank, world))
        torch.testing.assert_close(got, shard(one(q, cross_k, cross_v), rank, world), **TOL)   # vsa sparse, llsa dense
        with pytest.raises(ValueError, match="attn_mask or is_causal"):
            sharded(*(shard(x, rank, world) for x in (q, k, v)), is_causal=True)
        q, k, v = (torch.randn(BATCH, HEADS, n + 1, D, dtype=torch.float64) for _ in range(3))   # a class token
        cls = fs.Joint("prefix", 1)
        got = sharded(*(shard(x, rank, world) for x in (q, k, v)), joint=cls)
        torch.testing.assert_close(got, shard(one(q, k, v, joint=cls), rank, world), **TOL)
        local = shard(q, rank, world)
        with RouteSDPA(sharded, text=CallText("prefix", 4, local.shape[2] - 4, "JoiningBlock")), \
                pytest.raises(ValueError, match="JoiningBlock joins its text.*each rank joins its own"):
            F.scaled_dot_product_attention(local, local, local)


def check_communication(rank: int, world: int) -> None:
    q = torch.randn(1, 4, 32, 8)
    cfg = CONFIGS["topk"]
    assert collectives_in(lambda: fs.attention(q, q, q, cfg, parallel=ulysses_mesh(world))), "no collective seen"
    assert collectives_in(lambda: fs.attention(q, q, q, cfg)) == []
    degree_one = fs.ParallelConfig(init_device_mesh("cpu", (world, 1), mesh_dim_names=("data", "ulysses")))
    assert collectives_in(lambda: fs.attention(q, q, q, cfg, parallel=degree_one)) == []
    with pytest.raises(ValueError, match=f"3 query heads are not divisible by {world}"):
        fs.attention(q[:, :3], q[:, :3], q[:, :3], cfg, parallel=ulysses_mesh(world))


def ring_parallel(world: int) -> fs.ParallelConfig:
    """Every rank on the ring dim (2 processes), or ring 2 x ulysses 2 (4 processes)."""
    dims = (world,) if world < 4 else (2, world // 2)
    return fs.ParallelConfig(init_device_mesh("cpu", dims, mesh_dim_names=("ring", "ulysses")[:len(dims)]))


def check_ring(rank: int, world: int) -> None:
    """Ring attention for the methods with a ring strategy (``full``: uneven chunks; ``topk`` and ``llsa``: whole
    blocks in every chunk but the last), alone or inside Ulysses, against one process; the errors."""
    made = fs.ParallelConfig.setup(2, "cpu", ring_degree=world // 2)
    assert (made.ring_degree, made.ulysses_degree, made.shard_index) == (world // 2, 2, rank)
    parallel = ring_parallel(world)
    shards = world
    chunked = [24 * 4 // shards] * (shards - 1) + [N - 24 * 4 // shards * (shards - 1)]   # 48 | 49, 24 x 3 | 25

    def piece(x):
        return x.split(chunked, dim=2)[parallel.shard_index]
    check_method("full", CONFIGS["full"], "torch", parallel, rank, world,
                 piece=lambda x: shard(x, parallel.shard_index, shards))
    check_method("topk", CONFIGS["topk"], "torch", parallel, rank, world, piece=piece)
    check_method("topk", CONFIGS["topk"], "reference", parallel, rank, world, piece=piece)
    check_method("llsa", CONFIGS["llsa"], "torch", parallel, rank, world, piece=piece)
    check_method("llsa", CONFIGS["llsa"], "reference", parallel, rank, world, piece=piece)
    q = torch.randn(1, 4, 20, 8)
    with pytest.raises(ValueError, match=r"ring attention .* runs the methods \['full', 'topk', 'llsa'\], not 'vsa'"):
        fs.attention(q, q, q, CONFIGS["vsa"], parallel=parallel)
    with pytest.raises(ValueError, match="joint attention runs under Ulysses sequence parallelism, not over a"):
        fs.attention(q, q, q, CONFIGS["topk"], parallel=parallel, joint=fs.Joint("prefix", 4))
    with pytest.raises(ValueError, match="SparseSDPA.*Ulysses sequence parallelism only"):
        SparseSDPA(CONFIGS["topk"], head_dim=8, num_heads=4, parallel=parallel)
    if parallel.ulysses_degree == 1:   # 20 + 20 tokens: the first chunk is not whole 8-token blocks
        with pytest.raises(ValueError, match=r"multiple of block_q=8 tokens, got chunk lengths \[20, 20\]"):
            fs.attention(q, q, q, CONFIGS["topk"], parallel=parallel)
        with pytest.raises(ValueError, match=r"multiple of block_size=8 tokens, got chunk lengths \[20, 20\]"):
            fs.attention(q, q, q, dict(CONFIGS["llsa"], block_size=8), parallel=parallel)


def test_parallel_config_errors():
    with pytest.raises(TypeError, match="DeviceMesh"):
        fs.ParallelConfig(mesh="sp")
    with pytest.raises(TypeError, match="parallel must be a flexsparse.ParallelConfig"):
        fs.attention(*(torch.randn(1, 2, 16, 8) for _ in range(3)), CONFIGS["topk"], parallel="sp")
    with pytest.raises(TypeError, match="parallel must be a flexsparse.ParallelConfig"):
        fs.SparseAttention(CONFIGS["topk"], head_dim=8, num_heads=2, parallel=2)


@pytest.mark.exhaustive
def test_multi_gpu_script_runs_on_cpu(tmp_path):
    """``benchmarks/sequence_parallel.py`` under torchrun with gloo: its correctness part finds the parallel results
    equal to one process (fp32, torch backend)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           os.path.join(root, "benchmarks", "sequence_parallel.py"), "--part", "correctness", "--device", "cpu",
           "--backend", "torch", "--dtype", "fp32", "--sizes", "1024", "--heads", "4", "--dim", "16",
           "--methods", "llsa", "vsa", "--out", str(tmp_path)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = json.loads((tmp_path / "correctness.json").read_text())["rows"]
    assert {row["method"] for row in rows} == {"llsa", "vsa"}
    assert max(row["rel_l2"] for row in rows) < 1e-5
