"""The DiT example (examples/dit) on CPU at a tiny size: llsa and full training, a progressive resume
at a larger size, a continued run, the outputs it writes, the data loaders and the study smoke test."""
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.dit import compare_runs, data, record_qkv, study, train  # noqa: E402
from examples.dit.model import DiT  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread")
TINY = ["--hidden", "32", "--heads", "2", "--depth", "2", "--batch-size", "2", "--val-crops", "2", "--samples", "2",
        "--sample-steps", "2", "--backend", "torch", "--quiet"]
LLSA = '{"method": "llsa", "block_size": 4, "topk": 2}'


@pytest.fixture(scope="module")
def image_dir(tmp_path_factory):
    """Three small RGB images (smooth gradients plus noise) as a user's image folder."""
    folder = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    for i, (h, w) in enumerate([(40, 48), (36, 60), (50, 34)]):
        ramp = np.linspace(0, 255, w)[None, :, None] * np.array([1.0, 0.5, 0.2])[None, None] * (i + 1) / 3
        pixels = np.clip(ramp + rng.normal(0, 20, (h, w, 3)), 0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(folder / f"image_{i}.png")
    return folder


def run(tmp_path, name, image_dir, *extra):
    out = tmp_path / name
    summary = train.main(["--out", str(out), "--data-dir", str(image_dir), *TINY, *extra])
    for path in ("config.json", "history.json", "loss.png", "summary.json", "checkpoints/last.pt", "samples/final.png"):
        assert (out / path).is_file(), f"{name}: {path} missing"
    assert math.isfinite(summary["final_val_loss"]) and math.isfinite(summary["final_val_loss_ema"])
    history = json.loads((out / "history.json").read_text())
    assert all(math.isfinite(x) for x in history["train_loss"])
    return out, summary, history


def test_train_full_and_llsa_then_resume_larger_and_continue(tmp_path, image_dir):
    common = ["--image-size", "16", "--steps", "3", "--val-every", "3", "--sample-every", "2"]
    full, summary, _ = run(tmp_path, "full", image_dir, *common, "--attn", "full")
    assert (full / "samples" / "step_000002.png").is_file() and summary["steps"] == 3
    run(tmp_path, "llsa", image_dir, *common, "--attn", LLSA)

    ckpt = str(full / "checkpoints" / "last.pt")
    big, summary, history = run(tmp_path, "llsa32", image_dir, "--image-size", "32", "--steps", "2", "--attn", LLSA,
                                "--resume", ckpt)
    config = json.loads((big / "config.json").read_text())
    assert (config["image_size"], config["rope_size"], config["noise_scale"]) == (32, 16, 0.5)
    assert config["init_from"] == ckpt
    assert summary["steps"] == 2 and history["val_step"][0] == 0, "a new stage starts at step 0 with a validation"

    _, summary, history = run(tmp_path, "llsa32", image_dir, "--image-size", "32", "--steps", "3", "--attn", LLSA,
                              "--resume", str(big / "checkpoints" / "last.pt"))
    assert summary["steps"] == 3 and history["train_step"] == [1, 2, 3], "same size and attention continue the run"


def test_fp8_linear_layers_and_fp8_attention_train_on_cpu(tmp_path, image_dir, monkeypatch):
    pytest.importorskip("torchao")
    sla = '{"method": "sla", "block_size": 4, "topk_ratio": 0.25, "quant": {"qk_dtype": "int8"}}'
    out, _, _ = run(tmp_path, "fp8", image_dir, "--image-size", "16", "--steps", "2", "--attn", sla, "--fp8-linear")
    config = json.loads((out / "config.json").read_text())
    assert config["fp8_linear"] and config["attn"]["quant"]["qk_dtype"] == "int8"
    linears = {name: type(m).__name__ for name, m in train.build_model(config, "cpu").named_modules()
               if isinstance(m, torch.nn.Linear)}
    per_token = {name for name in linears if name.endswith((".qkv", ".proj")) or ".mlp." in name}
    assert per_token and all((kind == "Float8Linear") == (name in per_token) for name, kind in linears.items()), \
        linears   # 3-channel in/out and the per-sample conditioning layers (t_embed, adaLN) stay
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(ImportError, match=r"--fp8-linear needs torchao"):
        train.float8_linear_layers(DiT(16, {"method": "full"}, hidden=32, heads=2, depth=1), "cpu")


def test_recorded_qkv_feed_the_fp8_benchmark(tmp_path, image_dir):
    """A trained layer's q, k, v on held-out crops, then benchmarks/gpu_fp8.py's FP8 error on them (CPU)."""
    pytest.importorskip("torchao")
    import importlib.util
    sla = '{"method": "sla", "block_size": 4, "topk_ratio": 0.25}'
    out, _, _ = run(tmp_path, "sla", image_dir, "--image-size", "16", "--steps", "2", "--attn", sla)
    path = tmp_path / "qkv.pt"
    saved = record_qkv.main([str(out / "checkpoints" / "last.pt"), "--layer", "1", "--crops", "3", "--out", str(path),
                             "--device", "cpu"])
    assert saved["layer"] == "blocks.1.attn.attention" and saved["config"]["attn"]["method"] == "sla"
    assert saved["q"].shape == (3, 2, 256, 16) and saved["v"].shape == (3, 2, 256, 16)
    assert all(saved[name].std() > 0.1 for name in ("q", "k", "v"))
    with pytest.raises(ValueError, match="--layer"):
        record_qkv.record(str(out / "checkpoints" / "last.pt"), 2, 1, torch.device("cpu"))
    spec = importlib.util.spec_from_file_location("gpu_fp8", Path(__file__).resolve().parents[1] / "benchmarks" /
                                                  "gpu_fp8.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    report = bench.main(["--device", "cpu", "--qkv", str(path), "--topk-ratio", "0.25", "--variants", "fp8",
                         "--no-backward"])
    assert report["shape"] == [3, 2, 256, 16] and 0 < report["results"]["fp8"]["rel_l2_branch"] < 0.1


