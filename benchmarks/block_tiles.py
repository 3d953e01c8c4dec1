"""Tile configurations of the block-sparse kernels (forward, dQ, dK/dV), timed kernel by kernel.

The block-sparse forward and backward (``flexsparse/triton/block_fwd.py``, ``block_bwd.py``) on one random
selection of ``K`` key blocks per query block (64x64 blocks, bf16), at the two shapes of issue #5: B2 H8 N65536
D64 K=51 and the public SLA shape B2 H16 N32760 D128 K=25. ``--blocks 128x128`` (query x key tokens) keeps the
density: K scales with the number of key blocks. A configuration is a ``FLEXSPARSE_TRITON_TILES``
value (``{"block_fwd": {...}, "block_bwd": {...}}``) on top of the defaults. For each it times
``block_forward`` and ``block_backward`` (both kernels and the ``longest_first`` order; the CSC is built once
outside) with ``triton.testing.do_bench`` (median), the dQ and dK/dV kernels from the profiler, and checks o,
dq, dk, dv against the first configuration (max abs difference: only the summation order may differ).

    python benchmarks/block_tiles.py OUT.json [--shapes d64,d128] [--blocks 64x64] [--configs JSON-list]
"""
from __future__ import annotations

import argparse
import json
import platform

import torch
import triton
from tabulate import tabulate

from flexsparse.triton import block_bwd
from flexsparse.triton.block_fwd import block_forward, forward_tiles
from flexsparse.triton.csc import block_csc
from gpu_llsa import kernel_times

SHAPES = {"d64": (2, 8, 65536, 64, 51), "d128": (2, 16, 32760, 128, 25)}
CONFIGS = [
    {},
    {"block_bwd": {"dkv_warps": 8}},
    {"block_bwd": {"dkv_stages": 3}},
    {"block_bwd": {"DKV_BM": 32}},
    {"block_fwd": {"stages": 3}},
    {"block_fwd": {"warps": 8}},
    {"block_fwd": {"KB": 2}},
]


def random_selection(bsz: int, heads: int, tq: int, tk: int, topk: int) -> torch.Tensor:
    """``(B, H, Tq, K)`` int32: K distinct random key blocks per query block, ascending."""
    scores = torch.rand(bsz, heads, tq, tk, device="cuda")
    return scores.topk(topk, dim=-1).indices.sort(dim=-1).values.to(torch.int32)


def run_shape(name: str, configs: list[dict], block_q: int = 64, block_k: int = 64) -> list[dict]:
    bsz, heads, n, d, topk = SHAPES[name]
    topk = max(1, topk * 64 // block_k)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(bsz, heads, n, d, device="cuda", dtype=torch.bfloat16, generator=gen)
                   for _ in range(4))
    tq, tk = triton.cdiv(n, block_q), triton.cdiv(n, block_k)
    indices = random_selection(bsz, heads, tq, tk, topk)
    scale = d ** -0.5
    offsets, rows = block_csc(indices, tk)
    fwd_base = forward_tiles(q.device, d, q.dtype)
    bwd_base = block_bwd.backward_tiles(q.device, d, q.dtype)
    flops = 4.0 * bsz * heads * n * topk * block_k * d  # forward FLOPs; the backward has 2.5x
    reference = None
    out = []
    for options in configs:
        fwd_tiles = {**fwd_base, **options.get("block_fwd", {})}
        bwd_tiles = {**bwd_base, **options.get("block_bwd", {})}

        def forward():
            return block_forward(q, k, v, indices, block_q, block_k, scale, fwd_tiles)

        o, lse = forward()

        def backward():
            return block_bwd.block_backward(do, None, q, k, v, indices, offsets, rows, o, lse, block_q, block_k,
                                            scale, bwd_tiles)

        row = {"shape": name, "blocks": f"{block_q}x{block_k}", "K": topk,
               "config": json.dumps(options) if options else "defaults"}
        try:
            results = (o, *backward())
            if reference is None:
                reference = results
            row["max_diff"] = max((a.float() - b.float()).abs().max().item() for a, b in zip(results, reference))
            row["fwd_ms"] = triton.testing.do_bench(forward, warmup=50, rep=300, return_mode="median")
            row["bwd_ms"] = triton.testing.do_bench(backward, warmup=50, rep=300, return_mode="median")
            kernels = kernel_times(backward)
            row["dq_ms"] = sum(t for key, t in kernels.items() if "dq_kernel" in key)
            row["dkv_ms"] = sum(t for key, t in kernels.items() if "dkv_kernel" in key)
            row["fwd_tflops"] = flops / row["fwd_ms"] / 1e9
            row["bwd_tflops"] = 2.5 * flops / row["bwd_ms"] / 1e9
        except Exception as exc:  # a benchmark: record and go on
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        print(row, flush=True)
        out.append(row)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--shapes", default="d64,d128")
    parser.add_argument("--blocks", default="64x64", help="query x key block tokens")
    parser.add_argument("--configs", default="", help="JSON list of FLEXSPARSE_TRITON_TILES-style dicts "
                        "(default: the built-in list; {} is the defaults)")
    args = parser.parse_args()
    configs = json.loads(args.configs) if args.configs else CONFIGS
    block_q, block_k = (int(x) for x in args.blocks.split("x"))
    rows = []
    for name in args.shapes.split(","):
        rows += run_shape(name, configs, block_q, block_k)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "python": platform.python_version(), "shapes": {s: SHAPES[s] for s in args.shapes.split(",")}}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    keys = ["shape", "blocks", "K", "config", "fwd_ms", "bwd_ms", "dq_ms", "dkv_ms", "fwd_tflops", "bwd_tflops",
            "max_diff", "error"]
    print(tabulate([[row.get(key, "") for key in keys] for row in rows], headers=keys, floatfmt=".3f"))


if __name__ == "__main__":
    main()
