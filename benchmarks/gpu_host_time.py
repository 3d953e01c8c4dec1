"""Host time and CUDA kernels per eager call of every method on ``backend="triton"``, dense SDPA beside it. Not a
``python -m flexsparse`` case: the runner times calls on the device, this times what the host spends issuing them.

Per method (its example config, parameters moved off their initial values as the runner does): the ``no_grad``
forward and forward+backward (gradients of q, k, v for a fixed upstream gradient), the latter also with the backward
on the calling thread (``torch.autograd.set_multithreading_enabled(False)``), at B1 H1 D64 bf16, where the GPU
work per call is far below the host's. Host time: wall time of 100 calls in a row without a sync, divided by 100
(the queue stays short of the GPU, so this is the host's issue rate), the least of ``--rounds`` rounds and the
median, in three modes in alternating rounds: small calls replaying CUDA graphs (``flexsparse.eager_graphs``, the
default), eager (``FLEXSPARSE_EAGER_GRAPHS=0``), and eager with every launch through Triton's own path.
Kernels (eager): CUDA kernels of one call in the profiler. Launch (eager): the host time per call inside the launch
path (flexsparse's ``FastLaunch.launch``, or Triton's ``JITFunction.run`` where a launch goes through it: argument
binding and specialization, cache lookup, the launch itself), in total and per kernel. Writes
``bench_out/host_time.json`` and prints a table. ``--stages``: instead, where a forward+backward's host time goes on
the autograd engine's device thread and on the calling thread (``backward_stages``).

    python benchmarks/gpu_host_time.py [--n 4096] [--methods topk llsa sla sla2 vsa] [--rounds 5] [--core 3]
    python benchmarks/gpu_host_time.py --stages [--methods ...]
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F
from tabulate import tabulate
from triton.runtime.jit import JITFunction

from flexsparse.bench import env_var
from flexsparse.bench.measure import build_module
from flexsparse.triton._runtime import fast_launch
from flexsparse.methods import METHODS

CALLS = 100
MODES = {"graphs": ("1", True), "eager": ("0", True), "eager, Triton's launch path": ("0", False)}


def host_ms(call, rounds: int) -> dict[str, tuple[float, float]]:
    """``(least, median)`` by mode (``MODES``) over ``rounds`` of the host milliseconds per call of ``CALLS`` calls in
    a row: small calls through CUDA graphs (``flexsparse.eager_graphs``), eager with launches through ``FastLaunch``,
    and eager through Triton's ``JITFunction.run`` (``fast_launch.ENABLED``); rounds alternate so that every mode
    sees the same host."""
    enabled = fast_launch.ENABLED
    per_call = {mode: [] for mode in MODES}
    try:
        for mode, (use_graphs, fast) in MODES.items():
            with env_var("FLEXSPARSE_EAGER_GRAPHS", use_graphs):
                for _ in range(20):
                    call()
        torch.cuda.synchronize()
        for _ in range(rounds):
            for mode, (use_graphs, fast) in MODES.items():
                fast_launch.ENABLED = enabled and fast
                with env_var("FLEXSPARSE_EAGER_GRAPHS", use_graphs):
                    start = time.perf_counter()
                    for _ in range(CALLS):
                        call()
                    per_call[mode].append(1e3 * (time.perf_counter() - start) / CALLS)
                    torch.cuda.synchronize()
    finally:
        fast_launch.ENABLED = enabled
    return {mode: (min(times), statistics.median(times)) for mode, times in per_call.items()}


def kernels_per_call(call) -> int:
    """CUDA kernels one ``call()`` launches (the profiler's device events)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    return sum(1 for event in prof.events() if event.device_type == torch.autograd.DeviceType.CUDA)


def launch_us(call) -> dict[str, float]:
    """Microseconds per ``call()`` spent in the launch path, by kernel name (mean over ``CALLS`` calls): inside
    ``FastLaunch.launch`` (flexsparse's eager path) or, for a launch that does not go through it, inside
    ``JITFunction.run``."""
    spent, depth = collections.Counter(), [0]

    def timed(method, name_of):
        def run(self, *args, **kwargs):
            depth[0] += 1
            start = time.perf_counter()
            try:
                return method(self, *args, **kwargs)
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    spent[name_of(self)] += time.perf_counter() - start
        return run

    fast = fast_launch.FastLaunch
    originals = JITFunction.run, fast.launch
    JITFunction.run = timed(JITFunction.run, lambda kernel: kernel.fn.__name__)
    fast.launch = timed(fast.launch, lambda launcher: launcher.kernel.fn.__name__)
    try:
        for _ in range(CALLS):
            call()
    finally:
        JITFunction.run, fast.launch = originals
    torch.cuda.synchronize()
    return {name: 1e6 * seconds / CALLS for name, seconds in spent.items()}


def leaves(n: int) -> tuple[torch.Tensor, ...]:
    """Fresh ``(1, 1, n, 64)`` bf16 CUDA q, k, v leaves and an upstream gradient of their shape."""
    q, k, v = (torch.randn(1, 1, n, 64, dtype=torch.bfloat16, device="cuda", requires_grad=True) for _ in range(3))
    return q, k, v, torch.randn(1, 1, n, 64, dtype=torch.bfloat16, device="cuda")


def calls(fn, n: int):
    """``{"fwd": ..., "fwd+bwd": ..., "fwd+bwd, one thread": ...}`` calls of ``fn(q, k, v)`` on fresh
    ``(1, 1, n, 64)`` bf16 leaves; the last runs the backward on the calling thread
    (``torch.autograd.set_multithreading_enabled(False)``) instead of the autograd engine's device thread."""
    q, k, v, grad = leaves(n)

    def forward():
        with torch.no_grad():
            fn(q, k, v)

    def one_thread():
        with torch.autograd.set_multithreading_enabled(False):
            return torch.autograd.grad(fn(q, k, v), (q, k, v), grad)

    return {"fwd": forward, "fwd+bwd": lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), grad),
            "fwd+bwd, one thread": one_thread}


