"""The ``flex`` backend after a second shape: flexsparse's policy (static graphs per call variant: compiled
``flex_attention`` and SLA linear branch) against torch's default (``--torch-default``: static graphs for a
function's first shape, dynamic-shape graphs from the second on, for both). One process per policy, the CLI's
sequence of shapes (the error check at N=700, then every ``--sizes`` entry), ``flexsparse.bench.run`` timings
(do_bench medians, ms).

    python benchmarks/flex_shapes.py out_flexsparse.json
    python benchmarks/flex_shapes.py out_torch_default.json --torch-default
"""
from __future__ import annotations

import argparse
import json

import torch

from flexsparse import bench
from flexsparse.backends import flex, torch_linear


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="path of the JSON results")
    parser.add_argument("--torch-default", action="store_true",
                        help="torch's default compile policy (dynamic shapes from the second shape on)")
    parser.add_argument("--methods", nargs="+", default=["topk", "sla"])
    parser.add_argument("--sizes", nargs="+", type=int, default=[16384, 65536])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("flex_shapes.py needs a CUDA GPU")
    if args.torch_default:
        for compiled in (flex.FLEX_ATTENTION, torch_linear.KEEP_WEIGHTED_LINEAR):
            compiled.budget = 0  # every CUDA call through the dynamic twin: torch.compile's default policy
    rows = bench.run(args.methods, args.sizes, torch.device("cuda"), torch.bfloat16, batch=2, heads=8, dim=64,
                     backward=True, check=True, wanted_backends=["flex"])
    mode = "torch-default" if args.torch_default else "flexsparse"
    results = [{"mode": mode, "method": r.method, "n": r.n, "fwd": r.forward_ms, "fwd_bwd": r.forward_backward_ms,
                "err": r.max_error} for r in rows]
    for row in results:
        print(row, flush=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
