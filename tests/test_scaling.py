"""LLSA on the torch backend is log-linear: N = 262144 forward+backward fits a memory bound that a
quadratic algorithm cannot meet (one fp32 N x N score matrix alone is 275 GB)."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MEMORY_BOUND_GB = 8.0


@pytest.mark.exhaustive
def test_llsa_torch_backend_at_262144_tokens_on_cpu():
    n = 262144
    assert n * n * 4 / 1e9 > 30 * MEMORY_BOUND_GB
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    result = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "cpu_llsa_scaling.py"), "--one", str(n)],
                            capture_output=True, text=True, env=env, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    row = json.loads(result.stdout.strip().splitlines()[-1])
    print(row)
    assert row["finite_grads"]
    assert row["peak_rss_gb"] < MEMORY_BOUND_GB
