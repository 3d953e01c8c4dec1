"""Registers, spills and shared memory of every kernel in ``triton_sm90_report.py``: this tree against a git revision.

Each tree is compiled for sm_90 by its own copy of the report (the base's in a temporary git worktree, so a revision
of an older package layout runs the report written for that layout), without a GPU; the kernels whose numbers
differ, or that only one tree reports, are printed. Not a ``python -m flexsparse --compare`` case: that times both
trees on a device, this compares their compiled kernels offline. Run it under the GPU image's triton (3.6:
``pip install triton==3.6.0`` in a side venv): register counts differ between triton versions, and a register
increase of one kernel (128 -> 144 at L=3 in the coarse dQ kernel, one CTA per SM fewer) showed under 3.6 only.

    python benchmarks/sm90_compare.py REV [--d 64 128] [--blocks 64x64 128x64]
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINE = re.compile(r"^(.+?)\s+regs\s+(\d+) stack\s+(\d+) local\s+\d+ smem\s+(\d+)")
FAILED = re.compile(r"^(.+?)\s+FAILED: ")


def report(tree: str, d: int, blocks: str) -> dict[str, tuple[int, int, int] | str]:
    """``{kernel: (registers, stack bytes, shared memory bytes)}`` from ``tree``'s own report, ``"FAILED"`` for a
    kernel it could not compile (a name the report prints twice, for two configurations, gets ``#2``)."""
    script = os.path.join(tree, "benchmarks", "triton_sm90_report.py")
    if not os.path.isfile(script):
        raise SystemExit(f"{tree} has no benchmarks/triton_sm90_report.py to compile its kernels with")
    env = {**os.environ, "PYTHONPATH": tree}
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, script, "--d", str(d), "--blocks", blocks], capture_output=True, text=True,
                          cwd=tree, env=env)
    if done.returncode != 0:
        print(f"the report of {tree} failed (exit {done.returncode}):\n{done.stderr[-2000:]}", file=sys.stderr)
    numbers = {}
    for line in done.stdout.splitlines():
        m = LINE.match(line) or FAILED.match(line)
        if m is None:
            continue
        name, repeat = m.group(1).strip(), 1
        while (name if repeat == 1 else f"{name} #{repeat}") in numbers:
            repeat += 1
        numbers[name if repeat == 1 else f"{name} #{repeat}"] = (
            tuple(int(x) for x in m.group(2, 3, 4)) if m.re is LINE else "FAILED")
    return numbers


def numbers_text(numbers: tuple[int, int, int] | str | None) -> str:
    if numbers is None or isinstance(numbers, str):
        return numbers or "-"
    return "regs {:3d} stack {:3d} smem {:6d}".format(*numbers)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("rev", help="the base git revision")
    parser.add_argument("--d", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--blocks", nargs="+", default=["64x64", "128x64"])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = os.path.join(tmp, "base")
        subprocess.run(["git", "-C", ROOT, "worktree", "add", "-q", "--detach", base, args.rev], check=True)
        try:
            for d in args.d:
                for blocks in args.blocks:
                    old, new = report(base, d, blocks), report(ROOT, d, blocks)
                    print(f"D={d} blocks {blocks}: {len(new)} kernels here, {len(old)} at {args.rev}")
                    for name in sorted(old.keys() | new.keys()):
                        if old.get(name) != new.get(name):
                            print(f"  {name:34s} {numbers_text(old.get(name)):32s} -> {numbers_text(new.get(name))}")
        finally:
            subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", base], check=True)


if __name__ == "__main__":
    main()
