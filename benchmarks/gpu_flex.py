"""GPU benchmark of ``backend="flex"``: end-to-end forward and forward+backward (selection and
mask building included) per method, dense SDPA in the same run, and a forward breakdown
(selection, BlockMask building, the compiled flex kernel alone).

    python benchmarks/gpu_flex.py --out flex_h100.json            # B=2 H=8 D=64 N=65536 bf16

Times are ``triton.testing.do_bench`` medians with the 20th/80th percentiles, in ms. Cases:
``sla_sparse``  topk with 64x64 blocks and K = floor(0.05 * Tk) (SLA's sparse branch, 95 % sparse);
``llsa``        b=16, K=8, L=2;
``topk``/``vsa`` 64x64 blocks keeping 1/8 of the key blocks;
``dense``       F.scaled_dot_product_attention.
"""
from __future__ import annotations

import argparse
import json
import math
import platform

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

import flexsparse
from flexsparse.backends import flex
from flexsparse.config import Config
from flexsparse.masks import llsa_topk, pool_pyramid
from flexsparse.masks.block_mask import block_selection_to_block_mask, llsa_block_mask
from flexsparse.methods import llsa
from flexsparse.methods._blocks import select_blocks

QUANTILES = (0.5, 0.2, 0.8)


def configs(n: int) -> dict[str, dict]:
    """Benchmark configs at length ``n``."""
    tk = math.ceil(n / 64)
    return {
        "sla_sparse": {"method": "topk", "block_size": 64, "topk": max(1, int(0.05 * tk))},
        "llsa": {"method": "llsa", "block_size": 16, "topk": 8, "levels": 2},
        "topk": {"method": "topk", "block_size": 64, "topk": max(1, tk // 8)},
        "vsa": {"method": "vsa", "block_size": 64, "topk": max(1, tk // 8)},
    }


def timed(fn) -> dict[str, float]:
    """Median and 20th/80th percentile ms of ``fn``."""
    median, low, high = do_bench(fn, quantiles=list(QUANTILES))
    return {"median_ms": median, "p20_ms": low, "p80_ms": high}


def peak_memory_gib(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 2**30


def breakdown(q, k, v, cfg) -> tuple[dict, dict, dict, float]:
    """Forward parts timed alone: selection, mask building, the flex kernel; and the key density."""
    scale = q.shape[-1] ** -0.5
    if cfg.method == "llsa":
        levels, topk = llsa.plan(cfg, q.shape[2])

        def select():
            return llsa_topk(q, k, topk, cfg.block_size)

        selection = select()
        mask, layout = llsa_block_mask(selection)
        k_ext = flex.extended_kv([k, *pool_pyramid(k, cfg.block_size, levels)], layout.segment_blocks,
                                 layout.block, q.dtype)
        v_ext = flex.extended_kv([v, *pool_pyramid(v, cfg.block_size, levels)], layout.segment_blocks,
                                 layout.block, q.dtype)
        score_mod = flex.llsa_score_mod(layout)
        density = (sum(topk) * cfg.block_size + layout.segment_blocks[-1] * cfg.block_size) / q.shape[2]
        return (timed(select), timed(lambda: llsa_block_mask(selection)),
                timed(lambda: flex.attend(q, k_ext, v_ext, mask, score_mod, scale)), density)
    selection = select_blocks(q, k, cfg)
    mask = block_selection_to_block_mask(selection)
    density = cfg.topk / selection.num_k_blocks
    return (timed(lambda: select_blocks(q, k, cfg)), timed(lambda: block_selection_to_block_mask(selection)),
            timed(lambda: flex.attend(q, k, v, mask, None, scale)), density)


def bench_method(name: str, config: dict, q, k, v, grad) -> dict:
    cfg = Config.from_dict(config)
    qg, kg, vg = (x.detach().requires_grad_(True) for x in (q, k, v))

    def forward():
        with torch.no_grad():
            return flexsparse.attention(q, k, v, cfg, backend="flex")

    def forward_backward():
        flexsparse.attention(qg, kg, vg, cfg, backend="flex").backward(grad)

    with torch.no_grad():
        selection_ms, mask_ms, kernel_ms, density = breakdown(q, k, v, cfg)
    return {"case": name, "config": config, "density": density, "fwd": timed(forward),
            "fwd_bwd": timed(forward_backward), "selection": selection_ms, "mask_build": mask_ms,
            "flex_fwd": kernel_ms, "peak_fwd_bwd_gib": peak_memory_gib(forward_backward)}


def bench_dense(q, k, v, grad) -> dict:
    qg, kg, vg = (x.detach().requires_grad_(True) for x in (q, k, v))

    def forward():
        with torch.no_grad():
            return F.scaled_dot_product_attention(q, k, v)

    def forward_backward():
        F.scaled_dot_product_attention(qg, kg, vg).backward(grad)

    return {"case": "dense_sdpa", "config": None, "density": 1.0, "fwd": timed(forward),
            "fwd_bwd": timed(forward_backward), "peak_fwd_bwd_gib": peak_memory_gib(forward_backward)}


def table(rows: list[dict]) -> str:
    """Median ms per case; ``-`` where a part does not apply (dense)."""
    columns = [("fwd", 10), ("fwd_bwd", 10), ("selection", 11), ("mask_build", 11), ("flex_fwd", 10)]
    head = f"{'case':<12}{'density':>9}" + "".join(f"{key:>{w}}" for key, w in columns) + f"{'peak GiB':>10}"
    lines = [head, "-" * len(head)]
    for r in rows:
        cells = "".join(f"{r[key]['median_ms']:>{w}.3f}" if key in r else f"{'-':>{w}}" for key, w in columns)
        lines.append(f"{r['case']:<12}{r['density']:>9.4f}{cells}{r['peak_fwd_bwd_gib']:>10.2f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="path of the JSON results")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--seq", type=int, default=65536)
    parser.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    parser.add_argument("--cases", nargs="*", default=None, help="subset of: sla_sparse llsa topk vsa dense")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_flex.py needs a CUDA GPU")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    shape = (args.batch, args.heads, args.seq, args.head_dim)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, grad = (torch.randn(shape, device="cuda", dtype=dtype, generator=gen) for _ in range(4))
    wanted = set(args.cases) if args.cases else None
    rows = []
    for name, config in configs(args.seq).items():
        if wanted is None or name in wanted:
            rows.append(bench_method(name, config, q, k, v, grad))
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    if wanted is None or "dense" in wanted:
        rows.append(bench_dense(q, k, v, grad))
    print(table(rows))
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "python": platform.python_version(), "shape_bhnd": shape, "dtype": args.dtype,
            "quantiles": QUANTILES}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "results": rows}, f, indent=2)


if __name__ == "__main__":
    main()
