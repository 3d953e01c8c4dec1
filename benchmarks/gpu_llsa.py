"""GPU benchmark of LLSA with ``backend="triton"`` (pooling and selection included).

Median ``triton.testing.do_bench`` times of ``flexsparse.attention(..., {"method": "llsa", ...})``
forward (no grad) and forward+backward, against ``backend="torch"`` (small N only) and dense
``F.scaled_dot_product_attention`` in the same run; a per-kernel breakdown from the profiler.
B=2, H=8, bf16, K=8 per level, b=16. Prints a table and writes JSON to ``--out``.

    python benchmarks/gpu_llsa.py --out bench.json [--shapes 65536:2:64,262144:3:64] [--tiles JSON] [--sdpa-max N]

``--tiles`` overrides tile sizes through ``FLEXSPARSE_TRITON_TILES`` (``flexsparse.triton._runtime.tiles``), e.g.
``'{"fwd": {"BM": 64}, "bwd": {"QR": 64}}'``. ``--graph`` also times CUDA-graph replays
(``do_bench_cudagraph``: kernel time without Python launch overhead).
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F
import triton

import flexsparse
from flexsparse.bench import kernel_times

B, H, K, BLOCK = 2, 8, 8, 16


def keys_per_query(n: int, levels: int) -> int:
    top = -(-n // BLOCK**levels)
    return K * BLOCK * levels + top


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def bench_graph(fn) -> float | None:
    try:
        with torch.cuda.stream(torch.cuda.Stream()):
            return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
    except Exception as exc:  # a benchmark diagnostic: report and go on
        print(f"cuda graph timing failed: {type(exc).__name__}: {str(exc)[:200]}")
        return None


def make_inputs(n: int, d: int):
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, H, n, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    return [x.requires_grad_() for x in (q, k, v)], torch.randn(B, H, n, d, device="cuda", dtype=torch.bfloat16,
                                                                  generator=gen)


def attention_fns(q, k, v, grad, attend):
    def fwd():
        with torch.no_grad():
            attend(q, k, v)

    def fwd_bwd():
        torch.autograd.grad(attend(q, k, v), (q, k, v), grad)

    return fwd, fwd_bwd


def run_shape(n: int, levels: int, d: int, with_torch: bool, with_sdpa: bool, phases: bool, graph: bool) -> dict:
    cfg = {"method": "llsa", "block_size": BLOCK, "topk": K, "levels": levels}
    (q, k, v), grad = make_inputs(n, d)
    row = {"N": n, "L": levels, "D": d, "B": B, "H": H}
    flops_fwd = 4.0 * B * H * n * d * keys_per_query(n, levels)
    triton_attend = lambda q, k, v: flexsparse.attention(q, k, v, cfg, backend="triton")  # noqa: E731
    fwd, fwd_bwd = attention_fns(q, k, v, grad, triton_attend)
    torch.cuda.reset_peak_memory_stats()
    row["triton_fwd_ms"] = bench(fwd)
    row["triton_fwd_bwd_ms"] = bench(fwd_bwd)
    row["triton_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    row["triton_fwd_tflops"] = flops_fwd / row["triton_fwd_ms"] / 1e9
    row["triton_bwd_tflops"] = 2.5 * flops_fwd / (row["triton_fwd_bwd_ms"] - row["triton_fwd_ms"]) / 1e9
    if graph:
        row["triton_fwd_graph_ms"] = bench_graph(fwd)
        row["triton_fwd_bwd_graph_ms"] = bench_graph(fwd_bwd)
    if phases:
        row["kernels_fwd_bwd_ms"] = kernel_times(fwd_bwd)
    if with_torch:
        fwd_t, fwd_bwd_t = attention_fns(q, k, v, grad, lambda q, k, v: flexsparse.attention(q, k, v, cfg,
                                                                                           backend="torch"))
        row["torch_fwd_ms"] = bench(fwd_t)
        row["torch_fwd_bwd_ms"] = bench(fwd_bwd_t)
    if with_sdpa:
        fwd_s, fwd_bwd_s = attention_fns(q, k, v, grad, F.scaled_dot_product_attention)
        row["sdpa_fwd_ms"] = bench(fwd_s)
        row["sdpa_fwd_bwd_ms"] = bench(fwd_bwd_s)
    return row


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="gpu_llsa.json")
    parser.add_argument("--shapes", default="16384:2:64,16384:2:128,65536:2:64,262144:3:64",
                        help="comma-separated N:L:D")
    parser.add_argument("--tiles", default="{}")
    parser.add_argument("--no-phases", action="store_true")
    parser.add_argument("--graph", action="store_true")
    parser.add_argument("--sdpa-max", type=int, default=65536, help="time dense SDPA up to this N")
    args = parser.parse_args()
    if args.tiles != "{}":
        os.environ["FLEXSPARSE_TRITON_TILES"] = args.tiles
    rows = []
    for spec in args.shapes.split(","):
        n, levels, d = (int(x) for x in spec.split(":"))
        start = time.time()
        row = run_shape(n, levels, d, with_torch=n <= 16384, with_sdpa=n <= args.sdpa_max,
                        phases=not args.no_phases and n >= 65536, graph=args.graph)
        row["wall_s"] = time.time() - start
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\n{'N':>7} {'L':>2} {'D':>4} | {'fwd ms':>7} {'f+b ms':>7} {'fwd TF/s':>8} {'bwd TF/s':>8} | "
          f"{'graph f':>7} {'graph fb':>8} | {'torch f':>7} {'torch fb':>8} | {'sdpa f':>7} {'sdpa fb':>8}")
    for r in rows:
        fmt = lambda key: f"{r[key]:.3f}" if r.get(key) is not None else "-"  # noqa: E731
        print(f"{r['N']:>7} {r['L']:>2} {r['D']:>4} | {fmt('triton_fwd_ms'):>7} {fmt('triton_fwd_bwd_ms'):>7} "
              f"{r['triton_fwd_tflops']:>8.1f} {r['triton_bwd_tflops']:>8.1f} | {fmt('triton_fwd_graph_ms'):>7} "
              f"{fmt('triton_fwd_bwd_graph_ms'):>8} | {fmt('torch_fwd_ms'):>7} "
              f"{fmt('torch_fwd_bwd_ms'):>8} | {fmt('sdpa_fwd_ms'):>7} {fmt('sdpa_fwd_bwd_ms'):>8}")
    for r in rows:
        if "kernels_fwd_bwd_ms" in r:
            print(f"\nkernels, fwd+bwd, N={r['N']} L={r['L']} D={r['D']} (ms per call):")
            for name, ms in list(r["kernels_fwd_bwd_ms"].items())[:16]:
                print(f"  {ms:8.3f}  {name}")
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
