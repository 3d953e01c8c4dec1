"""``python -m flexsparse`` (also the ``flexsparse`` script): the benchmark runner.

A suite (``suites``) gives the default cases; the options narrow or change them. The cases run in this process
(``measure``), or with ``--compare REF`` once per tree in worker processes (``compare``). A table goes to the
terminal, the results JSON (and a plot of time against N) to ``--out``.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
import textwrap
from dataclasses import dataclass

import torch

import flexsparse

from . import compare as comparing
from .cases import DTYPE_NAMES, MODES, backend_names, example_config, make_cases, method_names, runnable_backends
from .env import device_name, versions
from .measure import run_cases
from .plot import plot_times
from .report import problems, timing_table, write_json
from .scripts import env_var
from .suites import SUITES
from ..triton._runtime.tiles import VARIABLE as TILES_VARIABLE

OVERRIDES = (("block_size", "--block-size"), ("topk", "--topk"), ("topk_ratio", "--topk-ratio"))


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m flexsparse`` (``main`` resolves and checks it)."""
    suites = "\n".join(textwrap.fill(suite.about, 100, initial_indent=f"  {name:9s}", subsequent_indent=" " * 11)
                       for name, suite in SUITES.items())
    parser = argparse.ArgumentParser(
        prog="flexsparse", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Time flexsparse's methods and backends against dense attention (forward and\n"
                    "forward+backward) and check them against the reference implementation.",
        epilog=f"suites:\n{suites}\n\nexamples:\n"
               "  python -m flexsparse                                  # the demo suite on this machine\n"
               "  python -m flexsparse --suite compare                  # the GPU comparison shape\n"
               "  python -m flexsparse --methods llsa --sizes 4096 16384 --block-size 32\n"
               "  python -m flexsparse --suite compare --compare main   # this tree against git ref main\n"
               "  python -m flexsparse --compare /path/to/other/tree    # ... or against another source tree")
    parser.add_argument("--suite", choices=list(SUITES), default="demo", help="default cases (default: demo)")
    parser.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--methods", nargs="+", choices=method_names(), metavar="METHOD",
                        help=f"methods to time, of {method_names()} (default: the suite's)")
    parser.add_argument("--backends", nargs="+", choices=backend_names(), metavar="BACKEND",
                        help=f"backends to time, of {backend_names()} (default: the suite's, or every one that "
                             "runs on the device)")
    parser.add_argument("--sizes", nargs="+", type=positive_int, metavar="N", help="sequence lengths")
    parser.add_argument("--dtype", choices=list(DTYPE_NAMES), help="input dtype (demo: bf16 on CUDA, fp32 on CPU)")
    parser.add_argument("--batch", type=positive_int, help="batch size B")
    parser.add_argument("--heads", type=positive_int, help="heads H")
    parser.add_argument("--dim", type=positive_int, help="head dim D")
    parser.add_argument("--block-size", type=int, help="block_size of the methods whose configs have one")
    parser.add_argument("--topk", type=int, help="topk of the methods whose configs have one")
    parser.add_argument("--topk-ratio", type=float, help="topk_ratio of the methods whose configs have one")
    parser.add_argument("--no-backward", action="store_true", help="time the forward only")
    parser.add_argument("--no-check", action="store_true", help="skip the check against the reference")
    parser.add_argument("--graph", action="store_true", help="time CUDA-graph replays of each call (CUDA only)")
    parser.add_argument("--tiles", metavar="JSON", help=f"Triton tile overrides, set as {TILES_VARIABLE}, e.g. "
                                                        "'{\"fwd\": {\"BM\": 64}}'")
    parser.add_argument("--compare", metavar="REF", help="also time the cases on REF, a git ref of this "
                        "repository or a path to a source tree, and tabulate ref / tree time ratios (no check)")
    parser.add_argument("--rounds", type=positive_int,
                        help="with --compare: rounds, the trees alternating, each case keeping its best median "
                             "(default: 2)")
    parser.add_argument("--out", default="bench_out", help="folder for results.json / compare.json and "
                                                          "timing.png (default: bench_out)")
    return parser


@dataclass
class Run:
    """What the command line resolved to: the cases and how to run them."""

    suite: str
    device: torch.device
    shape: dict
    cases: list
    notes: list[str]
    tiles: str | None
    tree: str                      # the root of the flexsparse tree imported here
    ref: str | None = None         # with --compare: the other tree's path, or None for a git commit
    ref_commit: str | None = None  # with --compare REF naming a git ref: its commit


