"""The warp-specialized Gluon block-sparse kernels (``flexsparse/triton/block_fwd_ws.py``, ``block_bwd_ws.py``)
against the Triton ones (``block_fwd.py``, ``block_bwd.py``) on the same random selection: the largest abs
difference from the Triton kernel's outputs (O and LSE; with ``--bwd`` the whole ``block_backward`` with and
without the Gluon kernels, and dQ and Delta or dK and dV of each Gluon variant) and do_bench medians, next to
dense cuDNN SDPA, for several pipeline depths and register caps (sm_90).

    python benchmarks/gluon_blocks.py OUT.json [--cases d64,d128,public,sla2,sla2_d128] [--bwd]
"""
from __future__ import annotations

import argparse
import json
import platform

import torch
import torch.nn.functional as F
import triton
from tabulate import tabulate

from flexsparse.bench import attempt
from flexsparse.triton import block_bwd, block_bwd_ws
from flexsparse.triton.block_fwd import block_forward, forward_tiles
from flexsparse.triton.block_fwd_ws import supported, ws_block_forward
from flexsparse.triton.csc import block_csc
from flexsparse.triton.layout import cdiv
from block_tiles import random_selection

# name: B, H, N, D, block_q, block_k, K
CASES = {"d64": (2, 8, 65536, 64, 64, 64, 51), "d128": (2, 16, 32768, 128, 64, 64, 25),
         "public": (2, 16, 32760, 128, 64, 64, 25), "sla2": (2, 8, 65536, 64, 128, 64, 31),
         "sla2_d128": (2, 16, 32768, 128, 128, 64, 25), "k8": (2, 8, 65536, 64, 64, 64, 8)}
VARIANTS = {  # per head dim and query-tile rows
    (64, 64): [dict(stages=st, maxnreg=r) for st in (3, 4) for r in (128, 80)],
    (128, 64): [dict(stages=st, maxnreg=r) for st in (2, 3) for r in (128, 96)],
    (64, 128): [dict(stages=st, maxnreg=80) for st in (2, 3)],
    (128, 128): [dict(stages=2, maxnreg=96), dict(stages=2, maxnreg=112)],
}


def time_variant(case: str, label: str, run, want, flops: float = 0.0) -> dict:
    """``run()``'s largest abs difference from the tensors ``want`` and its do_bench median (and TFLOP/s for
    ``flops``); an error is recorded instead (``flexsparse.bench.attempt``)."""
    def work():
        err = max((a.float() - b.float()).abs().max().item() for a, b in zip(run(), want))
        ms = triton.testing.do_bench(run)
        return dict(case=case, kernel=label, ms=ms, **(dict(tflops=flops / ms / 1e9) if flops else {}), max_diff=err)

    result = attempt(work)
    row = result if isinstance(result, dict) else dict(case=case, kernel=label, error=result[:300])
    print(row, flush=True)
    return row


def random_case(name: str, tensors: int):
    """``tensors`` random bf16 ``(B, H, N, D)`` tensors (q, k, v[, do]) and a random index table of the case."""
    bsz, heads, n, d, bq, bk, topk = CASES[name]
    torch.manual_seed(0)
    qkv = [torch.randn(bsz, heads, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(tensors)]
    return qkv, random_selection(bsz, heads, cdiv(n, bq), cdiv(n, bk), topk)


def run_case(name: str) -> list[dict]:
    bsz, heads, n, d, bq, bk, topk = CASES[name]
    (q, k, v), idx = random_case(name, 3)
    scale = d ** -0.5
    assert supported(q, k, v, idx, bq, bk)
    flops = 4.0 * bsz * heads * n * topk * bk * d
    tiles = forward_tiles(q.device, d, q.dtype)  # forces the Triton kernel
    want = block_forward(q, k, v, idx, bq, bk, scale, tiles=tiles)
    rows = [time_variant(name, "triton", lambda: block_forward(q, k, v, idx, bq, bk, scale, tiles=tiles), want,
                         flops)]
    variants = [dict(var, bm=64) for var in VARIANTS[(d, 64)]]
    if bq > 64:
        variants += [dict(var, bm=128) for var in VARIANTS[(d, 128)]]
    for var in variants:
        rows.append(time_variant(name, f"gluon {var}", lambda: ws_block_forward(q, k, v, idx, bq, bk, scale, **var),
                                 want, flops))
    qd, kd, vd = (t[:, :, : n // 4] for t in (q, k, v))  # dense SDPA at a quarter of N, scaled by 16
    ms = triton.testing.do_bench(lambda: F.scaled_dot_product_attention(qd, kd, vd))
    rows.append(dict(case=name, kernel="sdpa (N/4, x16)", ms=ms * 16, tflops=4.0 * bsz * heads * (n // 4) ** 2 * d
                     / ms / 1e9))
    return rows


BWD_VARIANTS = {64: [dict(stages=2, maxnreg=128), dict(stages=3, maxnreg=128)], 128: [dict(stages=2, maxnreg=168)]}
DQ_VARIANTS = [dict(stages=2, maxnreg=128), dict(stages=3, maxnreg=128), dict(stages=3, maxnreg=80)]


def run_bwd_case(name: str) -> list[dict]:
    bsz, heads, n, d, bq, bk, topk = CASES[name]
    (q, k, v, do), idx = random_case(name, 4)
    scale = d ** -0.5
    o, lse = block_forward(q, k, v, idx, bq, bk, scale)
    offsets, rows = block_csc(idx, cdiv(n, bk), False)
    flops = 10.0 * bsz * heads * n * topk * bk * d
    tiles = block_bwd.backward_tiles(q.device, d, q.dtype)  # forces the Triton kernels

    def backward(tiles):
        return block_bwd.block_backward(do, None, q, k, v, idx, offsets, rows, o, lse, bq, bk, scale, tiles=tiles)

    want = backward(tiles)
    out = [time_variant(name, label, lambda: backward(choice), want, flops)
           for label, choice in (("bwd triton", tiles), ("bwd default", None))]
    delta = (o.float() * do.float()).sum(-1)
    for var in DQ_VARIANTS:
        out.append(time_variant(name, f"dq gluon {var}",
                                lambda: block_bwd_ws.ws_dq(q, k, v, do, o, lse, None, idx, bq, scale, **var),
                                (want[0], delta)))
    order = block_bwd.longest_first(offsets, heads)
    for var in BWD_VARIANTS[d]:
        out.append(time_variant(name, f"dkv gluon {var}", lambda: block_bwd_ws.ws_dkv(
            q, k, v, do, lse, delta, offsets, rows, order, bq, scale, **var), want[1:]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--cases", default="d64,d128,public,sla2,sla2_d128")
    parser.add_argument("--bwd", action="store_true", help="time the backward kernels instead of the forward")
    args = parser.parse_args()
    rows = []
    for name in args.cases.split(","):
        rows += run_bwd_case(name) if args.bwd else run_case(name)
    print(tabulate(rows, headers="keys", floatfmt=".4g"))
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                python=platform.python_version(), cases={c: CASES[c] for c in args.cases.split(",")})
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
