"""Timers: every measured time of a call, in milliseconds.

CUDA: ``triton.testing.do_bench`` (or ``do_bench_cudagraph`` for CUDA-graph replays), all of its samples.
CPU: wall-clock runs after one warm-up call. ``kernel_times``: a call's time by kernel (or ATen op), profiler.
Imports nothing from flexsparse, so ``worker.py`` can load it outside the package.
"""
from __future__ import annotations

import statistics
import time

import torch


def time_call(fn, device, *, graph: bool = False, min_runs: int = 3, budget_s: float = 0.2) -> list[float]:
    """Milliseconds of every timed ``fn()`` on ``device``.

    CUDA: the samples of ``do_bench(fn, warmup=25, rep=100)``; with ``graph`` those of ``do_bench_cudagraph``
    (``fn`` captured and replayed on a side stream: device time without host launch cost).
    CPU: one warm-up call, then at least ``min_runs`` runs and more until ``budget_s`` seconds have passed.
    """
    if torch.device(device).type == "cuda":
        from triton.testing import do_bench, do_bench_cudagraph

        if graph:
            with torch.cuda.stream(torch.cuda.Stream()):
                return list(do_bench_cudagraph(fn, rep=100, return_mode="all"))
        return list(do_bench(fn, warmup=25, rep=100, return_mode="all"))
    if graph:
        raise ValueError("CUDA-graph timing needs a CUDA device")
    fn()
    runs: list[float] = []
    began = time.perf_counter()
    while len(runs) < min_runs or time.perf_counter() - began < budget_s:
        start = time.perf_counter()
        fn()
        runs.append(1e3 * (time.perf_counter() - start))
    return runs


def summary(times: list[float]) -> dict[str, float]:
    """``{"min_ms", "median_ms", "max_ms"}`` of a non-empty list of milliseconds."""
    return {"min_ms": min(times), "median_ms": statistics.median(times), "max_ms": max(times)}


def time_spread(fn, device, repeats: int = 5) -> dict[str, float]:
    """``{"median_ms", "p20_ms", "p80_ms"}`` of ``fn()``: the do_bench samples on CUDA, ``repeats`` wall-clock
    runs after a warm-up on CPU (the benchmark scripts' summary)."""
    times = time_call(fn, device, min_runs=max(repeats, 2), budget_s=0.0)
    cuts = statistics.quantiles(times, n=5, method="inclusive")
    return {"median_ms": statistics.median(times), "p20_ms": cuts[0], "p80_ms": cuts[-1]}


def kernel_times(fn, device="cuda", iters: int = 5) -> dict[str, float]:
    """Milliseconds per ``fn()`` of everything it runs, largest first, averaged over ``iters`` calls after one
    warm-up: on CUDA every kernel (the profiler's device time), on CPU every ATen op (its self time). Names are cut
    to 60 characters; entries that share the prefix are summed, not overwritten."""
    cuda = torch.device(device).type == "cuda"
    activity = torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU
    fn()
    if cuda:
        torch.cuda.synchronize()
    with torch.profiler.profile(activities=[activity]) as prof:
        for _ in range(iters):
            fn()
        if cuda:
            torch.cuda.synchronize()
    out: dict[str, float] = {}
    for event in prof.key_averages():
        if cuda:
            total = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        else:
            total = event.self_cpu_time_total
        if total > 0:
            name = event.key[:60]
            out[name] = out.get(name, 0.0) + total / iters / 1000.0
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))
