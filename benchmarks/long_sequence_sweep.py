"""Robustness sweep at long sequences (GPU): less common configs forward and backward on two backends each.

Block sizes 16-128, head dims 32-128 (96: not a power of two), fp16 / bf16 / fp32, GQA, LLSA with three levels at
N = 262144 and an odd N: each case runs ``flexsparse.SparseAttention`` on both of its backends from the same
inputs and reports the relative L2 difference of the output and of dq, dk, dv, or the error a backend raised
(the short-sequence GPU tests missed a compile failure of 128x128 blocks on flex that only N = 65536 showed).

    python benchmarks/long_sequence_sweep.py OUT.json
"""
from __future__ import annotations

import json
import sys
import time

import torch

import flexsparse
from flexsparse.bench import rel_l2

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
CASES = [  # (config, (B, H, Hk, N, D), dtype, backends)
    ({"method": "topk", "block_size": 16, "topk": 64}, (1, 4, 4, 65536, 64), BF16, ("flex", "triton")),
    ({"method": "topk", "block_size": 32, "topk": 32}, (1, 4, 2, 65536, 64), BF16, ("flex", "triton")),
    ({"method": "topk", "block_size": 128, "topk": 8}, (1, 4, 4, 65536, 128), FP16, ("flex", "triton")),
    ({"method": "vsa", "block_size": 32, "topk": 16}, (1, 4, 4, 65536, 64), BF16, ("flex", "triton")),
    ({"method": "sla", "block_size": 128, "topk_ratio": 0.05}, (1, 4, 4, 65536, 64), BF16, ("flex", "triton")),
    ({"method": "sla2", "block_q": 128, "block_k": 64, "topk_ratio": 0.05}, (1, 4, 4, 32768, 128), BF16,
     ("flex", "triton")),
    ({"method": "llsa", "block_size": 16, "topk": 8}, (1, 2, 2, 262144, 64), BF16, ("flex", "triton")),
    ({"method": "topk", "block_size": 64, "topk": 8}, (1, 4, 4, 32768, 128), FP32, ("flex", "triton")),
    ({"method": "topk", "block_size": 64, "topk": 16}, (1, 4, 4, 65536, 32), BF16, ("triton", "torch")),
    ({"method": "topk", "block_size": 64, "topk": 16}, (1, 4, 4, 65536, 96), BF16, ("triton", "torch")),
    ({"method": "llsa", "block_size": 16, "topk": 8}, (1, 4, 4, 65536, 32), BF16, ("triton", "torch")),
    ({"method": "llsa", "block_size": 16, "topk": 8}, (1, 4, 4, 65536, 96), BF16, ("triton", "torch")),
    ({"method": "sla", "block_size": 64, "topk_ratio": 0.05}, (1, 4, 4, 65536, 96), BF16, ("triton", "torch")),
    ({"method": "llsa", "block_size": 16, "topk": 8}, (1, 4, 1, 65537, 64), BF16, ("triton", "flex")),
]


def run_case(cfg: dict, shape: tuple, dtype: torch.dtype, backends: tuple) -> dict:
    """Output and gradients of ``cfg`` on each backend from the same inputs, compared (or the errors)."""
    b, h, hk, n, d = shape
    gen = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(b, h, n, d, device="cuda", dtype=dtype, generator=gen)
    k, v = (torch.randn(b, hk, n, d, device="cuda", dtype=dtype, generator=gen) for _ in range(2))
    grad = torch.randn_like(q)
    row = {"config": cfg, "shape": list(shape), "dtype": str(dtype).split(".")[-1], "backends": list(backends)}
    start, results = time.time(), []
    for backend in backends:
        try:
            module = flexsparse.SparseAttention(cfg, head_dim=d, num_heads=h, seq_len=n, backend=backend).cuda()
            leaves = [x.detach().requires_grad_() for x in (q, k, v)]
            out = module(*leaves)
            results.append([out.detach(), *torch.autograd.grad(out, leaves, grad)])
        except Exception as exc:  # noqa: BLE001 - the sweep reports failures and goes on
            row[f"error_{backend}"] = f"{type(exc).__name__}: {str(exc)[:400]}"
    if len(results) == 2:
        row["rel_l2"] = {name: rel_l2(x, y) for name, x, y in zip(("out", "dq", "dk", "dv"), *results)}
    row["seconds"] = round(time.time() - start, 1)
    return row


def main() -> None:
    torch._dynamo.config.recompile_limit = 64   # one flex compile per case
    rows = []
    for cfg, shape, dtype, backends in CASES:
        rows.append(run_case(cfg, shape, dtype, backends))
        print(json.dumps(rows[-1]), flush=True)
        torch.cuda.empty_cache()
    with open(sys.argv[1], "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
