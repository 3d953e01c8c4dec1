"""Visible fallbacks: what patched attention logs on the ``flexsparse`` loggers when it runs dense (once per module
and reason), ``strict=True`` errors, ``patch``'s summary of patched and skipped modules, and the CPU flex compile
notice."""
import logging

import pytest
import torch

import flexsparse
from flexsparse.backends import flex_backend
from flexsparse.integration import DenseFallbackError, SparseSDPA
from stand_ins import DiffusersStyleAttention, GenericAttention, TimmStyleAttention, TinyModel

pytestmark = pytest.mark.usefixtures("single_thread")
N, DIM = 64, 32
ONE_BLOCK = {"method": "topk", "block_size": 16, "topk": 1}
LLSA = {"method": "llsa", "block_size": 4, "topk": 2}   # self-attention only


@pytest.fixture
def logged(caplog):
    """``logged()``: ``(level name, message)`` of the records of the ``flexsparse`` loggers so far."""
    caplog.set_level(logging.DEBUG, logger="flexsparse")
    return lambda: [(r.levelname, r.getMessage()) for r in caplog.records if r.name.startswith("flexsparse")]


def dense_lines(records, reason: str) -> list[tuple[str, str]]:
    return [(level, message) for level, message in records if f"runs dense attention ({reason})" in message]


def mask() -> torch.Tensor:
    return torch.zeros(N, N).masked_fill(torch.rand(N, N) < 0.3, float("-inf")).fill_diagonal_(0)


class ManualProcessor:
    """A dispatching diffusers-style processor whose attention backend computes attention without SDPA."""

    _attention_backend = "flex"

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None):
        batch = hidden_states.shape[0]
        q, k, v = (x.view(batch, -1, attn.heads, x.shape[-1] // attn.heads).transpose(1, 2)
                   for x in (attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)))
        out = torch.softmax(q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5, dim=-1) @ v
        return attn.to_out[0](out.transpose(1, 2).flatten(2))


class ModuleAttnProcessor(torch.nn.Module):
    """A processor that is a module, as diffusers' IP-Adapter processors are (never called here)."""


def test_each_dense_reason_is_logged_once_per_module(logged):
    model, x, context = TinyModel("diffusers", cross_dim=24).eval(), torch.randn(2, N, DIM), torch.randn(2, 7, 24)
    flexsparse.patch(model, {**LLSA, "overrides": {0: "full"}, "dense_warmup_steps": 1},
                     layers=["blocks.*.attn", "blocks.*.cross"])
    for step in (0, 0, None, None):
        flexsparse.set_step(model, step)
        model(x, context)
    records = logged()
    assert dense_lines(records, "full config") == [("DEBUG", "module 'blocks.0.attn' runs dense attention (full "
                                                             "config): its config is 'full'")]
    warmup = dense_lines(records, "warm-up")
    assert [level for level, _ in warmup] == ["DEBUG"] * 5
    assert sorted(m.split("'")[1] for _, m in warmup) == ["blocks.0.cross", "blocks.1.attn", "blocks.1.cross",
                                                          "blocks.2.attn", "blocks.2.cross"]
    cross = dense_lines(records, "cross-attention")
    assert [m.split("'")[1] for _, m in cross] == ["blocks.0.cross", "blocks.1.cross", "blocks.2.cross"]
    assert all(level == "WARNING" and "64 queries attend 7 keys" in m and "'llsa'" in m for level, m in cross)


def test_mask_and_is_causal_warn_once_and_raise_under_strict(logged):
    attn, x = TimmStyleAttention(DIM, 2).eval(), torch.randn(2, N, DIM)
    flexsparse.patch(attn, ONE_BLOCK)
    attn(x, mask())
    attn(x, mask())
    assert [level for level, _ in dense_lines(logged(), "attn_mask")] == ["WARNING"]
    assert "module '<root>'" in dense_lines(logged(), "attn_mask")[0][1]
    flexsparse.unpatch(attn)
    flexsparse.patch(attn, ONE_BLOCK, strict=True)
    with pytest.raises(DenseFallbackError, match=r"module '<root>' would run dense attention \(attn_mask\)"):
        attn(x, mask())
    q, k, v = (torch.randn(1, 2, N, 16) for _ in range(3))
    site = SparseSDPA(ONE_BLOCK, head_dim=16, num_heads=2, name="blocks.3.attn")
    site(q, k, v, is_causal=True)
    site(q, k, v, is_causal=True)
    assert [m for _, m in dense_lines(logged(), "is_causal")] == [
        "module 'blocks.3.attn' runs dense attention (is_causal): the call passes is_causal=True, which sparse "
        "methods do not apply"]
    strict = SparseSDPA(ONE_BLOCK, head_dim=16, num_heads=2, strict=True)
    with pytest.raises(DenseFallbackError, match=r"a SparseSDPA would run dense attention \(is_causal\)"):
        strict(q, k, v, is_causal=True)


