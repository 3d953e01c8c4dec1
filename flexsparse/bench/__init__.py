"""The benchmark runner behind ``python -m flexsparse`` (``cli``), and helpers for the scripts in ``benchmarks/``.

Modules: ``cases`` (the case registry), ``suites`` (named default selections), ``measure`` (build, time and
check cases in a process), ``timing`` (timers), ``worker.py`` (``measure`` in a process of its own, against
the flexsparse tree on ``PYTHONPATH``), ``compare`` (``--compare REF``), ``env`` (versions), ``report``
(tables, JSON), ``plot``, ``cli``; ``inputs`` and ``scripts`` serve the standalone scripts.
"""
from .inputs import offset_qkv, structured_qkv
from .scripts import attempt, bench_report, env_var, rel_l2
from .timing import kernel_times, time_spread

__all__ = ["attempt", "bench_report", "env_var", "kernel_times", "offset_qkv", "rel_l2", "structured_qkv",
           "time_spread"]
