"""flexsparse.patch on timm's vision transformers (when timm is installed): ViT with a class token, DeiT with class
and distillation tokens, EVA02 with rotary embeddings, a ViT with register tokens and no class token. Tiny random
models, fp64, backend torch.

Every attention module is patched; ``"full"`` is the original model exactly; a top-K over every visual block equals
it to fp64 rounding (the prefix tokens attended as text, ``num_prefix_tokens``); ``torch.compile(fullgraph=True)``
has no graph break and a compiled training step equals the eager one.
"""
from __future__ import annotations

import pytest
import torch

import flexsparse
from helpers import assert_fullgraph_step_equals_eager

timm = pytest.importorskip("timm")
pytestmark = pytest.mark.usefixtures("single_thread")
BLOCK = 16
TOL = dict(rtol=1e-10, atol=1e-12)
MODELS = {   # name -> (create_model keywords, patch tokens)
    "vit_tiny_patch16_224": (dict(img_size=128), 64),
    "deit_tiny_distilled_patch16_224": (dict(img_size=128), 64),
    "eva02_tiny_patch14_224": (dict(img_size=112), 64),
    "vit_small_patch16_224": (dict(img_size=128, class_token=False, global_pool="avg", reg_tokens=4), 64),
}


def topk(k: int) -> dict:
    return {"method": "topk", "block_size": BLOCK, "topk": k}


def build(name: str):
    torch.manual_seed(0)
    keywords, visual = MODELS[name]
    model = timm.create_model(name, pretrained=False, num_classes=10, **keywords).double().eval()
    size = keywords["img_size"]
    return model, torch.randn(2, 3, size, size, dtype=torch.float64), visual


def training_step(model, x):
    out = model(x)
    params = [p for p in model.parameters() if p.requires_grad]
    return out, torch.autograd.grad(out.square().sum(), params, allow_unused=True)


@pytest.mark.parametrize("name", MODELS)
def test_timm_models_patch_whole_and_exact(name):
    model, x, visual = build(name)
    with torch.no_grad():
        dense = model(x)
    report = flexsparse.patch(model, {"method": "full"})
    assert len(report) == len(model.blocks) and report.skipped == {}
    with torch.no_grad():
        assert torch.equal(model(x), dense)
    flexsparse.unpatch(model)
    flexsparse.patch(model, topk(visual // BLOCK), backend="torch")
    with torch.no_grad():
        torch.testing.assert_close(model(x), dense, **TOL)
    flexsparse.unpatch(model)
    flexsparse.patch(model, topk(1), backend="torch")
    out, grads = training_step(model.train(), x)
    assert (out - dense).abs().max() > 1e-6 and all(g is None or g.isfinite().all() for g in grads)


@pytest.mark.exhaustive
@pytest.mark.parametrize("name", MODELS)
def test_timm_models_compile_fullgraph_and_train(name):
    model, x, _ = build(name)
    flexsparse.patch(model, topk(1), backend="torch")
    assert_fullgraph_step_equals_eager(model.train(), lambda module: module(x), TOL)
