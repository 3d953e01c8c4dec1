"""One LLSA ``backend="triton"`` forward+backward for Nsight Compute: warm-up calls first, then the profiled call
between ``cudaProfilerStart``/``Stop``, so ``ncu --profile-from-start off`` sees only the kernels of one call. Not a
``python -m flexsparse`` case: the runner times many calls, a profiler wants exactly one between its marks.

    ncu --profile-from-start off --section SpeedOfLight --section Occupancy --section LaunchStats \
        --section WarpStateStats python benchmarks/ncu_llsa.py [--n 65536 --levels 2 --d 64]
"""
from __future__ import annotations

import argparse

import torch

import flexsparse


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=65536)
    parser.add_argument("--levels", type=int, default=2)
    parser.add_argument("--d", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    args = parser.parse_args()
    cfg = {"method": "llsa", "block_size": 16, "topk": 8, "levels": args.levels}
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = (args.batch, args.heads, args.n, args.d)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
               for _ in range(3))
    grad = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen)

    def step():
        torch.autograd.grad(flexsparse.attention(q, k, v, cfg, backend="triton"), (q, k, v), grad)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    step()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
