"""The benchmark runner behind ``python -m flexsparse`` (``flexsparse.bench``), on CPU at tiny sizes."""
from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import flexsparse as fs
from flexsparse.bench import cli, compare, measure, plot

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--device", "cpu", "--backends", "torch", "--batch", "1", "--heads", "1", "--dim", "16"]


def run_main(argv: list[str]) -> tuple[int, str]:
    """``cli.main(argv)``: its exit status and what it printed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = cli.main(argv)
    return status, out.getvalue()


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The demo suite on CPU for two methods at two tiny sizes, with the reference check."""
    out = tmp_path_factory.mktemp("demo")
    status, printed = run_main(TINY + ["--methods", "topk", "llsa", "--sizes", "512", "1024", "--out", str(out)])
    with open(out / "results.json") as f:
        return status, printed, json.load(f), out


def test_demo_times_every_method_backend_size_and_mode_and_checks_against_the_reference(demo):
    status, printed, report, out = demo
    assert status == 0
    by_label = {r["case"]["label"]: r for r in report["results"]}
    for name in ("topk/torch", "llsa/torch", "dense SDPA"):
        for n in (512, 1024):
            for mode in ("fwd", "fwd+bwd"):
                assert by_label[f"{name} N={n} {mode}"]["status"] == "ok"
    for name in ("topk/torch", "llsa/torch"):
        check = by_label[f"check {name} N=700"]
        assert check["status"] == "ok" and check["max_error"] < 1e-5
    lines = [line.split() for line in printed.splitlines()]
    rows = [line for line in lines if line[:2] in (["topk", "torch"], ["llsa", "torch"])]
    assert len(rows) == 4 and all(float(row[-1]) < 1e-5 for row in rows)    # one per (method, N), max err last
    assert (out / "timing.png").stat().st_size > 0 and f"wrote {out / 'timing.png'}" in printed


def test_the_json_holds_configs_shapes_versions_and_min_median_max(demo):
    _, _, report, _ = demo
    versions = report["versions"]
    assert versions["torch"] == torch.__version__ and versions["python"] and versions["date"]
    assert {"triton", "flexsparse_revision", "device"} <= set(versions)
    assert versions["flexsparse_path"] == ROOT
    timed = [r for r in report["results"] if r["case"]["mode"] != "check"]
    assert len(timed) == 12
    for r in timed:
        case = r["case"]
        assert (case["batch"], case["heads"], case["dim"], case["dtype"]) == (1, 1, 16, "float32")
        assert len(r["times_ms"]) >= 3
        assert r["min_ms"] == min(r["times_ms"]) and r["max_ms"] == max(r["times_ms"])
        assert r["min_ms"] <= r["median_ms"] <= r["max_ms"] and r["min_ms"] > 0
        if case["kind"] == "method":
            assert case["backend"] == "torch" and case["config"] == {
                "topk": {"method": "topk", "block_size": 64, "topk": 8},
                "llsa": {"method": "llsa", "block_size": 16, "topk": 8}}[case["config"]["method"]]


def test_the_reference_check_catches_a_wrong_output(monkeypatch):
    build = measure.build_module

    class Off(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, q, k, v):
            return self.inner(q, k, v) * 1.001

        def load_state_dict(self, state_dict, *args, **kwargs):   # the reference's keys, unprefixed
            return self.inner.load_state_dict(state_dict, *args, **kwargs)

    monkeypatch.setattr(measure, "build_module", lambda config, backend, *a: (
        build(config, backend, *a) if backend == "reference" else Off(build(config, backend, *a))))
    case = {"kind": "method", "config": {"method": "llsa", "block_size": 16, "topk": 4}, "backend": "torch",
            "batch": 1, "heads": 2, "n": 300, "dim": 16, "dtype": "float32", "mode": "check", "device": "cpu"}
    assert measure.run_case(case)["max_error"] > 1e-4