def python_loop_us() -> float:
    """Microseconds of a fixed pure-Python loop: the interpreter's speed on the thread that runs it."""
    start = time.perf_counter()
    total = 0
    for i in range(2000):
        total += i
    return 1e6 * (time.perf_counter() - start)


def backward_stages(fn, n: int, calls: int = 240) -> dict[str, dict[str, float]]:
    """``{"engine thread": ..., "calling thread": ...}``: medians (µs) over ``calls`` forward+backward calls of
    ``fn(q, k, v)`` on fresh ``(1, 1, n, 64)`` bf16 leaves, alternating the two threads in blocks of 40: ``in`` from
    ``autograd.grad`` to the start of the output's backward node, ``body`` that node, ``out`` from its end back to
    the caller (a pre-hook and a hook on the node mark them); ``loop`` and ``loop in backward``: ``python_loop_us``
    on the calling thread before the call and in the node's pre-hook (between ``in`` and ``body``). A method whose
    output node is its whole backward (one node) puts all its backward's host time in ``body``."""
    q, k, v, grad = leaves(n)
    marks: dict[str, float] = {}

    def pre_hook(grad_outputs):
        marks["start"] = time.perf_counter()
        marks["loop in backward"] = python_loop_us()
        marks["body"] = time.perf_counter()

    def hook(grad_inputs, grad_outputs):
        marks["end"] = time.perf_counter()

    def one(multithreaded: bool) -> dict[str, float]:
        with torch.autograd.set_multithreading_enabled(multithreaded):
            loop = python_loop_us()
            out = fn(q, k, v)
            out.grad_fn.register_prehook(pre_hook)
            out.grad_fn.register_hook(hook)
            called = time.perf_counter()
            torch.autograd.grad(out, (q, k, v), grad)
            returned = time.perf_counter()
        return {"in": 1e6 * (marks["start"] - called), "body": 1e6 * (marks["end"] - marks["body"]),
                "out": 1e6 * (returned - marks["end"]), "loop": loop, "loop in backward": marks["loop in backward"]}

    threads = {"engine thread": True, "calling thread": False}
    for _ in range(20):
        for multithreaded in threads.values():
            one(multithreaded)
    torch.cuda.synchronize()
    samples: dict[str, list] = {name: [] for name in threads}
    for _ in range(calls // 80):
        for name, multithreaded in threads.items():
            samples[name] += [one(multithreaded) for _ in range(40)]
            torch.cuda.synchronize()
    return {name: {key: statistics.median(s[key] for s in rows) for key in rows[0]} for name, rows in samples.items()}


def stages_main(args) -> None:
    rows = []
    for name in args.methods:
        fn = build_module(METHODS[name].example, "triton", 64, 1, args.n, "cuda")
        for thread, stages in backward_stages(fn, args.n).items():
            rows.append([name, thread, *(f"{stages[key]:.0f}" for key in ("in", "body", "out")),
                         f"{stages['loop']:.0f}", f"{stages['loop in backward']:.0f}"])
    print(tabulate(rows, headers=["method", "backward on", "in us", "body us", "out us", "loop us (caller)",
                                  "loop us (in backward)"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--methods", nargs="+", default=["topk", "llsa", "sla", "sla2", "vsa"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default="bench_out")
    parser.add_argument("--core", type=int, help="pin the process to this CPU before CUDA starts: the autograd "
                        "engine's device thread, created later, inherits it, so the backward runs on the core that "
                        "ran the forward")
    parser.add_argument("--stages", action="store_true", help="where a forward+backward's host time goes on each "
                        "thread (backward_stages) instead of the host times")
    args = parser.parse_args()
    if args.core is not None:
        os.sched_setaffinity(0, {args.core})
    if args.stages:
        stages_main(args)
        return
    rows, results = [], {}
    for name in ["sdpa"] + args.methods:
        fn = (F.scaled_dot_product_attention if name == "sdpa"
              else build_module(METHODS[name].example, "triton", 64, 1, args.n, "cuda"))
        for phase, call in calls(fn, args.n).items():
            times = host_ms(call, args.rounds)
            with env_var("FLEXSPARSE_EAGER_GRAPHS", "0"):
                count, launches = kernels_per_call(call), launch_us(call)
            results[f"{name} {phase}"] = {"host_ms": {mode: least for mode, (least, _) in times.items()},
                                          "host_median_ms": {mode: median for mode, (_, median) in times.items()},
                                          "kernels": count, "launch_us": launches}
            rows.append([name, phase, *(f"{times[mode][0]:.3f}" for mode in MODES), f"{times['graphs'][1]:.3f}",
                         count, f"{sum(launches.values()):.0f}",
                         ", ".join(f"{kernel.strip('_')} {us:.0f}" for kernel, us in launches.items())])
    print(tabulate(rows, headers=["method", "phase", *(f"host ms, {mode}" for mode in MODES), "median, graphs",
                                  "kernels (eager)", "launch us (eager)", "by kernel"]))
    os.makedirs(args.out, exist_ok=True)
    env = {"torch": torch.__version__, "device": torch.cuda.get_device_name(), "n": args.n, "core": args.core}
    with open(os.path.join(args.out, "host_time.json"), "w") as f:
        json.dump({"env": env, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