def test_fixture_rebuilds_the_recorded_qkv(tmp_path, image_dir):
    """``--fixture`` keeps the blocks up to the layer (bf16) with the crops; ``fixture_qkv`` records the same q, k, v
    as ``record`` on the whole checkpoint, up to the bf16 rounding of the weights and inputs."""
    sla = '{"method": "sla", "block_size": 4, "topk_ratio": 0.25}'
    out, _, _ = run(tmp_path, "sla", image_dir, "--image-size", "16", "--steps", "2", "--attn", sla)
    checkpoint, path = str(out / "checkpoints" / "last.pt"), tmp_path / "fixture.pt"
    saved = record_qkv.main([checkpoint, "--layer", "0", "--crops", "2", "--fixture", "--out", str(path)])
    assert saved["config"]["depth"] == 1 and not any(name.startswith("blocks.1.") for name in saved["ema"])
    assert all(value.dtype == torch.bfloat16 for value in saved["ema"].values())
    rebuilt = record_qkv.fixture_qkv(path, torch.device("cpu"))
    recorded = record_qkv.record(checkpoint, 0, 2, torch.device("cpu"))
    assert rebuilt["layer"] == recorded["layer"] == "blocks.0.attn.attention"
    for name in ("q", "k", "v"):
        assert rebuilt[name].shape == recorded[name].shape == (2, 2, 256, 16)
        assert (rebuilt[name] - recorded[name]).norm() / recorded[name].norm() < 0.02
    with pytest.raises(ValueError, match="--fixture needs --layer"):
        record_qkv.main([checkpoint, "--fixture", "--out", str(path)])
    with pytest.raises(ValueError, match="--layer must be in"):
        record_qkv.fixture(checkpoint, 2, 1)


