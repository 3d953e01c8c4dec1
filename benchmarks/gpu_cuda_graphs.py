"""GPU benchmark of every method on ``backend="triton"`` eager (small calls replaying flexsparse's own CUDA graphs,
``flexsparse.eager_graphs``, and with them off), under ``torch.compile(mode="reduce-overhead")`` and under
``torch.cuda.make_graphed_callables``. Not a ``python -m flexsparse`` case: the runner times one call, this
times the calls a training loop makes, with their graph bookkeeping.

Per method (its example config, parameters moved off their initial values as the runner does) and N: the
``no_grad`` forward and a training step (gradients of q, k, v and the trainable parameters reset, forward, backward
with a fixed upstream gradient), each step after ``torch.compiler.cudagraph_mark_step_begin()``; do_bench medians in
ms after three warm-up steps; B2 H8 D64 bf16.
Dense cuDNN SDPA in the same run. Writes ``bench_out/cuda_graphs.json`` and prints a table.

    python benchmarks/gpu_cuda_graphs.py [--sizes 4096 16384] [--methods llsa sla ...]
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F
from tabulate import tabulate
from triton.testing import do_bench

from flexsparse.bench import env_var
from flexsparse.bench.measure import build_module
from flexsparse.methods import METHODS

B, H, D = 2, 8, 64
KINDS = ("eager", "eager, no graphs", "reduce-overhead", "make_graphed_callables")


def attention_fn(kind: str, method: str | None, n: int, sample):
    """The callable a loop of ``kind`` runs and the parameters it trains (dense SDPA for ``method=None``)."""
    if method is None:
        return F.scaled_dot_product_attention, []
    module = build_module(METHODS[method].example, "triton", D, H, n, "cuda")
    params = [p for p in module.parameters() if p.requires_grad]
    if kind == "reduce-overhead":
        return torch.compile(module, mode="reduce-overhead"), params
    if kind == "make_graphed_callables":
        return torch.cuda.make_graphed_callables(module, tuple(x.detach().clone().requires_grad_() for x in sample)), \
            params
    return module, params


def time_loop(kind: str, method: str | None, q, k, v, grad) -> dict:
    """Forward and training-step medians (ms) of one loop kind, and its setup time (s)."""
    if kind == "eager, no graphs":
        with env_var("FLEXSPARSE_EAGER_GRAPHS", "0"):
            return time_loop("eager", method, q, k, v, grad)
    start = time.time()
    torch._dynamo.reset()
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    fn, params = attention_fn(kind, method, q.shape[2], leaves)

    def step():
        torch.compiler.cudagraph_mark_step_begin()
        for x in leaves + params:
            x.grad = None
        fn(*leaves).backward(grad)

    def forward():
        torch.compiler.cudagraph_mark_step_begin()
        with torch.no_grad():
            fn(q, k, v)

    for _ in range(3):
        step()
        forward()
    torch.cuda.synchronize()
    setup = time.time() - start
    return {"fwd_ms": do_bench(forward, warmup=10, rep=50), "step_ms": do_bench(step, warmup=10, rep=50),
            "setup_s": setup}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--methods", nargs="+", default=["llsa", "sla", "sla2", "topk", "vsa"])
    parser.add_argument("--out", default="bench_out/cuda_graphs.json")
    args = parser.parse_args()
    rows, results = [], []
    for n in args.sizes:
        gen = torch.Generator(device="cuda").manual_seed(n)
        q, k, v, grad = (torch.randn(B, H, n, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
        dense = time_loop("eager", None, q, k, v, grad)
        rows.append([n, "dense SDPA", f"{dense['fwd_ms']:.3f} / {dense['step_ms']:.3f}", "", ""])
        results.append({"n": n, "method": "sdpa", "eager": dense})
        for method in args.methods:
            timed = {kind: time_loop(kind, method, q, k, v, grad) for kind in KINDS}
            rows.append([n, method, *(f"{timed[kind]['fwd_ms']:.3f} / {timed[kind]['step_ms']:.3f}" for kind in KINDS)])
            results.append({"n": n, "method": method, **timed})
    print(tabulate(rows, headers=["N", "method", *(f"{kind} fwd / step ms" for kind in KINDS)]))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"shape": {"batch": B, "heads": H, "dim": D, "dtype": "bf16"}, "torch": torch.__version__,
                   "device": torch.cuda.get_device_name(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
