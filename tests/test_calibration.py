"""SLA2 two-stage training helpers (flexsparse.training): QKV recording hooks, stage-1 calibration of
the router and alpha, state_dict round trips of the fit, stage-2 freezing, the example script."""
import dataclasses
import io
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import flexsparse
from flexsparse.config import Config
from flexsparse.integration import SparseSDPA
from flexsparse.backends import BACKENDS
from flexsparse.methods.dense import expand_kv_heads, span_means
from flexsparse.methods.sla2.router import route, standardize_rows
from flexsparse.methods.sla2.softtopk import soft_topk
from flexsparse.training import QKVRecorder, calibrate_sla2, prepare_stage2, select_layers

from _sla_testing import assert_all_close, leaf_params, leaf_qkv, run
from stand_ins import TinyModel

pytestmark = pytest.mark.usefixtures("single_thread")
ROOT = Path(__file__).resolve().parents[1]
B, H, N, D, BQ, BK = 1, 2, 256, 16, 16, 8          # 16 query blocks, 32 key blocks
RATIO = 0.125                                       # 4 key blocks per query block
SLA2 = {"method": "sla2", "block_q": BQ, "block_k": BK, "topk_ratio": RATIO}


def sla2_layer(**changes) -> flexsparse.SparseAttention:
    return flexsparse.SparseAttention({**SLA2, **changes}, head_dim=D, num_heads=H, seq_len=N, backend="torch")