def test_resume_checks_the_architecture(tmp_path, image_dir):
    out, _, _ = run(tmp_path, "full", image_dir, "--image-size", "16", "--steps", "1", "--attn", "full")
    with pytest.raises(ValueError, match="--hidden=64 differs from the checkpoint's 32"):
        train.main(["--resume", str(out / "checkpoints" / "last.pt"), *TINY[2:], "--hidden", "64", "--out",
                    str(tmp_path / "x"), "--data-dir", str(image_dir)])


def test_new_sparse_parameters_start_fresh_when_loading_dense_weights():
    dense = DiT(16, {"method": "full"}, hidden=32, heads=2, depth=2)
    gated = DiT(16, {"method": "vsa", "block_size": 16, "topk": 2, "gate": True}, hidden=32, heads=2, depth=2)
    fresh = train.load_weights(gated, dense.state_dict())
    assert fresh == [f"blocks.{i}.attn.attention.params.{p}" for i in range(2) for p in ("gate_bias", "gate_weight")]
    assert torch.equal(gated.embed.weight, dense.embed.weight)
    with pytest.raises(ValueError, match="does not fit"):
        train.load_weights(DiT(16, {"method": "full"}, hidden=32, heads=2, depth=1), dense.state_dict())


def test_model_orders_tokens_and_sparse_attention_with_all_blocks_equals_full():
    x, t = torch.randn(2, 3, 16, 16), torch.tensor([10.0, 900.0])
    torch.manual_seed(0)
    full = DiT(16, {"method": "full"}, hidden=32, heads=2, depth=2, rope_size=8)
    torch.manual_seed(0)
    topk = DiT(16, {"method": "topk", "block_size": 16, "topk": 16}, hidden=32, heads=2, depth=2, rope_size=8)
    for model in (full, topk):
        for p in model.parameters():          # adaLN-Zero starts at zero: perturb so the test sees attention
            torch.nn.init.normal_(p, std=0.1, generator=torch.Generator().manual_seed(p.numel()))
    torch.testing.assert_close(topk(x, t), full(x, t), atol=1e-5, rtol=1e-4)
    assert torch.equal(full.perm[full.inverse], torch.arange(256))
    with pytest.raises(ValueError, match="built for 16x16"):
        full(torch.randn(1, 3, 8, 8), t[:1])


def test_bundled_photographs_and_crops():
    if not any(__import__("importlib").util.find_spec(p) for p in data.BUNDLED):
        pytest.skip("neither scikit-image nor scikit-learn is installed")
    photos = data.bundled_photos()
    assert len(photos) >= 2 and all(p.dtype == torch.uint8 and p.shape[0] == 3 for p in photos.values())
    train_images, held_out = data.photos_and_split(None)
    assert len(train_images) + len(held_out) == len(photos) and held_out
    crops = data.random_crops(train_images, 64, 3, torch.Generator().manual_seed(0))
    assert crops.shape == (3, 3, 64, 64) and crops.min() >= -1 and crops.max() <= 1


def test_folder_loader_needs_two_images(tmp_path, image_dir):
    assert len(data.folder_images(image_dir)) == 3
    with pytest.raises(ValueError, match="at least 2 images"):
        data.folder_images(tmp_path)
    with pytest.raises(FileNotFoundError, match="--data-dir"):
        data.folder_images(tmp_path / "missing")


def test_study_smoke(tmp_path, image_dir):
    results = study.main(["--tiny", "--methods", "full", "llsa", "--throughput-steps", "1", "--backend", "torch",
                          "--out", str(tmp_path), "--data-dir", str(image_dir)])
    assert set(results) == {"full", "llsa"} and not any("error" in r for r in results.values())
    assert all(isinstance(v, float) for r in results.values() for v in r["throughput"].values())
    for path in ("study.json", "val_loss.png", "throughput.png", "samples_full.png", "samples_llsa.png"):
        assert (tmp_path / path).is_file()


