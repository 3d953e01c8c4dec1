"""Validation curves of several training runs in one figure, and their final losses side by side.

A run is ``LABEL=PATH[:METHOD]``: a ``study.json`` of ``examples.dit.study`` (METHOD picks its entry) or a
``history.json`` of ``examples.dit.train``. The table gives the last validation loss of the raw and EMA model,
the mean of the last ``--tail`` evaluations (less noisy at a few hundred steps) and each run's difference to
the first run.

    python -m examples.dit.compare_runs "bf16=docs/study/study.json:sla" "FP8 QAT=/tmp/qat/study.json:sla" \\
        --out docs/qat_gpu.png
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from tabulate import tabulate


def load_curves(spec: str) -> tuple[str, dict]:
    """``LABEL=PATH[:METHOD]`` -> ``(label, {"val_step", "val_loss", "val_loss_ema"})``."""
    label, _, where = spec.partition("=")
    if not where:
        raise ValueError(f"run {spec!r}: expected LABEL=PATH[:METHOD]")
    path, _, method = where.partition(":")
    data = json.loads(Path(path).read_text())
    if "methods" in data:
        if method not in data["methods"]:
            raise ValueError(f"run {spec!r}: {path} holds methods {sorted(data['methods'])}, not {method!r}")
        data = data["methods"][method]
    return label, {key: data[key] for key in ("val_step", "val_loss", "val_loss_ema")}


def summary(runs: list[tuple[str, dict]], tail: int) -> list[dict]:
    """Last and tail-mean validation losses of each run, and their relative difference to the first run."""
    rows = []
    for label, curves in runs:
        row = {"run": label}
        for key in ("val_loss", "val_loss_ema"):
            values = curves[key]
            row[f"{key} last"] = values[-1]
            row[f"{key} mean of last {tail}"] = sum(values[-tail:]) / len(values[-tail:])
        rows.append(row)
    for row in rows[1:]:
        for key in list(row):
            if key != "run" and "%" not in key:
                row[f"{key} vs {rows[0]['run']} %"] = 100 * (row[key] / rows[0][key] - 1)
    return rows


def plot(runs: list[tuple[str, dict]], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, key, name in zip(axes, ("val_loss", "val_loss_ema"), ("raw model", "EMA model")):
        for i, (label, curves) in enumerate(runs):
            ax.plot(curves["val_step"], curves[key], "o-", ms=3, color=f"C{i}", label=label)
        ax.set_title(f"{title + ': ' if title else ''}validation loss, {name}")
        ax.set_xlabel("step")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend()
    axes[0].set_ylabel("flow-matching loss")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="LABEL=PATH[:METHOD]; the first run is the baseline")
    p.add_argument("--out", type=Path, help="figure (PNG)")
    p.add_argument("--title", default="")
    p.add_argument("--tail", type=int, default=5, help="evaluations averaged at the end")
    args = p.parse_args()
    runs = [load_curves(spec) for spec in args.runs]
    print(tabulate(summary(runs, args.tail), headers="keys", floatfmt=".4f"))
    if args.out:
        plot(runs, args.out, args.title)


if __name__ == "__main__":
    main()
