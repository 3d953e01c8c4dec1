"""The ``flex`` backend after a second shape: torch's default compile policy (static graphs for the first shape,
dynamic-shape graphs from the second on) against static graphs per shape (``--static``: ``flex_attention`` and the
SLA linear branch recompiled with ``dynamic=False``). One process per policy, the CLI's sequence of shapes (the
error check at N=700, then every ``--sizes`` entry), ``flexsparse.bench.run`` timings (do_bench medians, ms).

    python benchmarks/flex_shapes.py out_default.json
    python benchmarks/flex_shapes.py out_static.json --static
"""
from __future__ import annotations

import argparse
import json

import torch
from torch.nn.attention.flex_attention import flex_attention

from flexsparse import bench
from flexsparse.backends import flex, torch_linear


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="path of the JSON results")
    parser.add_argument("--static", action="store_true", help="static graphs per shape (dynamic=False)")
    parser.add_argument("--methods", nargs="+", default=["topk", "sla"])
    parser.add_argument("--sizes", nargs="+", type=int, default=[16384, 65536])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("flex_shapes.py needs a CUDA GPU")
    if args.static:
        flex._FLEX_CUDA = torch.compile(flex_attention, dynamic=False)
        torch_linear._keep_weighted_linear_cuda = torch.compile(torch_linear._keep_weighted_linear, dynamic=False)
    rows = bench.run(args.methods, args.sizes, torch.device("cuda"), torch.bfloat16, batch=2, heads=8, dim=64,
                     backward=True, check=True, wanted_backends=["flex"])
    results = [{"mode": "static" if args.static else "default", "method": r.method, "n": r.n, "fwd": r.forward_ms,
                "fwd_bwd": r.forward_backward_ms, "err": r.max_error} for r in rows]
    for row in results:
        print(row, flush=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