def test_forward_backward_is_autograd_grad_with_a_given_gradient_and_fills_no_grad():
    case = {"kind": "method", "config": {"method": "sla", "block_size": 16, "topk_ratio": 0.25}, "backend": "torch",
            "batch": 1, "heads": 2, "n": 128, "dim": 16, "dtype": "float32", "device": "cpu"}
    module = measure.attend_of(case)
    assert any(p.requires_grad for p in module.parameters())
    q, k, v = (torch.randn(1, 2, 128, 16, requires_grad=True) for _ in range(3))
    grad_out = torch.randn(1, 2, 128, 16)
    grads = measure.forward_backward(module, q, k, v, grad_out)
    want = torch.autograd.grad((module(q, k, v) * grad_out).sum(), (q, k, v))
    for got, expected in zip(grads, want):
        torch.testing.assert_close(got, expected)
    assert all(x.grad is None for x in (q, k, v)) and all(p.grad is None for p in module.parameters())
    forward = measure.timed_call({**case, "mode": "fwd"})
    assert forward().grad_fn is None                          # the forward is timed under no_grad


def refuse_lengths(monkeypatch, method: str, lengths) -> None:
    """``method``'s selection raises a ValueError at the given lengths, as a config that does not fit them would."""
    select = fs.METHODS[method].select

    def refusing(q, *args, **kwargs):
        if q.shape[2] in lengths:
            raise ValueError(f"config does not fit N={q.shape[2]}")
        return select(q, *args, **kwargs)
    monkeypatch.setattr(fs.METHODS[method], "select", refusing)


def test_a_config_that_does_not_fit_a_size_is_skipped_and_reported(tmp_path, monkeypatch):
    refuse_lengths(monkeypatch, "topk", {256})
    status, printed = run_main(TINY + ["--methods", "topk", "llsa", "--sizes", "256", "--no-check",
                                       "--out", str(tmp_path)])
    assert status == 0
    assert "skipped: topk/torch N=256 fwd: config does not fit N=256" in printed
    with open(tmp_path / "results.json") as f:
        results = {r["case"]["label"]: r for r in json.load(f)["results"]}
    assert results["topk/torch N=256 fwd+bwd"]["status"] == "skipped"
    assert results["llsa/torch N=256 fwd+bwd"]["status"] == "ok"
    assert "no plot: it needs timings at 2 sizes or more, got N=[256]" in printed
    assert not (tmp_path / "timing.png").exists()


def test_a_size_that_no_case_fits_exits_non_zero_without_a_plot(tmp_path, monkeypatch):
    refuse_lengths(monkeypatch, "topk", {100, 200})
    status, printed = run_main(TINY + ["--methods", "topk", "--sizes", "100", "200", "--no-check",
                                       "--no-backward", "--out", str(tmp_path)])
    assert status == 1
    assert "no method case ran at N=[100, 200]" in printed and "config does not fit N=100" in printed
    assert not (tmp_path / "timing.png").exists()


def test_without_matplotlib_the_plot_is_skipped_with_a_message(demo, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)          # import matplotlib raises ImportError
    message = plot.plot_times(demo[2]["results"], str(tmp_path / "timing.png"), "title")
    assert message == "no plot: matplotlib is not installed (pip install matplotlib)"
    assert not (tmp_path / "timing.png").exists()