def spiky_qkv(batch: int = B):
    """Structured inputs that the identity (pooled-mean) router gets wrong and a learned one can fix.

    A quarter of the key blocks are "spiky": large per-token values in dims 8-13 (block mean ~0), so
    they hold most of the attention mass while their mean logit, all the pooled router sees, is
    ordinary. Dim 14 of k marks them (+1, others -1) but q_14 = 0, so attention ignores it; q_15 = 1
    and k_15 = 0, so a router with proj_q mapping dim 15 onto dim 14 ranks the spiky blocks first.
    Dims 0-7: clustered keys and block-constant queries (an ordinary, weaker signal).
    """
    tk, tq = N // BK, N // BQ
    q, k = torch.zeros(batch, H, N, D), torch.zeros(batch, H, N, D)
    k[..., :8] = torch.randn(batch, H, tk, 8).repeat_interleave(BK, 2) + 0.3 * torch.randn(batch, H, N, 8)
    q[..., :8] = torch.randn(batch, H, tq, 8).repeat_interleave(BQ, 2)
    spiky = (torch.rand(batch, H, tk).argsort(-1) < tk // 4).repeat_interleave(BK, 2)
    k[..., 8:14] = 3 * torch.randn(batch, H, N, 6) * spiky[..., None]
    q[..., 8:14] = torch.randn(batch, H, N, 6)
    k[..., 14] = torch.where(spiky, 1.0, -1.0)
    q[..., 15] = 1.0
    return q, k, torch.randn(batch, H, N, D)


def recorded_toy(calls: int = 2):
    model = nn.ModuleDict({"attn": sla2_layer()})
    with QKVRecorder(model, max_batches=calls) as recorder, torch.no_grad():
        for _ in range(calls):
            model["attn"](*spiky_qkv())
    return model, recorder


def hard_mse(layer, recorder, params) -> float:
    cfg = dataclasses.replace(layer.config, router="hard")
    return sum(F.mse_loss(flexsparse.attention(r.q, r.k, r.v, cfg, backend="torch", params=params),
                          F.scaled_dot_product_attention(r.q, r.k, r.v)).item()
               for r in recorder.records["attn"]) / len(recorder.records["attn"])


# ----------------------------------------------------------------------------------- standardized SoftTop-k

def test_softtopk_standardize_mask_and_torch_matches_reference():
    """M = SoftTop-k of the raw projected pooled scores standardized per row; torch = fp64 reference
    (outputs, LSE, gradients of q, k, v, router and alpha); the hard top-k is that of the raw scores."""
    cfg = Config.from_dict({**SLA2, "block_q": 8, "block_k": 4, "topk_ratio": 0.25, "router": "soft",
                            "softtopk_standardize": True, "smooth_k": "router"})
    q, k, v = leaf_qkv(2, 2, 1, 70, 8)
    params = leaf_params(flexsparse.METHODS["sla2"].init_params(cfg, 8, 2, 70))
    mask = route(q.detach(), k.detach(), cfg, BACKENDS["torch"], params["proj_q"], params["proj_k"])
    kk = expand_kv_heads(k.detach(), 2)
    raw = (span_means(q.detach(), 8) @ params["proj_q"].T) @ (
        span_means(kk - kk.mean(2, keepdim=True), 4) @ params["proj_k"].T).mT / math.sqrt(8)
    standardized = (raw - raw.mean(-1, keepdim=True)) / raw.std(-1, unbiased=False, keepdim=True)
    torch.testing.assert_close(standardize_rows(raw), standardized)
    torch.testing.assert_close(torch.sigmoid(mask.logits), soft_topk(standardized, 4, cfg.tau, 30), rtol=1e-10,
                               atol=1e-10)
    hard = route(q.detach(), k.detach(), dataclasses.replace(cfg, router="hard"), BACKENDS["torch"],
                 params["proj_q"], params["proj_k"])
    assert torch.equal(hard.indices.long().sort(-1).values, standardized.topk(4, -1).indices.sort(-1).values)
    assert_all_close(run(q, k, v, cfg, params, "torch"), run(q, k, v, cfg, params, "reference"), 1e-9, 1e-9)
    assert torch.equal(standardize_rows(torch.ones(2, 5)), torch.zeros(2, 5)), "a constant row gives zeros"


# ----------------------------------------------------------------------------------- calibration

def test_calibration_reduces_the_hard_mse_and_the_router_learns():
    model, recorder = recorded_toy()
    result = calibrate_sla2(recorder, [RATIO], steps=80, lr=5e-2, progress=False)
    (row,) = result.rows
    assert (row.layer, row.topk_ratio, row.kept, row.key_blocks) == ("attn", RATIO, 4, 32)
    assert row.soft_after < 0.6 * row.soft_before
    assert row.hard_after < 0.6 * row.hard_before, row        # what stage 2 and inference run
    fitted = result.params[RATIO]["attn"]
    assert row.hard_before == pytest.approx(hard_mse(model["attn"], recorder, dict(model["attn"].params.items())),
                                            rel=1e-5)
    assert row.hard_after == pytest.approx(hard_mse(model["attn"], recorder, fitted), rel=1e-5)
    # the router, not only alpha: the fitted alpha with the identity router is clearly worse
    identity_router = {**fitted, "proj_q": torch.eye(D), "proj_k": torch.eye(D)}
    assert row.hard_after < 0.85 * hard_mse(model["attn"], recorder, identity_router)
    # the router's scores are q proj_q^T proj_k k^T: its bilinear form should pair q's constant dim 15 with the
    # spiky-block marker k_14 (0 at the start; 3.2 to 11.7 over 145 fresh draws)
    bilinear = fitted["proj_q"].T @ fitted["proj_k"]
    assert bilinear[15, 14] > 1.5, "the router should map q's constant dim onto the spiky-block marker"
    assert torch.equal(model["attn"].params["proj_q"].detach(), torch.eye(D)), "calibration leaves the layer alone"
    table = result.table()
    assert "attn" in table and "MSE hard before" in table and "%" in table


def test_joint_calls_are_recorded_and_calibrated_as_joint_calls():
    """A layer called with padded text tokens before its visual ones (``joint=``): the records keep the call's
    ``Joint`` with its mask, and calibration runs each as the layer does, the method on the visual tokens only (its
    rows count their blocks), the text attended densely without its padding, against full attention without it; the
    hard MSE it reports is that of the joint call."""
    text = 24
    model = nn.ModuleDict({"attn": sla2_layer()})
    joint = flexsparse.Joint("prefix", text, torch.arange(text).expand(B, text) < 16)     # 8 padding text tokens
    with QKVRecorder(model, max_batches=2) as recorder, torch.no_grad():
        for _ in range(2):
            words = [torch.randn(B, H, text, D) for _ in range(3)]
            model["attn"](*(torch.cat([w, x], 2) for w, x in zip(words, spiky_qkv())), joint=joint)
    assert [(r.joint, r.visual_keys) for r in recorder.records["attn"]] == [(joint, N)] * 2
    assert all(torch.equal(r.joint.mask, joint.mask) for r in recorder.records["attn"])
    (row,) = calibrate_sla2(recorder, [RATIO], steps=40, lr=5e-2, progress=False).rows
    assert (row.kept, row.key_blocks) == (4, 32)
    cfg = dataclasses.replace(model["attn"].config, router="hard")
    params = dict(model["attn"].params.items())
    keys = torch.cat([joint.mask, torch.ones(B, N, dtype=torch.bool)], dim=1)[:, None, None, :]
    by_hand = sum(F.mse_loss(flexsparse.attention(r.q, r.k, r.v, cfg, backend="torch", params=params, joint=joint),
                             F.scaled_dot_product_attention(r.q, r.k, r.v, attn_mask=keys)).item()
                  for r in recorder.records["attn"]) / 2
    assert row.hard_before == pytest.approx(by_hand, rel=1e-5)
    assert row.hard_after < row.hard_before


def test_literal_softmax_score_objective_collapses_to_the_dense_point():
    """Why calibrate_sla2 standardizes the router scores: on the softmaxed scores SoftTop-k is nearly
    uniform, and uniform M with alpha -> 1 is full attention, so the soft MSE collapses while the hard
    MSE does not improve."""
    _, recorder = recorded_toy()
    standardized = calibrate_sla2(recorder, [RATIO], steps=40, lr=5e-2, progress=False).rows[0]
    literal = calibrate_sla2(recorder, [RATIO], steps=40, lr=5e-2, standardize=False, progress=False).rows[0]
    assert literal.soft_after < 0.1 * literal.soft_before
    assert literal.hard_after > 1.5 * standardized.hard_after


def test_one_fit_per_ratio_or_one_joint_fit():
    _, recorder = recorded_toy(calls=1)
    separate = calibrate_sla2(recorder, (0.25, RATIO), steps=3, progress=False)
    joint = calibrate_sla2(recorder, (0.25, RATIO), steps=3, joint=True, progress=False)
    assert [(r.topk_ratio, r.kept) for r in separate.rows] == [(0.25, 8), (RATIO, 4)]
    a, b = (separate.params[r]["attn"]["alpha_logit"] for r in (0.25, RATIO))
    assert not torch.equal(a, b)
    for name in ("proj_q", "proj_k", "alpha_logit"):
        assert torch.equal(joint.params[0.25]["attn"][name], joint.params[RATIO]["attn"][name])
    assert [r.topk_ratio for r in joint.rows] == [0.25, RATIO] and joint.joint


def test_calibration_errors():
    model = nn.ModuleDict({"attn": sla2_layer()})
    recorder = QKVRecorder(model)
    with pytest.raises(ValueError, match="no recorded call for layers \\['attn'\\]"):
        calibrate_sla2(recorder, progress=False)
    with recorder, torch.no_grad():
        model["attn"](*spiky_qkv())
    for ratios, match in (([0.0], "topk_ratios"), ([1.5], "topk_ratios"), ([0.1, 0.1], "repeated"), ([], "at least")):
        with pytest.raises(ValueError, match=match):
            calibrate_sla2(recorder, ratios, progress=False)
    with pytest.raises(ValueError, match="steps"):
        calibrate_sla2(recorder, steps=-1, progress=False)
    other = nn.ModuleDict({"attn": flexsparse.SparseAttention({"method": "sla", "block_size": 16}, head_dim=D,
                                                              num_heads=H, backend="torch")})
    with QKVRecorder(other, layers="attn") as rec, torch.no_grad():
        other["attn"](*spiky_qkv())
    with pytest.raises(ValueError, match="method 'sla2'.*'attn': 'sla'"):
        calibrate_sla2(rec, progress=False)


# ----------------------------------------------------------------------------------- recording

def test_recorder_stores_the_inputs_caps_calls_and_runs_dense():
    model = nn.ModuleDict({"a": sla2_layer(), "b": sla2_layer(), "c": flexsparse.SparseAttention(
        {"method": "topk", "block_size": 16, "topk": 2}, head_dim=D, num_heads=H, backend="torch")})
    calls = [spiky_qkv(2) for _ in range(3)]
    gqa = (torch.randn(2, H, N, D), torch.randn(2, 1, N, D), torch.randn(2, 1, N, D))
    sparse_out = model["a"](*calls[0])
    with QKVRecorder(model, max_batches=2, device="cpu") as recorder:
        assert set(recorder.layers) == {"a", "b"}, "default: every sla2 SparseAttention"
        outs = [model["a"](q, k, v, scale=0.3) for q, k, v in calls]
        model["b"](*gqa)
        model["c"](*calls[0])
    assert recorder.calls == {"a": 3, "b": 1} and [len(recorder.records[n]) for n in "ab"] == [2, 1]
    for record, (q, k, v) in zip(recorder.records["a"], calls):
        assert torch.equal(record.q, q) and torch.equal(record.k, k) and torch.equal(record.v, v)
        assert record.scale == 0.3 and record.q.data_ptr() != q.data_ptr()
    gqa_record = recorder.records["b"][0]
    assert [tuple(x.shape) for x in (gqa_record.q, gqa_record.k, gqa_record.v)] == [(2, H, N, D), (2, 1, N, D),
                                                                                       (2, 1, N, D)]
    assert gqa_record.scale is None
    stored = [x for rs in recorder.records.values() for r in rs for x in (r.q, r.k, r.v)]
    assert recorder.nbytes == sum(x.numel() * 4 for x in stored)
    for out, (q, k, v) in zip(outs, calls):                    # dense while recording
        torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, scale=0.3))
    torch.testing.assert_close(model["a"](*calls[0]), sparse_out)  # hooks removed on exit
    assert (sparse_out - F.scaled_dot_product_attention(*calls[0])).abs().max() > 1e-2

    with QKVRecorder(model, layers="a", dense=False) as recorder:
        torch.testing.assert_close(model["a"](*calls[0]), sparse_out)
    assert list(recorder.records) == ["a"]


