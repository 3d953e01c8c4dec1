"""``--compare REF``: the same cases timed on the working tree and on another tree, side by side.

Each tree runs in its own ``worker.py`` process (this tree's worker, ``PYTHONPATH`` set to the tree), the trees
alternating over the rounds; a case keeps its best median over the rounds. REF is a path to a source tree (a
folder with ``flexsparse/``) or a git ref of this tree's repository, extracted with ``git archive``.
"""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
from typing import Callable

from tabulate import tabulate

from .report import ms_text
from ..triton._runtime.tiles import VARIABLE as TILES_VARIABLE

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker.py")


def is_tree(path: str) -> bool:
    """Whether ``path`` is a source tree: a folder holding ``flexsparse/__init__.py``."""
    return os.path.isfile(os.path.join(path, "flexsparse", "__init__.py"))


def resolve_ref(ref: str, repo: str) -> str | None:
    """The commit id of git ref ``ref`` in the repository at ``repo``, or ``None`` if it names no commit."""
    try:
        out = subprocess.run(["git", "-C", repo, "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def extract(commit: str, repo: str, into: str) -> str:
    """``git archive`` of ``commit`` of the repository at ``repo``, unpacked into the folder ``into``."""
    tar = subprocess.run(["git", "-C", repo, "archive", "--format=tar", commit], capture_output=True, check=True,
                         timeout=300).stdout
    with tarfile.open(fileobj=io.BytesIO(tar)) as archive:
        archive.extractall(into, filter="data")
    return into


def run_worker(root: str, cases: list[dict], workdir: str, name: str, tiles: str | None) -> dict:
    """Run ``cases`` in a ``worker.py`` process that imports flexsparse from the tree at ``root``; returns its
    report (``versions``, ``results``). ``tiles``: ``FLEXSPARSE_TRITON_TILES`` for the process."""
    cases_path, results_path = (os.path.join(workdir, f"{name}_{what}.json") for what in ("cases", "results"))
    with open(cases_path, "w") as f:
        json.dump(cases, f)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
    env.pop(TILES_VARIABLE, None)
    if tiles:
        env[TILES_VARIABLE] = tiles
    done = subprocess.run([sys.executable, WORKER, cases_path, results_path, "--prefix", f"[{name}] "], env=env)
    if done.returncode != 0:
        raise RuntimeError(f"the worker for {name} ({root}) exited with status {done.returncode}")
    with open(results_path) as f:
        return json.load(f)


def best(results: list[dict]) -> dict:
    """Of one case's results over the rounds, the ok one with the smallest median (else the last one)."""
    ok = [r for r in results if r["status"] == "ok"]
    return min(ok, key=lambda r: r["median_ms"]) if ok else results[-1]


def compare(cases: list[dict], trees: dict[str, str], rounds: int, workdir: str, tiles: str | None,
            on_round: Callable[[dict], None] | None = None) -> dict:
    """Time ``cases`` on every tree of ``trees`` (name -> root; two of them, the working tree first) for
    ``rounds`` rounds, the order of the trees reversed every other round. Returns ``versions`` (per tree),
    ``rounds`` (every worker's results) and ``results``: per case, the best result of each tree and ``ratio``,
    the second tree's median over the first's (working tree, then REF: ref / tree, >1 when the working tree is
    faster; ``None`` unless both are ok). ``on_round`` gets that report after each round (a long comparison cut
    short keeps its finished rounds)."""
    names = list(trees)
    versions, per_round = {}, []
    for r in range(rounds):
        this_round = {}
        for name in (names if r % 2 == 0 else names[::-1]):
            report = run_worker(trees[name], cases, workdir, f"{name}{r}", tiles)
            versions[name] = report["versions"]
            this_round[name] = [{"label": res["case"]["label"], **{k: v for k, v in res.items() if k != "case"}}
                                for res in report["results"]]
        per_round.append(this_round)
        if on_round is not None and r + 1 < rounds:
            on_round(_merge(cases, names, versions, per_round))
    return _merge(cases, names, versions, per_round)


def _merge(cases: list[dict], names: list[str], versions: dict, per_round: list[dict]) -> dict:
    merged = []
    for i, case in enumerate(cases):
        row = {"case": case}
        for name in names:
            row[name] = best([rnd[name][i] for rnd in per_round])
        a, b = (row[name] for name in names)
        row["ratio"] = b["median_ms"] / a["median_ms"] if a["status"] == b["status"] == "ok" else None
        merged.append(row)
    return {"versions": versions, "rounds": per_round, "results": merged}


def compare_table(merged: list[dict], names: list[str]) -> str:
    """One row per case: each tree's best median and min-max ms, and the ratio ``second / first`` median."""
    table = [[row["case"]["label"], ms_text(row[names[0]]), ms_text(row[names[1]]),
              "" if row["ratio"] is None else f"{row['ratio']:.3f}"] for row in merged]
    headers = ["case", f"{names[0]} ms (min-max)", f"{names[1]} ms (min-max)", f"{names[1]} / {names[0]}"]
    return tabulate(table, headers=headers, disable_numparse=True)
