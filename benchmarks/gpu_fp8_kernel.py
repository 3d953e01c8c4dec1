"""FP8 Triton forward (``block_sparse.fwd_fp8``) against the bf16 block-sparse forward (``block_sparse.fwd``) on one
selection. Not a ``python -m flexsparse`` case: it times the kernels and the FP8 pre-pass alone, below the ops, with
tile sweeps of both kernels.

    python benchmarks/gpu_fp8_kernel.py --out fp8_kernel.json                  # B=2 H=8 N=65536, D=64 and 128
    python benchmarks/gpu_fp8_kernel.py --sweep --out fp8_kernel_sweep.json    # + tile configs of both kernels
    python benchmarks/gpu_fp8_kernel.py --device cpu --n 256 --batch 1 --heads 1 --head-dims 16   # smoke
                                                                  # (CPU needs TRITON_INTERPRET=1)

Selection: a random index table keeping ``--ratio`` (5 %) of the ``--block`` (64)-token key blocks of every
query block, ascending (the kernels' work does not depend on which blocks). For each head dim:
``bf16_ms``        ``block_sparse.fwd.block_forward`` (bf16 q, k, v, fp32 accumulation), the baseline;
``prepass_ms``     ``block_sparse.fp8_quant.quantize_kv`` (K per block with V's amax, V per channel transposed)
                   with K's mean given, as a method's selection gives it (``BlockSelection.key_mean``,
                   made once outside the timing);
``fp8_kernel_ms``  ``block_sparse.fwd_fp8.block_attend_fp8`` on q and the pre-pass outputs (the kernel alone, which
                   quantizes Q's blocks itself; the Gluon kernel after ``quantize_blocks(q)``);
``fp8_total_ms``   pre-pass + the default kernel (``block_forward_fp8``, what ``backend="triton"`` runs, K's mean
                   given);
``bf16_default_ms`` / ``fp8_default_ms``  both forwards with their default kernels (the Gluon ones on sm_90, the
                   Triton ones elsewhere), ``speedup_default`` the first over the second,
                   ``speedup_default_total`` ``bf16_default_ms`` over ``fp8_total_ms`` (what a forward gains);
``fp8_in_order_ms`` the default FP8 kernel with V^T's keys stored in order (``fp8_quant.PERMUTED_KEYS`` off: P
                   reaches the fp8 MMA through shuffles); ``speedup_options`` it over ``fp8_default_ms``,
                   ``rel_l2_in_order`` its output against the default one. Where the Gluon FP8 kernel runs:
                   ``fp8_one_block_ms`` it with one key block per softmax step into a fresh accumulator
                   (``GLUON_ONE_BLOCK``; ``speedup_pairs`` it over the default's two, ``rel_l2_one_block``) and
                   ``fp8_no_defer_ms`` that without ``defer_rescale`` (``speedup_deferred`` over
                   ``fp8_one_block_ms``, ``rel_l2_no_defer``);
``speedup_kernel`` / ``speedup_total``  bf16_ms over those; ``tflops_*`` 4 B H N K_keys D / time;
``rel_l2_random`` / ``rel_l2_structured``  ||o_fp8 - o_bf16|| / ||o_bf16|| on random inputs (keys with a
per-head offset) and on ``flexsparse.bench.structured_qkv`` inputs (low-rank smooth tokens, V with a mean).
``--sweep`` times both kernels over ``SWEEP`` (tile settings of ``forward_tiles``: key blocks per step,
warps, stages; for the FP8 kernel also ``fresh_acc=False``, P V accumulated inside the fp8 MMA) and reports
the best of each. Times: ``triton.testing.do_bench`` medians (20th/80th
percentiles) in ms on CUDA, perf_counter medians on CPU.
"""
from __future__ import annotations

import argparse
import itertools
import json

import torch

from flexsparse.bench import attempt, bench_report, offset_qkv, rel_l2, structured_qkv, time_spread
from flexsparse.masks import num_blocks
from flexsparse.triton.block_sparse import fwd as block_fwd
from flexsparse.triton.block_sparse import fp8_quant
from flexsparse.triton.block_sparse import fwd_fp8 as block_fwd_fp8
from flexsparse.triton.block_sparse.gluon import block_fwd_ws_fp8
from flexsparse.triton.block_sparse.fp8_quant import quantize_kv, quantize_qkv
from flexsparse.triton.pooling.naive import key_mean
from flexsparse.triton._runtime.registry import directly   # plain launches, as inside the op (no wrap_triton)

