"""flexsparse.patch on diffusers-style, timm-style and generic SDPA modules: equivalence, overrides,
dense warm-up and fallbacks, state_dict round trips, unpatch, deepcopy, torch.compile, real diffusers."""
import copy
import functools
import io
import logging

import pytest
import torch

import flexsparse
from flexsparse.integration import FlexSparseAttnProcessor, SparseSDPA
from stand_ins import ATTENTIONS, TimmStyleAttention, TinyModel

pytestmark = pytest.mark.usefixtures("single_thread")
N, DIM = 64, 32
KINDS = list(ATTENTIONS)
ALL_BLOCKS = {"method": "topk", "block_size": 16, "topk": 4}   # every key block: equals dense attention
ONE_BLOCK = {"method": "topk", "block_size": 16, "topk": 1}


def small(config: dict) -> dict:
    """``config`` with 16-token blocks and 2 (or 25% of the) key blocks."""
    sizes = {"block_size": 16, "block_q": 16, "block_k": 16, "topk": 2, "topk_ratio": 0.25}
    return {key: sizes.get(key, value) for key, value in config.items()}


def learns(config: dict) -> bool:
    cfg = flexsparse.Config.from_dict(config)
    return bool(flexsparse.METHODS[cfg.method].init_params(cfg, DIM // 2, 2, N))


# configs with learned parameters: vsa's gate, and every registered method's example (at a small size) that learns
LEARNED = [{"method": "vsa", "block_size": 16, "topk": 2, "gate": True},
           *(small(m.example) for m in flexsparse.METHODS.values() if learns(small(m.example)))]
SLA2 = {"method": "sla2", "block_q": 16, "block_k": 16, "topk_ratio": 0.25}


def layers_for(kind):
    return ["blocks.*.attn"] if kind == "generic" else None


def inputs():
    return torch.randn(2, N, DIM)


def require(method):
    if method not in flexsparse.METHODS:
        pytest.skip(f"method {method!r} is not in flexsparse.METHODS yet")


@pytest.mark.parametrize("kind", KINDS)
def test_full_and_all_blocks_match_the_original(kind):
    model, x = TinyModel(kind).eval(), inputs()
    ref = model(x)
    flexsparse.patch(model, {"method": "full"}, layers=layers_for(kind))
    torch.testing.assert_close(model(x), ref)
    flexsparse.unpatch(model)
    patched = flexsparse.patch(model, ALL_BLOCKS, layers=layers_for(kind), backend="torch")
    assert list(patched) == ["blocks.0.attn", "blocks.1.attn", "blocks.2.attn"]
    torch.testing.assert_close(model(x), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_sparse_changes_the_output_and_unpatch_restores(kind):
    model, x = TinyModel(kind).eval(), inputs()
    keys, ref = set(model.state_dict()), model(x)
    flexsparse.patch(model, ONE_BLOCK, layers=layers_for(kind))
    assert (model(x) - ref).abs().max() > 1e-3
    assert flexsparse.unpatch(model) == ["blocks.0.attn", "blocks.1.attn", "blocks.2.attn"]
    assert torch.equal(model(x), ref)
    assert set(model.state_dict()) == keys
    if kind == "timm_unfused":
        assert all(block.attn.fused_attn is False for block in model.blocks)


@pytest.mark.parametrize("config", LEARNED, ids=lambda c: c["method"])
@pytest.mark.parametrize("kind", KINDS)
def test_learned_parameters_survive_patch_save_load(kind, config):
    require(config["method"])
    model, x = TinyModel(kind), inputs()
    flexsparse.patch(model, config, layers=layers_for(kind), seq_len=N)
    learned = [name for name in model.state_dict() if ".flexsparse." in name]
    assert len(learned) >= 3, "each patched module's learned parameters must be in state_dict"
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".flexsparse." in name:
                param.normal_(0, 0.5)
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    fresh = TinyModel(kind)
    flexsparse.patch(fresh, config, layers=layers_for(kind), seq_len=N)
    fresh.load_state_dict(torch.load(buffer))
    assert torch.equal(fresh(x), model(x))


@pytest.mark.parametrize("kind", ["diffusers", "timm", "generic"])
def test_learned_parameters_get_gradients(kind):
    model, x = TinyModel(kind), inputs()
    flexsparse.patch(model, LEARNED[0], layers=layers_for(kind))
    model(x).square().mean().backward()
    grads = [p.grad for name, p in model.named_parameters() if ".flexsparse." in name]
    assert grads and all(g is not None and torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads)


def test_overrides_by_index_glob_and_partial_dicts():
    model = TinyModel("timm", depth=4)
    got = flexsparse.patch(model, {
        "method": "topk", "block_size": 16, "topk": 2,
        "overrides": {"0": "full", -1: "full", "blocks.2.*": {"topk": 3},
                      "blocks.1.attn": {"method": "llsa", "block_size": 4, "topk": 2}}})
    assert [c.method for c in got.values()] == ["full", "llsa", "topk", "full"]
    assert (got["blocks.2.attn"].topk, got["blocks.2.attn"].block_q) == (3, 16)
    assert model.blocks[0].attn.flexsparse.attention is None
    model(inputs())
    flexsparse.unpatch(model)
    got = flexsparse.patch(model, {"method": "topk", "block_q": 16, "block_k": 16, "topk": 2},
                           overrides={1: {"block_size": 8}, "blocks.1.*": {"topk": 5}})
    assert (got["blocks.1.attn"].block_q, got["blocks.1.attn"].block_k, got["blocks.1.attn"].topk) == (8, 8, 5)


def test_dense_warmup_runs_the_first_steps_dense():
    model, x = TinyModel("diffusers").eval(), inputs()
    dense = model(x)
    flexsparse.patch(model, {**ONE_BLOCK, "dense_warmup_steps": 2})
    sparse = model(x)
    assert (sparse - dense).abs().max() > 1e-3
    for step, expected in ((0, dense), (1, dense), (2, sparse), (9, sparse), (None, sparse)):
        flexsparse.set_step(model, step)
        torch.testing.assert_close(model(x), expected)


@pytest.mark.parametrize("grid", [(8, 8), (2, 4, 8)])
def test_token_grid_equals_reordering_the_tokens_outside(grid):
    """Attention is permutation-equivariant, so a token grid inside equals permuting the sequence outside."""
    torch.manual_seed(0)
    model, x = TinyModel("generic", depth=1).eval(), inputs()
    twin = copy.deepcopy(model)
    flexsparse.patch(model, {**ONE_BLOCK, "token_grid": list(grid)}, layers="blocks.*.attn")
    flexsparse.patch(twin, ONE_BLOCK, layers="blocks.*.attn")
    order = model.blocks[0].attn.flexsparse
    torch.testing.assert_close(model(x), twin(x[:, order.perm])[:, order.inverse])
    assert (model(x) - twin(x)).abs().max() > 1e-3
    with pytest.raises(ValueError, match=r"token_grid=\(8, 8\) has 64 tokens but the attention got 32"):
        flexsparse.unpatch(model)
        flexsparse.patch(model, ONE_BLOCK, layers="blocks.*.attn", token_grid=(8, 8))
        model(x[:, :32])


def test_cross_attention_is_skipped_by_default_and_dense_when_chosen():
    model, x, context = TinyModel("diffusers", cross_dim=24).eval(), inputs(), torch.randn(2, 7, 24)
    ref = model(x, context)
    llsa = {"method": "llsa", "block_size": 4, "topk": 2}
    assert list(flexsparse.patch(model, llsa)) == ["blocks.0.attn", "blocks.1.attn", "blocks.2.attn"]
    flexsparse.unpatch(model)
    flexsparse.patch(model, llsa, layers="blocks.*.cross")
    torch.testing.assert_close(model(x, context), ref)


def test_masks_fall_back_to_dense_and_dropout_is_an_error():
    attn, x = TimmStyleAttention(DIM, 2).eval(), inputs()
    mask = torch.zeros(N, N).masked_fill(torch.rand(N, N) < 0.3, float("-inf")).fill_diagonal_(0)
    ref = attn(x, mask)
    assert list(flexsparse.patch(attn, ONE_BLOCK)) == [""]
    torch.testing.assert_close(attn(x, mask), ref)
    attn.attn_drop.p = 0.1
    with pytest.raises(ValueError, match="dropout_p=0.1"):
        attn.train()(x)


def test_an_override_glob_that_matches_nothing_is_logged_and_changes_nothing(caplog):
    with caplog.at_level(logging.WARNING, logger="flexsparse"):
        patched = flexsparse.patch(TinyModel("timm"), {**ONE_BLOCK, "overrides": {"blocks.9.*": "full"}})
    assert all(cfg.method == ONE_BLOCK["method"] for cfg in patched.values())
    assert "overrides key 'blocks.9.*' matches none of the patched modules" in caplog.text


def test_errors_name_the_argument():
    model = TinyModel("timm")
    for kwargs, error, match in [
        (dict(overrides={5: "full"}), ValueError, "out of range"),
        (dict(overrides={0: 3}), TypeError, r"overrides\[0\] must be 'full' or a config dict"),
        (dict(overrides={0: {"topk": 0}}), ValueError, "module 'blocks.0.attn' after overrides"),
        (dict(layers="blocks.*.attention"), ValueError, "matches no module name"),
        (dict(layers=["blocks.0", "blocks.0.attn"]), ValueError, "select both"),
        (dict(layers=["blocks.0.mlp"]), ValueError, "pass head_dim= and num_heads="),
        (dict(dense_warmup_steps=-1), ValueError, "dense_warmup_steps must be an int >= 0"),
        (dict(token_grid=(8,)), ValueError, r"token_grid must be \(h, w\) or \(t, h, w\)"),
        (dict(token_grid=(8, 0)), ValueError, "w must be a positive int"),
    ]:
        with pytest.raises(error, match=match):
            flexsparse.patch(model, ONE_BLOCK, **kwargs)
    with pytest.raises(ValueError, match="given both"):
        flexsparse.patch(model, {**ONE_BLOCK, "overrides": {}}, overrides={})
    with pytest.raises(ValueError, match=r"method 'sla2' .* pass flexsparse.patch\(model, config, seq_len=N\)"):
        flexsparse.patch(model, {"method": "sla2", "block_size": 8})
    with pytest.raises(ValueError, match=r"SparseAttention\(config, head_dim=\.\.\., num_heads=\.\.\., seq_len=N\)"):
        flexsparse.SparseAttention({"method": "sla2"}, head_dim=8, num_heads=2)
    with pytest.raises(ValueError, match="found no diffusers- or timm-style"):
        flexsparse.patch(TinyModel("generic"), ONE_BLOCK)
    assert not any(".flexsparse." in name for name in model.state_dict()), "a failed patch must change nothing"


def test_sla2_needs_seq_len_and_a_failed_patch_changes_nothing():
    require("sla2")
    model = TinyModel("diffusers")
    with pytest.raises(ValueError, match="patching module 'blocks.1.attn': .*seq_len"):
        flexsparse.patch(model, {**ONE_BLOCK, "overrides": {"blocks.[12].*": SLA2}})
    assert type(model.blocks[0].attn.processor).__name__ == "AttnProcessor2_0"


def test_patch_twice_unpatch_unpatched_and_set_step_errors():
    model = TinyModel("diffusers")
    with pytest.raises(ValueError, match="not patched"):
        flexsparse.unpatch(model)
    with pytest.raises(ValueError, match="call flexsparse.patch"):
        flexsparse.set_step(model, 0)
    flexsparse.patch(model, ONE_BLOCK)
    with pytest.raises(ValueError, match="already patched"):
        flexsparse.patch(model, ONE_BLOCK)
    with pytest.raises(ValueError, match="step must be an int >= 0 or None"):
        flexsparse.set_step(model, -1)


@pytest.mark.parametrize("kind", ["generic", "timm", "diffusers"])
def test_deepcopy_of_a_patched_model_is_independent(kind):
    model, x = TinyModel(kind).eval(), inputs()
    flexsparse.patch(model, LEARNED[0], layers=layers_for(kind))
    ref = model(x)
    twin = copy.deepcopy(model)
    torch.testing.assert_close(twin(x), ref)
    with torch.no_grad():
        for param in twin.parameters():
            param.add_(0.1)
    assert torch.equal(model(x), ref)
    assert (twin(x) - ref).abs().max() > 1e-3


def test_an_instance_level_forward_is_kept():
    """Hooks such as accelerate's replace ``module.forward``; patch routes inside them and unpatch restores them."""
    model, x = TinyModel("generic").eval(), inputs()
    calls = []

    def hooked(module, *args):
        calls.append(1)
        return type(module).forward(module, *args)
    for block in model.blocks:
        block.attn.forward = functools.partial(hooked, block.attn)
    ref = model(x)
    flexsparse.patch(model, ONE_BLOCK, layers="blocks.*.attn")
    assert (model(x) - ref).abs().max() > 1e-3 and len(calls) == 6
    flexsparse.unpatch(model)
    assert torch.equal(model(x), ref) and len(calls) == 9


@pytest.mark.parametrize("kind", ["generic", "timm", "diffusers"])
def test_patched_model_compiles_without_graph_breaks(kind):
    model, x = TinyModel(kind).eval(), inputs()
    flexsparse.patch(model, {**ALL_BLOCKS, "overrides": {0: "full"}, "token_grid": [8, 8]}, layers=layers_for(kind),
                     backend="torch")
    expected = model(x)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), expected)


@pytest.mark.gpu
def test_patched_model_trains_compiled_on_gpu_in_bf16():
    model, x = TinyModel("timm", dim=128, heads=2).cuda(), torch.randn(2, 1024, 128, device="cuda")
    flexsparse.patch(model, {"method": "vsa", "block_size": 64, "topk": 4, "gate": True, "token_grid": [32, 32]})
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = torch.compile(model)(x).float().square().mean()
    loss.backward()
    grads = [p.grad for name, p in model.named_parameters() if ".flexsparse." in name]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)


