"""Run every LLSA Triton stage on its own with a device sync after each (find a faulting kernel), and compare the
outputs with the PyTorch implementation. Not a ``python -m flexsparse`` case: it calls the kernels' host functions
one by one, below the ops, to locate a fault.

``CUDA_LAUNCH_BLOCKING=1 python benchmarks/debug_stages.py [--n 4096 --heads 2 --kv-heads 1 --d 64 --levels 2]``,
or under ``compute-sanitizer --tool memcheck``.
"""
from __future__ import annotations

import argparse

import torch

from flexsparse.masks.levels import level_table, pack
from flexsparse.triton.common import csc
from flexsparse.triton.llsa import bwd as llsa_bwd
from flexsparse.triton.llsa import fwd as llsa_fwd
from flexsparse.triton.llsa.naive import llsa_attention
from flexsparse.triton.pooling import pool
from flexsparse.triton.pooling.naive import pool_pyramid
from flexsparse.triton.selection import hierarchy as select
from flexsparse.triton.selection.naive import hierarchical_topk


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--kv-heads", type=int, default=1)
    parser.add_argument("--d", type=int, default=64)
    parser.add_argument("--levels", type=int, default=2)
    parser.add_argument("--cpu", action="store_true", help="fp32 on CPU (needs TRITON_INTERPRET=1)")
    parser.add_argument("--torch-select", action="store_true",
                        help="pool and select in PyTorch (flexsparse.triton.pooling.naive, selection.naive)")
    args = parser.parse_args()
    device, dtype = ("cpu", torch.float32) if args.cpu else ("cuda", torch.bfloat16)
    torch.manual_seed(0)
    n, d, block, topk = args.n, args.d, 16, (8,) * args.levels
    levels = level_table(n, block, topk)
    shape_q, shape_k = (args.batch, args.heads, n, d), (args.batch, args.kv_heads, n, d)
    q = torch.randn(shape_q, device=device, dtype=dtype)
    k, v = (torch.randn(shape_k, device=device, dtype=dtype) for _ in range(2))
    do = torch.randn_like(q)

    def stage(name, fn):
        out = fn()
        if device == "cuda":
            torch.cuda.synchronize()
        print(f"ok  {name}", flush=True)
        return out

    if args.torch_select:
        q_lv, k_lv, v_lv = (pool_pyramid(x, block, args.levels) for x in (q, k, v))
        k_pyr, v_pyr = torch.cat(k_lv, 2), torch.cat(v_lv, 2)
        sel = pack(hierarchical_topk(q_lv, k_lv, topk, block, n))
    else:
        q_pyr = stage("pool q", lambda: pool.pool_pyramid(q, levels))
        k_pyr = stage("pool k", lambda: pool.pool_pyramid(k, levels))
        v_pyr = stage("pool v", lambda: pool.pool_pyramid(v, levels))
        sel = stage("select", lambda: select.hierarchical_topk(q_pyr, k_pyr, levels))
        want = hierarchical_topk(levels.split_pyramid(q_pyr), levels.split_pyramid(k_pyr), topk, block, n)
        print("selection rows equal to PyTorch's:", [(a == b).all(-1).float().mean().item()
                                                 for a, b in zip(levels.unpack(sel).indices, want.indices)])
    print("selection range", sel.min().item(), sel.max().item(), flush=True)
    o, lse = stage("forward", lambda: llsa_fwd.llsa_forward(q, k, v, k_pyr, v_pyr, sel, levels, d**-0.5))
    offsets, rows = stage("csc", lambda: csc.selection_csc(sel, levels))
    grads = stage("backward", lambda: llsa_bwd.llsa_backward(do, None, q, k, v, k_pyr, v_pyr, sel, offsets, rows, o,
                                                             lse, levels, d**-0.5, False))
    leaves = [x.float().requires_grad_() for x in (q, k, v)] + [x.clone().requires_grad_() for x in (k_pyr, v_pyr)]
    ref_o, ref_lse = llsa_attention(leaves[0], [leaves[1], *levels.split_pyramid(leaves[3])],
                                    [leaves[2], *levels.split_pyramid(leaves[4])], levels.unpack(sel), d**-0.5)
    ref_o.backward(do.float())
    print("rel err o", rel(o, ref_o), "lse", rel(lse, ref_lse))
    for name, a, b in zip(["dq", "dk", "dv", "dkc", "dvc"], grads, [x.grad for x in leaves]):
        print(f"rel err {name}", rel(a, b))


if __name__ == "__main__":
    main()
