"""The host path's budget: Triton launches and ATen ops (kernels outside Triton's) per eager call of each method on
the ``triton`` backend, as ``benchmarks/launch_audit.py`` counts them (CPU, launches stubbed, N=256, one head).

At N <= 16K an eager call costs its host time (docs/host_time.md), and every launch or op adds to it. The counts do
not vary from run to run, so a change that adds one fails here; one that removes some should lower the budget. The
CPU paths can differ from CUDA's where a step picks a strategy by device (the Gluon kernels, the linear branch's
dense sums), so these are the CPU's counts, not the GPU's."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

import triton_support as ts

pytest.importorskip("triton")

# (method, phase): (Triton launches, ATen ops) at most
BUDGET = {("topk", "fwd"): (3, 0), ("topk", "fwd+bwd"): (6, 2), ("vsa", "fwd"): (3, 2), ("vsa", "fwd+bwd"): (7, 9),
          ("llsa", "fwd"): (3, 0), ("llsa", "fwd+bwd"): (8, 2), ("sla", "fwd"): (5, 3), ("sla", "fwd+bwd"): (11, 11),
          ("sla2", "fwd"): (6, 2), ("sla2", "fwd+bwd"): (13, 7)}
LINE = re.compile(r"^(\w+)\s+(fwd|fwd\+bwd)\s+Triton\s+(\d+), ATen\s+(\d+),")


@ts.cpu_parent
def test_eager_calls_stay_within_their_launch_and_op_budget():
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, os.path.join(ts.ROOT, "benchmarks", "launch_audit.py")],
                          capture_output=True, text=True, cwd=ts.ROOT, env=dict(env, PYTHONPATH=ts.ROOT), timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    counts = {(m[1], m[2]): (int(m[3]), int(m[4])) for m in map(LINE.match, done.stdout.splitlines()) if m}
    assert set(counts) == set(BUDGET), done.stdout
    over = {key: (counts[key], limit) for key, limit in BUDGET.items()
            if counts[key][0] > limit[0] or counts[key][1] > limit[1]}
    assert not over, f"(Triton launches, ATen ops) over the budget: {over}\n{done.stdout}"
