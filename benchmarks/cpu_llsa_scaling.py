"""LLSA on the ``torch`` backend: forward and forward+backward time and peak memory against N.

Not a ``python -m flexsparse`` case: the runner times on one process's device, this needs the peak resident memory
of each N, so each N runs in a fresh process (``tests/test_scaling.py`` bounds it at N = 262144).
Usage: ``python benchmarks/cpu_llsa_scaling.py [--sizes 4096 16384 ...] [--device cpu]``
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

from tabulate import tabulate


def measure(n: int, device: str, dim: int = 64) -> dict:
    """One LLSA (b=16, K=8, levels auto) forward and forward+backward at length ``n``, B=H=1, fp32."""
    import torch

    import flexsparse as fs

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 1, n, dim, device=device, requires_grad=True) for _ in range(3))
    cfg = {"method": "llsa", "block_size": 16, "topk": 8}
    start = time.perf_counter()
    out = fs.attention(q, k, v, cfg, backend="torch")
    forward = time.perf_counter() - start
    out.square().sum().backward()
    total = time.perf_counter() - start
    finite = all(bool(x.grad.isfinite().all()) for x in (q, k, v))
    return {"n": n, "forward_s": forward, "forward_backward_s": total, "finite_grads": finite,
            "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[4096, 16384, 65536, 262144])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--json", help="write the rows to this JSON file")
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.device)))
        return
    rows = []
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    for n in args.sizes:
        result = subprocess.run([sys.executable, __file__, "--one", str(n), "--device", args.device],
                                check=True, capture_output=True, text=True, env=env)
        rows.append(json.loads(result.stdout.strip().splitlines()[-1]))
        print(f"N={n}: {rows[-1]}", file=sys.stderr)
    print(tabulate(rows, headers="keys", floatfmt=".3f"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
