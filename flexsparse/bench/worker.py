"""Run benchmark cases against whichever flexsparse ``PYTHONPATH`` selects, in a process of its own.

    PYTHONPATH=/path/to/tree python /abs/path/flexsparse/bench/worker.py CASES.json RESULTS.json [--prefix TEXT]

Run by file path (not ``-m``): then ``import flexsparse`` finds the tree on ``PYTHONPATH``, while this script and
its helpers (``measure.py``, ``timing.py``, ``env.py``, loaded from this folder) stay those of the tree that
started it. CASES.json: a list of case dicts (``measure``). RESULTS.json gets ``{"versions": env.versions(),
"results": measure.run_cases(cases)}``. ``FLEXSPARSE_TRITON_TILES`` in the environment applies as usual.
"""
from __future__ import annotations

import argparse
import json

if __package__:
    from .env import versions
    from .measure import run_cases
else:  # run as a script: the sibling modules are on sys.path[0]
    from env import versions
    from measure import run_cases


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("cases", help="JSON file with the list of case dicts")
    parser.add_argument("results", help="JSON file to write")
    parser.add_argument("--prefix", default="", help="text before each case's label in the progress bar")
    args = parser.parse_args(argv)
    with open(args.cases) as f:
        cases = json.load(f)
    device = cases[0]["device"] if cases else "cpu"
    report = {"versions": versions(device), "results": run_cases(cases, args.prefix)}
    with open(args.results, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