GLUON_ONE_BLOCK = {"pairs": False, "fresh_acc": True, "stages": 3}   # the Gluon FP8 kernel's one-block path
SWEEP = [dict(KB=kb, warps=w, stages=s) for kb, w, s in itertools.product((1, 2, 4), (4, 8), (2, 3, 4))]
SWEEP += [dict(KB=kb, stages=s, fresh_acc=False) for kb, s in itertools.product((1, 2), (2, 3))]   # fp8 only


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--n", type=int, default=65536)
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--block", type=int, default=64, help="query and key block size")
    p.add_argument("--ratio", type=float, default=0.05, help="kept fraction of key blocks (0.05: 95 %% sparse)")
    p.add_argument("--sweep", action="store_true", help="also time the tile configs of SWEEP for both kernels")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", help="write the results as JSON")
    return p.parse_args(argv)


def random_table(args, device: torch.device) -> torch.Tensor:
    """``(B, H, Tq, K)`` int32: K = max(1, floor(ratio * Tk)) distinct random key blocks per row, ascending."""
    t = num_blocks(args.n, args.block)
    topk = max(1, int(round(args.ratio * t, 9)))
    gen = torch.Generator(device=device).manual_seed(1)
    scores = torch.rand(args.batch, args.heads, t, t, generator=gen, device=device)
    return scores.topk(topk, dim=-1).indices.sort(-1).values.to(torch.int32).contiguous()


def head_dim_results(args, d: int, device: torch.device) -> dict:
    q, k, v = offset_qkv(args.batch, args.heads, args.n, d, device)
    if device.type == "cpu":                       # the interpreter multiplies fp16, not bf16
        q, k, v = (x.half() for x in (q, k, v))
    table = random_table(args, device)
    block, scale = args.block, d**-0.5
    k_mean = key_mean(k, block)                    # the selection's (pooled block sums), not timed
    pre = quantize_qkv(q, k, v, block, block, k_mean)
    bf16_tiles = block_fwd.forward_tiles(device, d, q.dtype)
    fp8_tiles = block_fwd_fp8.forward_tiles(device, d)

    def bf16(tiles=bf16_tiles):
        return block_fwd.block_forward(q, k, v, table, block, block, scale, tiles)

    def fp8_kernel(tiles=fp8_tiles):
        return block_fwd_fp8.block_attend_fp8(q, pre[2:], table, block, block, scale, tiles)

    def fp8_total():
        return block_fwd_fp8.block_forward_fp8(q, k, v, table, block, block, scale, k_mean=k_mean)

    in_order_pre = with_keys_in_order(lambda: quantize_qkv(q, k, v, block, block, k_mean))
    gluon = block_fwd_fp8.gluon_runs(pre[2], table, block, block)

    def fp8_in_order():
        if gluon:
            return with_keys_in_order(lambda: block_fwd_ws_fp8.ws_block_attend_fp8(
                *in_order_pre, table, block, block, scale, q.dtype))
        return with_keys_in_order(lambda: block_fwd_fp8.block_attend_fp8(q, in_order_pre[2:], table, block, block,
                                                                          scale))

    def gluon_one_block(defer: bool):
        return lambda: block_fwd_ws_fp8.ws_block_attend_fp8(*pre, table, block, block, scale, q.dtype,
                                                            {**GLUON_ONE_BLOCK, "defer_rescale": defer})

    keys = table.shape[-1] * block
    flops = 4 * args.batch * args.heads * args.n * keys * d
    out = {"keys_per_query": keys, "bf16_tiles": bf16_tiles, "fp8_tiles": fp8_tiles}
    for name, fn in (("bf16", bf16), ("prepass", lambda: directly(quantize_kv, k, v, block, k_mean)),
                     ("fp8_kernel", fp8_kernel), ("fp8_total", fp8_total), ("bf16_default", lambda: bf16(None)),
                     ("fp8_default", lambda: fp8_kernel(None)), ("fp8_in_order", fp8_in_order),
                     ("fp8_one_block", gluon_one_block(True) if gluon else None),
                     ("fp8_no_defer", gluon_one_block(False) if gluon else None)):
        out[f"{name}_ms"] = "n/a" if fn is None else attempt(lambda: time_spread(fn, device))
    pairs = (("default", "bf16_default", "fp8_default"), ("default_total", "bf16_default", "fp8_total"),
             ("options", "fp8_in_order", "fp8_default"), ("pairs", "fp8_one_block", "fp8_default"),
             ("deferred", "fp8_no_defer", "fp8_one_block"))
    for name, slower, faster in pairs:
        if all(isinstance(out[f"{key}_ms"], dict) for key in (slower, faster)):
            out[f"speedup_{name}"] = out[f"{slower}_ms"]["median_ms"] / out[f"{faster}_ms"]["median_ms"]
    out["rel_l2_in_order"] = rel_l2(fp8_in_order()[0], fp8_kernel(None)[0])
    if gluon:
        out["rel_l2_one_block"] = rel_l2(gluon_one_block(True)()[0], fp8_kernel(None)[0])
        out["rel_l2_no_defer"] = rel_l2(gluon_one_block(False)()[0], gluon_one_block(True)()[0])
    base = out["bf16_ms"]
    for name in ("fp8_kernel", "fp8_total", "bf16"):
        mine = out[f"{name}_ms"]
        if isinstance(mine, dict):
            out[f"tflops_{name}"] = flops / mine["median_ms"] / 1e9
            if isinstance(base, dict) and name != "bf16":
                out[f"speedup_{name.removeprefix('fp8_')}"] = base["median_ms"] / mine["median_ms"]
    out["rel_l2_random"] = rel_l2(fp8_total()[0], bf16()[0])
    sq, sk, sv = structured_qkv(args.batch, args.heads, args.n, d, gain=1.5, seed=0, device=device, dtype=q.dtype)
    structured_fp8 = block_fwd_fp8.block_forward_fp8(sq, sk, sv, table, block, block, scale)[0]
    structured_bf16 = block_fwd.block_forward(sq, sk, sv, table, block, block, scale)[0]
    out["rel_l2_structured"] = rel_l2(structured_fp8, structured_bf16)
    if args.sweep:
        out["sweep"] = sweep(args, device, bf16, fp8_kernel, bf16_tiles, fp8_tiles)
    return out