def test_layer_selection_on_a_patched_model():
    model = TinyModel("timm", depth=3)
    flexsparse.patch(model, {**SLA2, "block_q": 16, "block_k": 16}, seq_len=64, overrides={"0": "full"},
                    backend="torch")
    names = list(select_layers(model))
    assert names == ["blocks.1.attn.flexsparse.attention", "blocks.2.attn.flexsparse.attention"]
    assert list(select_layers(model, "blocks.2.attn")) == names[1:]            # a parent's name
    assert list(select_layers(model, ["*.2.*"])) == names[1:]
    assert list(select_layers(model, lambda name, m: name.startswith("blocks.1"))) == names[:1]
    with pytest.raises(ValueError, match="matches no SparseAttention.*blocks.1.attn.flexsparse.attention"):
        select_layers(model, "blocks.0.attn")
    with pytest.raises(TypeError, match="layers must be"):
        select_layers(model, [3])
    with pytest.raises(ValueError, match="no flexsparse.SparseAttention"):
        select_layers(nn.Linear(2, 2))
    with QKVRecorder(model, max_batches=1) as recorder, torch.no_grad():
        model(torch.randn(2, 64, 32))
        model(torch.randn(2, 64, 32))
    assert recorder.calls == dict.fromkeys(names, 2)
    assert all(tuple(recorder.records[n][0].q.shape) == (2, 2, 64, 16) for n in names)
    with pytest.raises(ValueError, match="max_batches"):
        QKVRecorder(model, max_batches=0)