def test_study_runs_merge_into_one_study(tmp_path, image_dir):
    """A study in several commands: training without throughput, then throughput only (--steps 0)."""
    common = ["--tiny", "--backend", "torch", "--out", str(tmp_path), "--data-dir", str(image_dir)]
    study.main([*common, "--methods", "full", "--throughput-sizes"])
    trained = json.loads((tmp_path / "study.json").read_text())["methods"]["full"]
    assert "throughput" not in trained and trained["val_loss"]
    results = study.main([*common, "--methods", "full", "llsa", "--steps", "0", "--throughput-steps", "1"])
    assert results["full"]["val_loss"] == trained["val_loss"] and "val_loss" not in results["llsa"]
    assert all(isinstance(v, float) for r in results.values() for v in r["throughput"].values())
    assert json.loads((tmp_path / "study.json").read_text())["methods"].keys() == {"full", "llsa"}


def test_compare_runs_reads_studies_and_histories(tmp_path):
    curves = {"val_step": [0, 10, 20], "val_loss": [1.0, 0.5, 0.4], "val_loss_ema": [1.0, 0.8, 0.6]}
    (tmp_path / "study.json").write_text(json.dumps({"methods": {"sla": curves}}))
    (tmp_path / "history.json").write_text(json.dumps({**curves, "val_loss": [1.0, 0.6, 0.44]}))
    runs = [compare_runs.load_curves(f"a={tmp_path / 'study.json'}:sla"),
            compare_runs.load_curves(f"b={tmp_path / 'history.json'}")]
    rows = compare_runs.summary(runs, tail=2)
    assert rows[0]["val_loss last"] == 0.4 and rows[0]["val_loss mean of last 2"] == pytest.approx(0.45)
    assert rows[1]["val_loss last vs a %"] == pytest.approx(10.0)
    assert rows[1]["val_loss_ema last vs a %"] == pytest.approx(0.0)
    compare_runs.plot(runs, tmp_path / "curves.png", "t")
    assert (tmp_path / "curves.png").stat().st_size > 0
    with pytest.raises(ValueError, match="not 'vsa'"):
        compare_runs.load_curves(f"a={tmp_path / 'study.json'}:vsa")


@pytest.mark.gpu
@pytest.mark.long
def test_full_size_dit_on_gpu_with_compile_and_progressive_resume(tmp_path):
    """DiT-S (hidden 384, 12 blocks): 64x64 full attention, then 128x128 LLSA from that checkpoint."""
    common = ["--batch-size", "4", "--val-crops", "8", "--samples", "4", "--sample-steps", "4", "--checkpointing",
              "--compile", "--quiet"]
    small = train.main(["--image-size", "64", "--steps", "3", "--attn", "full", "--out", str(tmp_path / "s64"),
                        *common])
    llsa = '{"method": "llsa", "block_size": 16, "topk": 8}'
    big = train.main(["--image-size", "128", "--steps", "3", "--attn", llsa, "--resume", small["checkpoint"],
                      "--out", str(tmp_path / "s128"), *common])
    assert math.isfinite(big["final_val_loss"]) and big["tokens_per_s"] > 0


@pytest.mark.gpu
def test_fp8_linear_and_fp8_attention_train_compiled_on_gpu(tmp_path):
    """DiT-S width, 2 blocks, 64x64: FP8 nn.Linear layers (torchao) and FP8 QAT of SLA's sparse branch."""
    pytest.importorskip("torchao")
    sla = '{"method": "sla", "block_size": 64, "topk_ratio": 0.25, "quant": {"qk_dtype": "int8"}}'
    summary = train.main(["--image-size", "64", "--steps", "3", "--depth", "2", "--attn", sla, "--fp8-linear",
                          "--compile", "--batch-size", "4", "--val-crops", "4", "--samples", "4", "--sample-steps", "2",
                          "--quiet", "--out", str(tmp_path / "fp8")])
    assert math.isfinite(summary["final_val_loss"]) and summary["tokens_per_s"] > 0