def test_processor_is_a_module_with_learned_parameters():
    model = TinyModel("diffusers")
    flexsparse.patch(model, LEARNED[0])
    processor = model.blocks[0].attn.processor
    assert isinstance(processor, FlexSparseAttnProcessor) and isinstance(processor.flexsparse, SparseSDPA)
    assert "blocks.0.attn.processor.flexsparse.attention.params.gate_weight" in model.state_dict()


@pytest.fixture(scope="module")
def diffusers_attention():
    module = pytest.importorskip("diffusers.models.attention_processor")
    return module.Attention


def test_real_diffusers_attention_gets_the_processor(diffusers_attention):
    attn = diffusers_attention(query_dim=DIM, heads=2, dim_head=16, qk_norm="rms_norm", bias=True).eval()
    x, image = inputs(), torch.randn(2, DIM, 8, 8)
    ref, ref_image = attn(x), attn(image)
    flexsparse.patch(attn, ALL_BLOCKS)
    assert isinstance(attn.processor, FlexSparseAttnProcessor)
    torch.testing.assert_close(attn(x), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(attn(image), ref_image, atol=1e-5, rtol=1e-5)
    flexsparse.unpatch(attn)
    assert type(attn.processor).__name__ == "AttnProcessor2_0"


def test_real_diffusers_state_dict_round_trip(diffusers_attention):
    def build():
        torch.manual_seed(0)
        attn = diffusers_attention(query_dim=DIM, heads=2, dim_head=16, qk_norm="rms_norm")
        flexsparse.patch(attn, LEARNED[0])
        return attn
    attn, x = build(), inputs()
    with torch.no_grad():
        attn.processor.flexsparse.attention.params["gate_weight"].normal_()
    fresh = build()
    fresh.load_state_dict(attn.state_dict())
    assert torch.equal(fresh(x), attn(x))


def test_real_diffusers_custom_processor_is_routed():
    flux = pytest.importorskip("diffusers.models.transformers.transformer_flux")
    attn, x = flux.FluxAttention(query_dim=DIM, heads=2, dim_head=16).eval(), inputs()
    ref = attn(x)
    flexsparse.patch(attn, ALL_BLOCKS, backend="torch")
    assert isinstance(attn.flexsparse, SparseSDPA) and type(attn.processor).__name__ == "FluxAttnProcessor"
    torch.testing.assert_close(attn(x), ref, atol=1e-5, rtol=1e-5)
    flexsparse.unpatch(attn)
    flexsparse.patch(attn, ONE_BLOCK)
    assert (attn(x) - ref).abs().max() > 1e-3


def test_real_diffusers_save_pretrained_restores_by_patching_then_loading(tmp_path):
    """The README's restore recipe: ``from_pretrained`` (flexsparse keys unexpected), the same patch, then
    ``load_state_dict`` of the saved file gives the saved model's outputs."""
    pixart = pytest.importorskip("diffusers").PixArtTransformer2DModel
    safetensors = pytest.importorskip("safetensors.torch")
    shape = dict(sample_size=8, num_layers=2, attention_head_dim=8, num_attention_heads=2, in_channels=4,
                 out_channels=8, cross_attention_dim=16, caption_channels=16, patch_size=2)
    config = {"method": "sla", "block_size": 4, "topk_ratio": 0.5}
    model = pixart(**shape)
    flexsparse.patch(model, config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".flexsparse." in name:
                p.add_(torch.randn_like(p))
    model.save_pretrained(tmp_path)
    restored = pixart.from_pretrained(tmp_path, low_cpu_mem_usage=False)
    flexsparse.patch(restored, config)
    restored.load_state_dict(safetensors.load_file(tmp_path / "diffusion_pytorch_model.safetensors"))
    x, t, text = torch.randn(1, 4, 8, 8), torch.tensor([1]), torch.randn(1, 5, 16)
    conditions = {"resolution": None, "aspect_ratio": None}
    with torch.no_grad():
        want = model(x, encoder_hidden_states=text, timestep=t, added_cond_kwargs=conditions).sample
        got = restored(x, encoder_hidden_states=text, timestep=t, added_cond_kwargs=conditions).sample
    assert torch.equal(got, want)