# ----------------------------------------------------------------------------------- loading the fit

def test_fit_loads_into_the_layers_and_survives_a_state_dict_round_trip():
    model, recorder = recorded_toy(calls=1)
    result = calibrate_sla2(recorder, (0.25, RATIO), steps=5, lr=5e-2, progress=False)
    result.apply(model, RATIO)
    layer = model["attn"]
    for name, value in result.params[RATIO]["attn"].items():
        assert torch.equal(layer.params[name].detach(), value)
    assert not torch.equal(layer.params["proj_q"].detach(), torch.eye(D))
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    fresh = nn.ModuleDict({"attn": sla2_layer(topk_ratio=RATIO)})
    fresh.load_state_dict(torch.load(io.BytesIO(buffer.getvalue())))
    q, k, v = spiky_qkv()
    torch.testing.assert_close(fresh["attn"](q, k, v), layer(q, k, v), rtol=0, atol=0)

    other = nn.ModuleDict({"attn": sla2_layer(topk_ratio=0.25)})
    missing, unexpected = other.load_state_dict(result.state_dict(0.25), strict=False)
    assert missing == ["attn.config"] and not unexpected, "the fit holds parameters only, no config entry"
    assert torch.equal(other["attn"].params["alpha_logit"].detach(), result.params[0.25]["attn"]["alpha_logit"])
    with pytest.raises(ValueError, match="no calibration for topk_ratio=0.3"):
        result.apply(model, 0.3)


def test_apply_sets_the_ratio_on_a_patched_model():
    model = TinyModel("timm", depth=1)
    flexsparse.patch(model, {**SLA2, "block_q": 16, "block_k": 16, "topk_ratio": 0.5}, seq_len=64,
                    backend="torch")
    with QKVRecorder(model, max_batches=1) as recorder, torch.no_grad():
        model(torch.randn(2, 64, 32))
    calibrate_sla2(recorder, [0.25], steps=2, progress=False).apply(model, 0.25)
    site = model.blocks[0].attn.flexsparse
    assert isinstance(site, SparseSDPA)
    assert site.attention.config.topk_ratio == 0.25 and site.config.topk_ratio == 0.25


# ----------------------------------------------------------------------------------- stage 2