def with_keys_in_order(call):
    """``call()`` with ``fp8_quant.PERMUTED_KEYS`` off."""
    before = fp8_quant.PERMUTED_KEYS
    fp8_quant.PERMUTED_KEYS = False
    try:
        return call()
    finally:
        fp8_quant.PERMUTED_KEYS = before


def sweep(args, device, bf16, fp8_kernel, bf16_tiles: dict, fp8_tiles: dict) -> dict:
    """Both kernels over ``SWEEP`` (on top of their defaults); the best median of each (FP8: with the default
    fresh accumulator, and ``_mma_acc`` with ``fresh_acc=False``) and the speedups over the best bf16."""
    configs = SWEEP if device.type == "cuda" else [SWEEP[0], SWEEP[-1]]
    rows = []
    for change in configs:
        row = {"tiles": change}
        for name, fn, base in (("bf16", bf16, bf16_tiles), ("fp8_kernel", fp8_kernel, fp8_tiles)):
            if any(key not in base for key in change):
                row[f"{name}_ms"] = "n/a"
                continue
            tiles = {**base, **change}
            row[f"{name}_ms"] = attempt(lambda: time_spread(lambda: fn(tiles), device)["median_ms"])
        rows.append(row)
        print(json.dumps(row), flush=True)
    best = {}
    for name, key, keep in (("bf16", "bf16", True), ("fp8_kernel", "fp8_kernel", True),
                            ("fp8_kernel_mma_acc", "fp8_kernel", False)):
        ok = [r for r in rows if isinstance(r[f"{key}_ms"], float) and r["tiles"].get("fresh_acc", True) == keep]
        if ok:
            top = min(ok, key=lambda r: r[f"{key}_ms"])
            best[name] = {"tiles": top["tiles"], "median_ms": top[f"{key}_ms"]}
    for name in ("fp8_kernel", "fp8_kernel_mma_acc"):
        if "bf16" in best and name in best:
            best[f"speedup_{name.removeprefix('fp8_')}"] = best["bf16"]["median_ms"] / best[name]["median_ms"]
    return {"rows": rows, "best": best}


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    results = {}
    for d in args.head_dims:
        results[f"D{d}"] = head_dim_results(args, d, device)
        print(f"D={d}", json.dumps({k: v for k, v in results[f"D{d}"].items() if k != "sweep"}, indent=1,
                                   default=str), flush=True)
    return bench_report(args, results, device)


if __name__ == "__main__":
    main()
