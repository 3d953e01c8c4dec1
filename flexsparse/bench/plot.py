"""A log-log plot of time against sequence length N."""
from __future__ import annotations

from .cases import BASELINES, MODES
from .report import config_text


def plot_times(results: list[dict], path: str, title: str) -> str:
    """Plot the ok timing results (median ms against N, one panel per mode, one line per method/backend/config,
    baselines dashed) to ``path``; returns the line to print: what was written, or why no plot was."""
    timed = [r for r in results if r["status"] == "ok" and r["case"]["mode"] != "check"]
    sizes = sorted({r["case"]["n"] for r in timed if r["case"]["kind"] == "method"})
    if len(sizes) < 2:
        return f"no plot: it needs timings at 2 sizes or more, got N={sizes}"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no plot: matplotlib is not installed (pip install matplotlib)"
    modes = [m for m in MODES if any(r["case"]["mode"] == m for r in timed)]
    fig, axes = plt.subplots(1, len(modes), figsize=(6.5 * len(modes), 5), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        lines: dict[str, list] = {}
        for r in timed:
            case = r["case"]
            if case["mode"] != mode:
                continue
            if case["kind"] == "method":
                name = f"{case['config']['method']} ({case['backend']}) {config_text(case['config'])}"
            else:
                name = BASELINES[case["kind"]]
            lines.setdefault(name, []).append((case["n"], r["median_ms"]))
        for name, points in lines.items():
            style = {BASELINES["sdpa"]: dict(color="k", linestyle="--"),
                     BASELINES["flex_dense"]: dict(color="0.5", linestyle="--")}
            ax.plot(*zip(*sorted(points)), marker="o", label=name, **style.get(name, {}))
        ax.set(xscale="log", yscale="log", xlabel="sequence length N", ylabel="median ms", title=f"{title}: {mode}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return f"wrote {path}"