@pytest.mark.parametrize("argv, flag", [
    (["--device", "cuda"], "--device"),
    (["--sizes", "1024", "0"], "--sizes"),
    (["--batch", "-1"], "--batch"),
    (["--block-size", "0"], "--block-size"),
    (["--methods", "sla2", "--block-size", "32"], "--block-size"),
    (["--topk-ratio", "2"], "--topk-ratio"),
    (["--methods", "llsa", "nosuch"], "--methods"),
    (["--backends", "nosuch"], "--backends"),
    (["--device", "cpu", "--backends", "triton"], "--backends"),
    (["--device", "cpu", "--graph"], "--graph"),
    (["--compare", "no-such-ref-or-folder"], "--compare"),
    (["--tiles", "[1, 2]"], "--tiles"),
    (["--rounds", "3"], "--rounds"),
])
def test_unusable_arguments_are_argparse_errors_naming_the_argument(argv, flag, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"error: argument {flag}" in err


def test_block_size_topk_and_ratio_go_to_the_methods_whose_configs_take_them():
    parser = cli.build_parser()
    args = parser.parse_args(["--device", "cpu", "--methods", "topk", "llsa", "sla", "sla2", "--sizes", "4096",
                              "--block-size", "32", "--topk", "4", "--topk-ratio", "0.1", "--no-check"])
    run = cli.resolve(parser, args)
    configs = {c.config["method"]: c.config for c in run.cases if c.kind == "method"}
    assert configs["topk"] == {"method": "topk", "block_size": 32, "topk": 4}
    assert configs["llsa"] == {"method": "llsa", "block_size": 32, "topk": 4}
    assert configs["sla"] == {"method": "sla", "block_size": 32, "topk_ratio": 0.1}
    assert configs["sla2"] == {"method": "sla2", "block_q": 128, "block_k": 64, "topk_ratio": 0.1}
    assert "--block-size 32: taken by topk, llsa, sla; not by sla2 (no block_size in their configs)" in run.notes
    assert "--topk-ratio 0.1: taken by sla, sla2; not by topk, llsa (no topk_ratio in their configs)" in run.notes


def test_compare_against_a_path_copy_tabulates_both_trees_and_their_ratio(tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(os.path.join(ROOT, "flexsparse"), copy / "flexsparse",
                    ignore=shutil.ignore_patterns("__pycache__"))
    status, printed = run_main(TINY + ["--methods", "llsa", "--sizes", "256", "--no-backward", "--rounds", "1",
                                       "--compare", str(copy), "--out", str(tmp_path / "out")])
    assert status == 0
    lines = printed.splitlines()
    header = next(line for line in lines if line.startswith("case"))
    assert "tree ms (min-max)" in header and "ref ms (min-max)" in header and "ref / tree" in header
    row = next(line for line in lines if line.startswith("llsa/torch N=256 fwd"))
    with open(tmp_path / "out" / "compare.json") as f:
        report = json.load(f)
    assert report["versions"]["tree"]["flexsparse_path"] == ROOT          # each worker imported its own tree
    assert report["versions"]["ref"]["flexsparse_path"] == str(copy)
    result = next(r for r in report["results"] if r["case"]["label"] == "llsa/torch N=256 fwd")
    assert result["ratio"] == pytest.approx(result["ref"]["median_ms"] / result["tree"]["median_ms"])
    assert row.split()[-1] == f"{result['ratio']:.3f}"
    assert not any(r["case"]["mode"] == "check" for r in report["results"])


def test_compare_alternates_the_trees_and_keeps_each_cases_best_median(monkeypatch, tmp_path):
    calls, medians = [], {"tree": [[5.0, 3.0], [4.0, 9.0]], "ref": [[6.0, 2.0], [8.0, 1.0]]}

    def worker(root, cases, workdir, name, tiles):
        tree, r = name[:-1], int(name[-1])
        calls.append(tree)
        results = [{"case": c, "status": "ok", "min_ms": m, "median_ms": m, "max_ms": m, "times_ms": [m]}
                   for c, m in zip(cases, medians[tree][r])]
        return {"versions": {"flexsparse_path": root}, "results": results}

    monkeypatch.setattr(compare, "run_worker", worker)
    cases = [{"label": "a"}, {"label": "b"}]
    partial = []
    out = compare.compare(cases, {"tree": "/t", "ref": "/r"}, 2, str(tmp_path), None, partial.append)
    assert calls == ["tree", "ref", "ref", "tree"]
    assert [row["ratio"] for row in partial[0]["results"]] == [1.2, pytest.approx(2 / 3)]
    assert [(row["tree"]["median_ms"], row["ref"]["median_ms"]) for row in out["results"]] == [(4.0, 6.0),
                                                                                              (3.0, 1.0)]
    assert [row["ratio"] for row in out["results"]] == [1.5, pytest.approx(1 / 3)]


def test_compare_extracts_a_git_ref(tmp_path):
    if compare.resolve_ref("HEAD", ROOT) is None:
        pytest.skip("not a git checkout")
    commit = compare.resolve_ref("HEAD", ROOT)
    assert len(commit) == 40 and compare.resolve_ref("no-such-ref-xyz", ROOT) is None
    tree = compare.extract(commit, ROOT, str(tmp_path / "ref"))
    assert compare.is_tree(tree)
    shown = subprocess.run(["git", "-C", ROOT, "show", f"{commit}:flexsparse/__init__.py"], capture_output=True,
                           text=True, check=True).stdout
    with open(os.path.join(tree, "flexsparse", "__init__.py")) as f:
        assert f.read() == shown
