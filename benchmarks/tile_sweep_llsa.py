"""Sweep the Triton LLSA tile sizes on a GPU: forward and forward+backward medians per override.

Each override is a ``FLEXSPARSE_TRITON_TILES`` value (``flexsparse.triton.tiles``), applied one at a
time on top of the defaults; the first row is the defaults. B=2, H=8, bf16, K=8, b=16.

    python benchmarks/tile_sweep_llsa.py --n 65536 --levels 2 --out sweep.json
    python benchmarks/tile_sweep_llsa.py --fwd '{"BM": 64, "warps": 4}' --bwd '{"QR": 64}'
"""
from __future__ import annotations

import argparse
import json
import os

import torch
from tabulate import tabulate

import flexsparse
from gpu_llsa import attention_fns, bench, make_inputs

FWD_SWEEP = [{"stages": 3}, {"fused_BM": 128, "fused_warps": 8}, {"BN": 128}, {"WN": 16}, {"WN": 64},
             {"w_stages": 3}]
BWD_SWEEP = [{"stages": 3}, {"QR": 64}, {"dkv_warps": 8}, {"top_stages": 3}, {"programs": 2 * 132},
             {"TK": 32}, {"W": 4}, {"WN": 32}, {"fuse_dq": True}, {"fuse_dq": False}]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=65536)
    p.add_argument("--levels", type=int, default=2)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--fwd", nargs="*", help="forward overrides (JSON dicts); default: a built-in sweep")
    p.add_argument("--bwd", nargs="*", help="backward overrides (JSON dicts); default: a built-in sweep")
    p.add_argument("--out")
    args = p.parse_args()
    cfg = {"method": "llsa", "block_size": 16, "topk": 8, "levels": args.levels}
    (q, k, v), grad = make_inputs(args.n, args.dim)
    fwd, fwd_bwd = attention_fns(q, k, v, grad, lambda *x: flexsparse.attention(*x, cfg, backend="triton"))
    runs = [("defaults", {})]
    runs += [("fwd", json.loads(x) if isinstance(x, str) else x) for x in (args.fwd or FWD_SWEEP)]
    runs += [("bwd", json.loads(x) if isinstance(x, str) else x) for x in (args.bwd or BWD_SWEEP)]
    rows = []
    for kind, override in runs:
        os.environ["FLEXSPARSE_TRITON_TILES"] = json.dumps({kind: override}) if override else "{}"
        try:
            rows.append({"kind": kind, "override": json.dumps(override), "fwd_ms": bench(fwd),
                         "fwd_bwd_ms": bench(fwd_bwd)})
        except Exception as exc:  # a sweep diagnostic: an invalid tile combination is reported, not fatal
            rows.append({"kind": kind, "override": json.dumps(override), "error": f"{type(exc).__name__}: {exc}"[:120]})
        print(rows[-1], flush=True)
    os.environ.pop("FLEXSPARSE_TRITON_TILES")
    print(tabulate(rows, headers="keys", floatfmt=".3f"))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "n": args.n, "levels": args.levels, "dim": args.dim,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