def _device(parser, text: str | None) -> torch.device:
    """``--device``, defaulting to cuda when available; argparse error for an unusable one."""
    try:
        device = torch.device(text or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError as exc:
        parser.error(f"argument --device: {exc}")
    if device.type not in ("cpu", "cuda"):
        parser.error(f"argument --device: cpu or cuda, got {text!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("argument --device: cuda is not available on this machine (no GPU, or a CPU-only torch "
                     f"{torch.__version__}); use --device cpu")
    return device


def _apply_overrides(parser, args, configs: dict[str, dict]) -> list[str]:
    """Set ``--block-size``/``--topk``/``--topk-ratio`` in the configs that have the key and accept the value;
    argparse error when no selected method does. Returns a line per option saying which methods took it."""
    notes = []
    for key, flag in OVERRIDES:
        value = getattr(args, key)
        if value is None:
            continue
        took, rejected = [], []
        for method, config in configs.items():
            if key in config:
                try:
                    flexsparse.Config.from_dict({**config, key: value})
                except (ValueError, TypeError) as exc:
                    rejected.append(f"{method}: {exc}")
                    continue
                config[key] = value
                took.append(method)
        without = [m for m, c in configs.items() if key not in c]
        if not took:
            why = "; ".join(rejected) if rejected else f"no selected method's config has {key!r} ({without})"
            parser.error(f"argument {flag}: {value} is usable by no selected method: {why}")
        note = f"{flag} {value}: taken by {', '.join(took)}"
        if rejected:
            note += f"; rejected (example value kept) by {'; '.join(rejected)}"
        if without:
            note += f"; not by {', '.join(without)} (no {key} in their configs)"
        notes.append(note)
    return notes


def _backends(parser, args, suite, methods: list[str], device: torch.device, backward: bool):
    """method -> the backends it is timed on; notes on the methods left out."""
    wanted = args.backends or suite.backends
    for backend in args.backends or []:
        if not _runs_on_any(backend, methods, device, backward):
            hint = " with backward (add --no-backward)" if _runs_on_any(backend, methods, device, False) else ""
            if backend == "triton" and device.type == "cpu":
                hint = " (Triton kernels run on CPU only under TRITON_INTERPRET=1)"
            parser.error(f"argument --backends: {backend} does not run on {device.type}{hint} for the selected "
                         f"methods {methods}")
    chosen = {m: runnable_backends(m, device, backward, wanted) for m in methods}
    notes = [f"{m}: no backend of {list(wanted) if wanted else 'its'} runs it on {device.type}"
             for m, b in chosen.items() if not b]
    chosen = {m: b for m, b in chosen.items() if b}
    if not chosen:
        flag = "--backends" if args.backends else "--methods" if args.methods else "--suite"
        parser.error(f"argument {flag}: no case to run on {device.type}: " + "; ".join(notes))
    return chosen, notes


def _runs_on_any(backend: str, methods: list[str], device: torch.device, backward: bool) -> bool:
    """Whether ``backend`` runs one of ``methods`` on ``device``."""
    return any(runnable_backends(m, device, backward, [backend]) for m in methods)


def resolve(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Run:
    """The run the parsed arguments ask for; argparse errors (naming the argument) for unusable ones."""
    device = _device(parser, args.device)
    if args.graph and device.type != "cuda":
        parser.error(f"argument --graph: CUDA graphs need a CUDA device, got {device.type}")
    suite = SUITES[args.suite]
    shape = suite.shape(device.type)
    for key in ("sizes", "batch", "heads", "dim", "dtype"):
        if getattr(args, key) is not None:
            shape[key] = getattr(args, key)
    backward = not args.no_backward
    methods = args.methods or [m for m in (suite.methods or method_names()) if m in method_names()]
    configs = {m: example_config(m) for m in methods}
    notes = _apply_overrides(parser, args, configs)
    backends, left_out = _backends(parser, args, suite, methods, device, backward)
    notes += left_out
    if args.tiles is not None:
        try:
            tiles = json.loads(args.tiles)
        except json.JSONDecodeError as exc:
            parser.error(f"argument --tiles: not JSON: {exc}")
        if not isinstance(tiles, dict) or not all(isinstance(v, dict) for v in tiles.values()):
            parser.error(f"argument --tiles: a JSON object of objects (kind -> tile sizes), got {args.tiles!r}")
    tree = os.path.dirname(os.path.dirname(os.path.abspath(flexsparse.__file__)))
    ref = ref_commit = None
    if args.rounds is not None and args.compare is None:
        parser.error("argument --rounds: only with --compare")
    if args.compare is not None:
        if comparing.is_tree(args.compare):
            ref = os.path.abspath(args.compare)
        else:
            ref_commit = comparing.resolve_ref(args.compare, tree)
            if ref_commit is None:
                parser.error(f"argument --compare: {args.compare!r} is neither a source tree (a folder with "
                             f"flexsparse/__init__.py) nor a git ref of the repository at {tree}")
    check = suite.check and not args.no_check and args.compare is None
    flex_timed = any("flex" in b for b in backends.values())
    baselines = tuple(kind for kind in suite.baselines if kind != "flex_dense" or flex_timed)
    configs = {m: c for m, c in configs.items() if m in backends}
    cases = make_cases(configs, backends, shape["sizes"], batch=shape["batch"], heads=shape["heads"],
                       dim=shape["dim"], dtype=DTYPE_NAMES[shape["dtype"]], modes=MODES[:1 + backward],
                       device=str(device), baselines=baselines, check=check, graph=args.graph)
    return Run(args.suite, device, shape, cases, notes, args.tiles, tree, ref, ref_commit)


def run_here(run: Run, args) -> int:
    """Time the cases in this process; table, JSON, plot. Non-zero when no method case ran or one failed."""
    with env_var(TILES_VARIABLE, run.tiles) if run.tiles is not None else contextlib.nullcontext():
        results = run_cases([case.to_dict() for case in run.cases])
    print(timing_table(results))
    for line in problems(results):
        print(line)
    payload = {"suite": run.suite, "args": vars(args), "shape": run.shape, "notes": run.notes,
               "versions": versions(run.device), "results": results}
    print(f"wrote {write_json(os.path.join(args.out, 'results.json'), payload)}")
    ran = [r for r in results if r["status"] == "ok" and r["case"]["kind"] == "method" and r["case"]["mode"] != "check"]
    if not ran:
        print(f"no method case ran at N={run.shape['sizes']}: none fits that size or all failed (the reasons are "
              "above); no plot")
        return 1
    s = run.shape
    title = f"{device_name(run.device)}, B={s['batch']} H={s['heads']} D={s['dim']} {s['dtype']}"
    print(plot_times(results, os.path.join(args.out, "timing.png"), title))
    return 1 if any(r["status"] == "failed" for r in results) else 0


def run_compare(run: Run, args) -> int:
    """Time the cases on this tree and on ``--compare``'s, alternating over ``--rounds``; table and JSON."""
    cases = [case.to_dict() for case in run.cases]
    with tempfile.TemporaryDirectory(prefix="flexsparse-compare-") as workdir:
        ref = run.ref or comparing.extract(run.ref_commit, run.tree, os.path.join(workdir, "ref"))
        rounds = args.rounds or 2

        def progress(partial: dict) -> None:
            print(f"after round {len(partial['rounds'])} of {rounds}:")
            print(comparing.compare_table(partial["results"], ["tree", "ref"]))
        out = comparing.compare(cases, {"tree": run.tree, "ref": ref}, rounds, workdir, run.tiles, progress)
    if run.ref_commit is not None:
        out["versions"]["ref"]["flexsparse_revision"] = run.ref_commit
        out["versions"]["ref"]["flexsparse_path"] = f"git archive {args.compare}"
    for name in ("tree", "ref"):
        v = out["versions"][name]
        print(f"{name}: {v['flexsparse_path']} (revision {v['flexsparse_revision']})")
    print(comparing.compare_table(out["results"], ["tree", "ref"]))
    for name in ("tree", "ref"):
        for line in problems([{**row[name], "case": row["case"]} for row in out["results"]]):
            print(f"[{name}] {line}")
    payload = {"suite": run.suite, "args": vars(args), "shape": run.shape, "notes": run.notes, **out}
    print(f"wrote {write_json(os.path.join(args.out, 'compare.json'), payload)}")
    if not any(row["ratio"] is not None for row in out["results"] if row["case"]["kind"] == "method"):
        print("no method case ran on both trees (the reasons are above)")
        return 1
    return 0


def main(argv=None) -> int:
    """Parse ``argv``, run, print; returns the exit status (argparse exits with 2 on unusable arguments)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    run = resolve(parser, args)
    s = run.shape
    print(f"flexsparse bench, suite {run.suite}, on {device_name(run.device)}: B={s['batch']} H={s['heads']} "
          f"D={s['dim']} {s['dtype']}, N={s['sizes']}, {len(run.cases)} cases"
          + (f", compared with {args.compare}" if args.compare else ""))
    for note in run.notes:
        print(note)
    return run_compare(run, args) if args.compare is not None else run_here(run, args)
