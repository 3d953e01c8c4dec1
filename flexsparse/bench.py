"""The benchmark/demo behind ``python -m flexsparse``.

For every method and backend that runs on the device it (1) checks the backend against the dense
reference at a small size and (2) times forward and forward+backward against dense
``F.scaled_dot_product_attention`` measured in the same run, at sizes that fit the device.
Timing: ``triton.testing.do_bench`` medians on CUDA, median wall time of repeats on CPU.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import time
import traceback
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from tqdm import tqdm

from . import backends
from .methods import METHODS
from .module import SparseAttention

DEMO_CONFIGS = {
    "full": {"method": "full"},
    "topk": {"method": "topk", "block_size": 64, "topk": 8},
    "vsa": {"method": "vsa", "block_size": 64, "topk": 8},
    "llsa": {"method": "llsa", "block_size": 16, "topk": 8},
    "sla": {"method": "sla", "block_size": 64, "topk_ratio": 0.05},
    "sla2": {"method": "sla2", "block_q": 128, "block_k": 64, "topk_ratio": 0.05},
}


@dataclass
class Row:
    method: str
    backend: str
    n: int
    forward_ms: float | None
    forward_backward_ms: float | None
    sdpa_forward_ms: float
    sdpa_forward_backward_ms: float | None
    speedup_forward: float | None
    speedup_forward_backward: float | None
    max_error: float | None


def time_ms(fn, device: torch.device, repeats: int = 5) -> float:
    """Median milliseconds of ``fn()``: do_bench on CUDA, wall-clock repeats on CPU."""
    return float(time_spread(fn, device, repeats)["median_ms"])


def time_spread(fn, device: torch.device, repeats: int = 5) -> dict[str, float]:
    """Median, 20th and 80th percentile milliseconds of ``fn()``: do_bench quantiles on CUDA, wall-clock
    repeats on CPU."""
    if device.type == "cuda":
        from triton.testing import do_bench

        median, low, high = do_bench(fn, quantiles=[0.5, 0.2, 0.8])
        return {"median_ms": median, "p20_ms": low, "p80_ms": high}
    fn()
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        runs.append(1e3 * (time.perf_counter() - start))
    cuts = statistics.quantiles(runs, n=5)
    return {"median_ms": statistics.median(runs), "p20_ms": cuts[0], "p80_ms": cuts[-1]}


def attempt(work):
    """``work()``, or its error as a string (one failing measurement must not lose the others); frees the CUDA
    cache either way."""
    try:
        return work()
    except Exception as err:  # noqa: BLE001 - recorded in the results
        traceback.print_exc()
        return f"error: {type(err).__name__}: {err}"
    finally:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||`` in fp32."""
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def offset_qkv(batch: int, heads: int, n: int, dim: int, device, seed: int = 0) -> list[torch.Tensor]:
    """bf16 iid normal q, k, v ``(B, H, N, D)``, the keys with a per-head offset like real keys (drawn on
    ``device`` from ``seed``)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    shape = (batch, heads, n, dim)
    q, k, v = (torch.randn(shape, generator=gen, device=device) for _ in range(3))
    k = k + 0.5 * torch.randn(1, heads, 1, dim, generator=gen, device=device)
    return [x.to(torch.bfloat16) for x in (q, k, v)]


def bench_report(args, results: dict, device: torch.device, **extra) -> dict:
    """A benchmark script's report: its arguments, ``extra``, versions, device and ``results``; written as JSON
    to ``args.out`` when given."""
    report = {"args": vars(args), **extra, "torch": torch.__version__, "platform": platform.platform(),
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
              "results": results}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1, default=str)
    return report


def random_qkv(batch, heads, n, dim, dtype, device, requires_grad):
    gen = torch.Generator(device="cpu").manual_seed(n)
    return [torch.randn(batch, heads, n, dim, generator=gen).to(device, dtype).requires_grad_(requires_grad)
            for _ in range(3)]


def structured_qkv(batch, heads, n, dim, *, gain=1.5, seed=0, device="cpu", dtype=torch.float32):
    """q, k, v ``(B, H, N, D)`` with the structure of image-token attention (docs/methods.md "FP8 QAT"):
    low-rank smooth token signals (8 sinusoids along the sequence) plus noise, q and k RMS-normalised with
    ``gain`` (the logit spread), k with a per-head offset, v with a per-head mean and low rank."""
    import math
    gen = torch.Generator().manual_seed(seed)
    t = torch.linspace(0, 1, n)
    freq, phase = torch.rand(8, generator=gen) * 20, torch.rand(8, generator=gen) * 6
    basis = torch.sin(2 * math.pi * freq * t[:, None] + phase)

    def tokens(offset):
        x = basis @ torch.randn(batch, heads, 8, dim, generator=gen)
        x = x + 0.5 * torch.randn(batch, heads, n, dim, generator=gen)
        x = x + offset * torch.randn(1, heads, 1, dim, generator=gen)
        return x / x.pow(2).mean(-1, keepdim=True).sqrt() * gain

    v = basis @ torch.randn(batch, heads, 8, dim, generator=gen) + torch.randn(1, heads, 1, dim, generator=gen)
    v = v + 0.3 * torch.randn(batch, heads, n, dim, generator=gen)
    return [x.to(device, dtype) for x in (tokens(0.0), tokens(1.0), v)]


def build(config: dict, backend: str, dim: int, heads: int, n: int, device, dtype) -> SparseAttention:
    """A ``SparseAttention`` for the config with its parameters perturbed away from their init."""
    module = SparseAttention(config, head_dim=dim, num_heads=heads, seq_len=n, backend=backend).to(device)
    with torch.no_grad():
        gen = torch.Generator(device="cpu").manual_seed(0)
        for p in module.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=gen).to(p.device, p.dtype))
    return module


def max_error(config: dict, backend: str, device: torch.device, dtype: torch.dtype, n: int = 700,
              dim: int = 64) -> float:
    """Max |o - o_ref| at a small size against the fp64 reference, both fed the same inputs rounded to
    ``dtype`` (so that rounding cannot flip a block selection between the two)."""
    heads = 2
    q, k, v = (x.to(dtype).double() for x in random_qkv(1, heads, n, dim, torch.float64, device, False))
    reference = build(config, "reference", dim, heads, n, device, torch.float64).double()
    test = build(config, backend, dim, heads, n, device, dtype)
    with torch.no_grad():
        want = reference(q, k, v)
        got = test(q.to(dtype), k.to(dtype), v.to(dtype))
    return (got.double() - want).abs().max().item()


def supported_backends(method: str, device: torch.device, needs_grad: bool,
                       wanted: list[str] | None = None) -> list[str]:
    """Non-reference backends of ``method`` that run on ``device`` (among ``wanted`` if given)."""
    return [b for b in METHODS[method].backends
            if b != "reference" and backends.runs_on(b, device, needs_grad) and (wanted is None or b in wanted)]


def _grads(attend, q, k, v, grad):
    """Forward and backward of ``attend(q, k, v)`` with upstream gradient ``grad``: the gradients of q, k, v."""
    return torch.autograd.grad(attend(q, k, v), (q, k, v), grad)


def run(methods: list[str], sizes: list[int], device: torch.device, dtype: torch.dtype, batch: int, heads: int,
        dim: int, backward: bool, check: bool, wanted_backends: list[str] | None = None) -> list[Row]:
    """Benchmark rows for every (method, backend, N)."""
    rows = []
    errors: dict[tuple[str, str], float] = {}
    jobs = [(m, b, n) for n in sizes for m in methods for b in supported_backends(m, device, backward, wanted_backends)]
    sdpa: dict[int, tuple[float, float | None]] = {}
    for method, backend, n in tqdm(jobs, desc="benchmark", unit="run"):
        config = DEMO_CONFIGS[method]
        if check and (method, backend) not in errors:
            errors[(method, backend)] = max_error(config, backend, device, dtype)
        q, k, v = random_qkv(batch, heads, n, dim, dtype, device, backward)
        grad = torch.randn_like(q)  # an upstream gradient, as in training (no .grad accumulation timed)
        if n not in sdpa:
            with torch.no_grad():
                fwd = time_ms(lambda: F.scaled_dot_product_attention(q, k, v), device)
            both = time_ms(lambda: _grads(F.scaled_dot_product_attention, q, k, v, grad), device) if backward else None
            sdpa[n] = (fwd, both)
        try:
            module = build(config, backend, dim, heads, n, device, dtype)
            with torch.no_grad():
                forward = time_ms(lambda: module(q, k, v), device)
            both = time_ms(lambda: _grads(module, q, k, v, grad), device) if backward else None
        except ValueError as exc:  # the config does not fit this N (e.g. top-K over the blocks), at build or call
            tqdm.write(f"skip {method}/{backend} at N={n}: {exc}")
            continue
        except (RuntimeError, torch.OutOfMemoryError) as exc:   # keep the rest of the table
            tqdm.write(f"failed {method}/{backend} at N={n}: {type(exc).__name__}: {str(exc)[:300]}")
            continue
        rows.append(Row(method, backend, n, forward, both, sdpa[n][0], sdpa[n][1], sdpa[n][0] / forward,
                        (sdpa[n][1] / both) if backward else None, errors.get((method, backend))))
    return rows


def write_outputs(rows: list[Row], out_dir: str, meta: dict) -> list[str]:
    """JSON of all rows and a log-log PNG of time against N; returns the paths written."""
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, "results.json")]
    with open(paths[0], "w") as f:
        json.dump({"meta": meta, "rows": [asdict(r) for r in rows]}, f, indent=1)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return paths
    fig, ax = plt.subplots(figsize=(7, 5))
    key = "forward_backward_ms" if rows and rows[0].forward_backward_ms is not None else "forward_ms"
    for method, backend in sorted({(r.method, r.backend) for r in rows}):
        pts = [(r.n, getattr(r, key)) for r in rows if (r.method, r.backend) == (method, backend)]
        ax.plot(*zip(*pts), marker="o", label=f"{method} ({backend})")
    sdpa_key = "sdpa_" + key
    pts = sorted({(r.n, getattr(r, sdpa_key)) for r in rows})
    ax.plot(*zip(*pts), "k--", marker="s", label="dense SDPA")
    ax.set(xscale="log", yscale="log", xlabel="sequence length N", ylabel=f"{key.replace('_', ' ')}",
           title=f"flexsparse on {meta['device_name']} ({meta['dtype']})")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    paths.append(os.path.join(out_dir, "timing.png"))
    fig.savefig(paths[-1], dpi=120, bbox_inches="tight")
    plt.close(fig)
    return paths


def available_methods() -> list[str]:
    """Methods with a demo config and an implementation."""
    return [m for m in DEMO_CONFIGS if m in METHODS]