def test_stage2_freezes_the_router_and_trains_alpha():
    model = TinyModel("timm", depth=2)
    flexsparse.patch(model, {**SLA2, "block_q": 16, "block_k": 16, "topk_ratio": 0.25, "router": "soft"}, seq_len=64,
                    backend="torch")
    layers = select_layers(model)
    groups = prepare_stage2(model)
    assert [g["name"] for g in groups] == ["model", "alpha"]
    alphas = [m.params["alpha_logit"] for m in layers.values()]
    assert [id(p) for p in groups[1]["params"]] == [id(p) for p in alphas]
    router = {id(m.params[n]) for m in layers.values() for n in ("proj_q", "proj_k")}
    assert not router & {id(p) for p in groups[0]["params"]} and not {id(p) for p in alphas} & {
        id(p) for p in groups[0]["params"]}
    assert len(groups[0]["params"]) == len(list(model.parameters())) - 3 * len(layers)
    for name, module in layers.items():
        assert module.config.router == "hard"
        assert model.get_submodule(name.rpartition(".")[0]).config.router == "hard"
    optimizer = torch.optim.AdamW(groups, lr=1e-3)
    model(torch.randn(2, 64, 32)).square().mean().backward()
    for module in layers.values():
        assert module.params["proj_q"].grad is None and module.params["proj_k"].grad is None
        assert module.params["alpha_logit"].grad is not None and module.params["alpha_logit"].grad.abs().max() > 0
    optimizer.step()

    model.zero_grad(set_to_none=True)
    groups = prepare_stage2(model, trainable="none")
    assert [g["name"] for g in groups] == ["model"]
    model(torch.randn(2, 64, 32)).square().mean().backward()
    assert all(m.params["alpha_logit"].grad is None for m in layers.values())

    model.zero_grad(set_to_none=True)
    groups = prepare_stage2(model, trainable="all", router="soft")
    assert [g["name"] for g in groups] == ["model", "alpha", "router"]
    model(torch.randn(2, 64, 32)).square().mean().backward()
    assert all(m.params["proj_q"].grad is not None for m in layers.values())
    with pytest.raises(ValueError, match="hard top-k passes it no gradient"):
        prepare_stage2(model, trainable="all")
    with pytest.raises(ValueError, match="trainable must be one of"):
        prepare_stage2(model, trainable="router")


# ----------------------------------------------------------------------------------- the example

def test_two_stage_example_runs_tiny(tmp_path):
    images = tmp_path / "images"
    images.mkdir()
    rng = np.random.default_rng(0)
    from PIL import Image
    for i in range(3):
        ramp = np.linspace(0, 255, 40)[None, :, None] * np.array([1.0, 0.5, 0.2]) * (i + 1) / 3
        Image.fromarray(np.clip(ramp + rng.normal(0, 20, (36, 40, 3)), 0, 255).astype(np.uint8)).save(
            images / f"{i}.png")
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "examples.sla2_two_stage", "--tiny", "--quiet", "--data-dir",
                           str(images), "--pretrain-steps", "3", "--calib-steps", "4", "--steps", "3",
                           "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "stage 1: MSE against full attention" in proc.stdout and "blocks.1.attn.attention" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["val_loss"]) == {"dense", "sla2 uncalibrated", "sla2 calibrated", "sla2 after stage 2"}
    assert all(math.isfinite(x) for x in summary["val_loss"].values())
    assert len(summary["calibration"]) == 4 and summary["deploy_ratio"] == 0.1       # 2 layers x 2 ratios
    assert len(json.loads((out / "history.json").read_text())["stage2_loss"]) == 3
    assert (out / "calibration.txt").is_file() and (out / "loss.png").is_file()


@pytest.mark.gpu
@pytest.mark.long
def test_two_stage_example_on_gpu_bf16_flex(tmp_path):
    """4096 pixel tokens, 128x64 blocks, bf16 autocast: records in bf16 kept on the host, calibration in
    fp32 on the GPU, hard-router evaluation and stage 2 on the flex backend."""
    sys.path.insert(0, str(ROOT))
    from examples import sla2_two_stage

    summary = sla2_two_stage.main(["--image-size", "64", "--hidden", "384", "--heads", "6", "--depth", "4",
                                   "--pretrain-steps", "50", "--calib-batches", "2", "--calib-steps", "50",
                                   "--steps", "10", "--batch-size", "4", "--val-crops", "8", "--record-on-cpu",
                                   "--quiet", "--out", str(tmp_path)])
    rows = summary["calibration"]
    assert len(rows) == 4 * 3 and {r["key_blocks"] for r in rows} == {64}
    assert sum(r["hard_after"] for r in rows) < 0.9 * sum(r["hard_before"] for r in rows), rows
    assert all(math.isfinite(x) for x in summary["val_loss"].values())
