"""Host (Python + dispatch) cost of one eager call per method on ``backend="triton"``, against its GPU time.

For each method of ``flexsparse.bench.DEMO_CONFIGS`` and each N (B=2, H=8, D=64, bf16, CUDA):

* ``gpu_ms``: the forward replayed from a CUDA graph (no host work; ``gpu_llsa.bench_graph``);
* ``eager_ms``, ``eager_fwd_bwd_ms``: the eager forward and forward + backward, ``do_bench`` medians;
* ``host_ms``: wall time to enqueue one eager forward while the GPU is kept busy by ``torch.cuda._sleep``
  (so the queue never drains; a call that waits on the GPU shows up as ``host_ms`` near the sleep);
* ``host_fwd_bwd_ms``: the same for forward + backward.

``--compiled`` adds ``compiled_ms``, ``compiled_host_ms`` and ``compiled_fwd_bwd_ms`` (``do_bench``), the calls
of ``torch.compile(module, fullgraph=True, mode=--compile-mode)`` (``reduce-overhead``: CUDA graphs, no launch cost
per kernel). ``--profile`` adds cProfile's 30 functions with the largest own and
cumulative time over 20 eager forwards per row.

    python benchmarks/host_overhead.py OUT.json [--sizes 16384 65536] [--methods topk vsa llsa sla sla2]
        [--compiled [--compile-mode reduce-overhead]] [--profile]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time

import torch
from gpu_llsa import bench_graph
from triton.testing import do_bench

from flexsparse.bench import DEMO_CONFIGS, build, random_qkv

B, H, D = 2, 8, 64
SLEEP_CYCLES = 2_000_000_000  # ~1 s of GPU time: longer than any batch of enqueued calls below


def enqueue_ms(fn, calls: int = 10) -> float:
    """Host milliseconds per call of ``fn`` while the GPU is busy with a long sleep kernel."""
    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return 1e3 * elapsed / calls


def top_functions(fn, calls: int = 20, limit: int = 30) -> str:
    """cProfile's tables of the ``limit`` functions with the largest own and cumulative time over ``calls``
    calls."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    profiler.disable()
    text = io.StringIO()
    for key in ("tottime", "cumulative"):
        pstats.Stats(profiler, stream=text).sort_stats(key).print_stats(limit)
    return text.getvalue()


def measure(method: str, n: int, compiled: bool, profile: bool, compile_mode: str | None = None) -> dict:
    """One row: the timings above for ``method`` at length ``n``."""
    module = build(DEMO_CONFIGS[method], "triton", D, H, n, "cuda", torch.bfloat16)
    q, k, v = random_qkv(B, H, n, D, torch.bfloat16, "cuda", requires_grad=True)
    grad = torch.randn_like(q)

    def forward():
        with torch.no_grad():
            return module(q, k, v)

    def forward_backward():
        torch.autograd.grad(module(q, k, v), (q, k, v), grad)

    row = {"method": method, "n": n, "gpu_ms": bench_graph(forward),
           "eager_ms": do_bench(forward, return_mode="median"),
           "eager_fwd_bwd_ms": do_bench(forward_backward, return_mode="median"),
           "host_ms": enqueue_ms(forward), "host_fwd_bwd_ms": enqueue_ms(forward_backward)}
    if compiled:
        compiled_module = torch.compile(module, fullgraph=True, mode=compile_mode)

        def compiled_forward():
            with torch.no_grad():
                return compiled_module(q, k, v)

        def compiled_forward_backward():
            torch.autograd.grad(compiled_module(q, k, v), (q, k, v), grad)

        compiled_forward()
        row["compiled_ms"] = do_bench(compiled_forward, return_mode="median")
        row["compiled_host_ms"] = enqueue_ms(compiled_forward)
        compiled_forward_backward()
        row["compiled_fwd_bwd_ms"] = do_bench(compiled_forward_backward, return_mode="median")
    if profile:
        row["profile"] = top_functions(forward)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--sizes", type=int, nargs="+", default=[16384, 65536])
    parser.add_argument("--methods", nargs="+", default=["topk", "vsa", "llsa", "sla", "sla2"])
    parser.add_argument("--compiled", action="store_true")
    parser.add_argument("--compile-mode", default=None, help="torch.compile mode, e.g. reduce-overhead")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    # every method and grad mode is a variant of SparseAttention.forward: more than dynamo's default 8
    torch._dynamo.config.recompile_limit = 64
    rows = []
    for n in args.sizes:
        for method in args.methods:
            row = measure(method, n, args.compiled, args.profile, args.compile_mode)
            print(json.dumps({key: value for key, value in row.items() if key != "profile"}), flush=True)
            rows.append(row)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "B": B, "H": H, "D": D,
            "compile_mode": args.compile_mode}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