def test_strict_raises_for_cross_attention_and_allows_full_and_warmup():
    model, x, context = TinyModel("diffusers", cross_dim=24).eval(), torch.randn(2, N, DIM), torch.randn(2, 7, 24)
    flexsparse.patch(model, {**LLSA, "overrides": {0: "full"}, "dense_warmup_steps": 1}, strict=True)
    flexsparse.set_step(model, 0)
    model(x, context)
    flexsparse.set_step(model, None)
    model(x, context)
    flexsparse.unpatch(model)
    flexsparse.patch(model, LLSA, layers="blocks.*.cross", strict=True)
    with pytest.raises(DenseFallbackError, match=r"module 'blocks.0.cross' .*\(cross-attention\).*strict=True"):
        model(x, context)


def test_routed_forward_without_sdpa_warns_once_or_raises(logged):
    attn, x = TimmStyleAttention(DIM, 2).eval(), torch.randn(2, N, DIM)
    flexsparse.patch(attn, ONE_BLOCK)
    attn.fused_attn = False                           # its own attention code: no SDPA call to route
    attn(x)
    attn(x)
    assert [level for level, _ in dense_lines(logged(), "no SDPA call")] == ["WARNING"]
    model = torch.nn.ModuleDict({"attn": DiffusersStyleAttention(DIM, 2, processor=ManualProcessor())})
    flexsparse.patch(model, ONE_BLOCK, strict=True)
    with pytest.raises(DenseFallbackError, match=r"module 'attn' .*\(no SDPA call\).*diffusers attention backend "
                                                 r"'flex' does not call it"):
        model["attn"](x)


def test_real_diffusers_backend_that_bypasses_sdpa_is_reported(logged):
    flux = pytest.importorskip("diffusers.models.transformers.transformer_flux")
    from diffusers.models.attention_dispatch import attention_backend
    attn, x = flux.FluxAttention(query_dim=DIM, heads=2, dim_head=16).eval(), torch.randn(2, N, DIM)
    flexsparse.patch(attn, ONE_BLOCK, backend="torch")
    with torch.no_grad(), attention_backend("flex"):  # diffusers' own FlexAttention, dense here
        attn(x)
        attn(x)
    lines = dense_lines(logged(), "no SDPA call")
    assert len(lines) == 1 and "diffusers attention backend 'flex'" in lines[0][1]
    flexsparse.unpatch(attn)
    flexsparse.patch(attn, ONE_BLOCK, backend="torch", strict=True)
    with torch.no_grad(), attention_backend("flex"), pytest.raises(DenseFallbackError, match="'flex'"):
        attn(x)


def test_patch_summary_counts_patched_and_skipped_modules(logged):
    model = TinyModel("diffusers", cross_dim=24)
    report = flexsparse.patch(model, {**ONE_BLOCK, "overrides": {-1: "full"}})
    assert list(report) == ["blocks.0.attn", "blocks.1.attn", "blocks.2.attn"]
    assert report.skipped == dict.fromkeys(["blocks.0.cross", "blocks.1.cross", "blocks.2.cross"],
                                           "cross-attention (patched only when named in layers=)")
    assert [m for level, m in logged() if level == "INFO"] == [
        "flexsparse.patch: patched 3 attention modules (topk: 2, full: 1); skipped 3 attention modules; 3 "
        "cross-attention (patched only when named in layers=): blocks.0.cross, blocks.1.cross, blocks.2.cross"]
    flexsparse.unpatch(model)
    assert flexsparse.patch(model, ONE_BLOCK, layers="blocks.1.attn").skipped == dict.fromkeys(
        ["blocks.0.attn", "blocks.0.cross", "blocks.1.cross", "blocks.2.attn", "blocks.2.cross"],
        "not matched by layers=")
    cross = DiffusersStyleAttention(DIM, 2, cross_dim=24, processor=ModuleAttnProcessor())
    mixed = torch.nn.ModuleDict({"timm": TimmStyleAttention(DIM, 2), "own": GenericAttention(DIM, 2), "cross": cross})
    report = flexsparse.patch(mixed, ONE_BLOCK)
    assert list(report) == ["timm"] and list(report.skipped) == ["own", "cross"]   # not cross.processor, a part
    assert report.skipped["own"].startswith("not diffusers- or timm-style")


def test_cpu_flex_compile_is_announced_once_per_variant(logged, monkeypatch):
    monkeypatch.setattr(flex_backend, "CPU_VARIANTS", set())
    monkeypatch.setattr(flex_backend, "FLEX_ATTENTION", lambda key, q, k, v, **options: torch.zeros_like(q))
    with torch.no_grad():
        for n in (64, 64, 128):
            q, k, v = (torch.randn(1, 2, n, 32) for _ in range(3))
            flexsparse.attention(q, k, v, ONE_BLOCK, backend="flex")
    notices = [(level, m) for level, m in logged() if "compiling FlexAttention for CPU" in m]
    assert [level for level, _ in notices] == ["INFO", "INFO"]
    assert "(1, 2, 64, 32)" in notices[0][1] and "(1, 2, 128, 32)" in notices[1][1]
