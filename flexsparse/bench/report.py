"""Tables and the results JSON of a run."""
from __future__ import annotations

import json
import os

from tabulate import tabulate

from .cases import BASELINES, MODES


def config_text(config: dict | None) -> str:
    """A config's keys other than ``method``, e.g. ``block_size=64 topk=8``."""
    return " ".join(f"{k}={v}" for k, v in (config or {}).items() if k != "method")


def ms_text(result: dict | None) -> str:
    """``"median (min-max)"`` ms of an ok timing result, its status otherwise, blank for no result."""
    if result is None:
        return ""
    if result["status"] != "ok":
        return result["status"]
    return f"{result['median_ms']:.3g} ({result['min_ms']:.3g}-{result['max_ms']:.3g})"


def _row_key(case: dict) -> tuple:
    return case["kind"], json.dumps(case["config"], sort_keys=True), case["backend"], case["n"]


def timing_table(results: list[dict]) -> str:
    """One row per (method or baseline, backend, config, N): median and min-max ms of each mode, the speedup
    (dense SDPA's median in the same run over the row's: >1 when faster than SDPA) and the max error of the
    reference check."""
    errors = {(json.dumps(r["case"]["config"], sort_keys=True), r["case"]["backend"]): r for r in results
              if r["case"]["mode"] == "check"}
    rows: dict[tuple, dict] = {}
    for r in results:
        if r["case"]["mode"] != "check":
            rows.setdefault(_row_key(r["case"]), {})[r["case"]["mode"]] = r
    sdpa = {(r["case"]["n"], r["case"]["mode"]): r for r in results
            if r["case"]["kind"] == "sdpa" and r["status"] == "ok"}
    table = []
    for (kind, config, backend, n), by_mode in rows.items():
        case = next(iter(by_mode.values()))["case"]
        name = case["config"]["method"] if kind == "method" else BASELINES[kind]
        line = [name, backend or "", config_text(case["config"]), n]
        line += [ms_text(by_mode.get(mode)) for mode in MODES]
        for mode in MODES:
            mine, dense = by_mode.get(mode), sdpa.get((n, mode))
            ok = mine is not None and mine["status"] == "ok" and dense is not None
            line.append(f"{dense['median_ms'] / mine['median_ms']:.3g}" if ok else "")
        check = errors.get((config, backend))
        line.append("" if check is None else f"{check['max_error']:.2g}" if check["status"] == "ok"
                    else check["status"])
        table.append(line)
    headers = ["method", "backend", "config", "N", "fwd ms (min-max)", "fwd+bwd ms (min-max)", "speedup fwd",
               "speedup fwd+bwd", "max err vs ref"]
    return tabulate(table, headers=headers, disable_numparse=True)


def problems(results: list[dict]) -> list[str]:
    """One line per case that was skipped (its config does not fit the shape) or failed, with the reason."""
    return [f"{r['status']}: {r['case']['label']}: {r['reason']}" for r in results if r["status"] != "ok"]


def write_json(path: str, payload: dict) -> str:
    """Write ``payload`` as indented JSON to ``path`` (its folder created); returns ``path``."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=1, default=str)
    return path
