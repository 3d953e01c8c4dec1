"""flexsparse.patch on joint text+visual sequences: diffusers' joint blocks (SD3, Flux's double- and single-stream
blocks, CogVideoX, HunyuanVideo's blocks: tiny models with random weights, fp64) and a ViT's class token (a stand-in).

Each joint call of a patched model gets its ``Joint`` (text first in Flux and CogVideoX, last in SD3 and HunyuanVideo;
the prompt's length), and the patched model equals the unpatched one whose SDPA calls run
``flexsparse.attention(..., joint=...)`` by hand (``ByHand``). ``"full"`` equals the unpatched model exactly, and a
top-K over every visual block equals it to fp64 rounding, which it would not if the text tokens were visual ones
(``ByHand`` without ``joint`` shows it).
"""
from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

import flexsparse
from flexsparse.integration import DenseFallbackError, SparseSDPA
from flexsparse.integration.joint import JOINT_PROCESSORS, SINGLE_STREAM_BLOCKS
from flexsparse.masks import morton_order_2d
from helpers import assert_fullgraph_step_equals_eager
from stand_ins import TinyViT

pytestmark = pytest.mark.usefixtures("single_thread")
B, TEXT, BLOCK = 2, 7, 16
TOL = dict(rtol=1e-10, atol=1e-12)
SDPA_ARGUMENTS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def topk(k: int) -> dict:
    return {"method": "topk", "block_size": BLOCK, "topk": k}


class ByHand(TorchFunctionMode):
    """Every SDPA call as ``flexsparse.attention(q, k, v, config, joint=joint)`` on the torch backend, its visual
    tokens permuted by the ``TokenOrder`` ``order`` (the text tokens in place) and back."""

    def __init__(self, config: dict, joint: flexsparse.Joint | None, order=None):
        super().__init__()
        self.config, self.joint, self.order = config, joint, order

    def __torch_function__(self, func, types, args=(), kwargs=None):
        call = {**dict(zip(SDPA_ARGUMENTS, args)), **(kwargs or {})}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **(kwargs or {}))
        assert call.get("attn_mask") is None and not call.get("is_causal") and not call.get("dropout_p")
        q, k, v = call["query"], call["key"], call["value"]
        perm = inverse = torch.arange(q.shape[-2])
        if self.order is not None:
            perm, inverse = (whole_sequence(x, self.joint, q.shape[-2]) for x in (self.order.perm, self.order.inverse))
        out = flexsparse.attention(q[..., perm, :], k[..., perm, :], v[..., perm, :], self.config, backend="torch",
                                   scale=call.get("scale"), joint=self.joint)
        return out[..., inverse, :]


def whole_sequence(visual: torch.Tensor, joint: flexsparse.Joint, n: int) -> torch.Tensor:
    """A permutation of the visual tokens as one of the whole sequence of ``n`` tokens, the text tokens in place."""
    text, shift = torch.arange(joint.length), joint.length if joint.text == "prefix" else 0
    parts = [text, visual + shift] if joint.text == "prefix" else [visual + shift, text + n - joint.length]
    return torch.cat(parts)


@pytest.fixture
def joints(monkeypatch):
    """``{module name: [the joint of each of its SparseSDPA calls]}``, filled as the calls run."""
    seen: dict[str, list] = {}
    forward = SparseSDPA.forward

    def recording(self, *args, joint=None, **kwargs):
        seen.setdefault(self.name, []).append(joint)
        return forward(self, *args, joint=joint, **kwargs)
    monkeypatch.setattr(SparseSDPA, "forward", recording)
    return seen


def randn(*shape) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64)


def sd3():
    from diffusers import SD3Transformer2DModel
    model = SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8,
                                  num_attention_heads=2, joint_attention_dim=16, caption_projection_dim=16,
                                  pooled_projection_dim=8, out_channels=4, pos_embed_max_size=16)
    inputs = dict(hidden_states=randn(B, 4, 16, 16), encoder_hidden_states=randn(B, TEXT, 16),
                  pooled_projections=randn(B, 8), timestep=torch.tensor([3.0, 5.0]), return_dict=False)
    return model, inputs, flexsparse.Joint("suffix", TEXT), 64


def flux():
    from diffusers import FluxTransformer2DModel
    model = FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
                                   attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
                                   pooled_projection_dim=8, axes_dims_rope=(2, 2, 4))
    rows, cols = torch.meshgrid(torch.arange(8.0), torch.arange(8.0), indexing="ij")
    image_ids = torch.stack([torch.zeros(64), rows.flatten(), cols.flatten()], dim=-1)
    inputs = dict(hidden_states=randn(B, 64, 4), encoder_hidden_states=randn(B, TEXT, 16),
                  pooled_projections=randn(B, 8), timestep=torch.tensor([0.3, 0.5]), img_ids=image_ids,
                  txt_ids=torch.zeros(TEXT, 3), return_dict=False)
    return model, inputs, flexsparse.Joint("prefix", TEXT), 64


def cogvideox():
    from diffusers import CogVideoXTransformer3DModel
    model = CogVideoXTransformer3DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
                                        time_embed_dim=8, text_embed_dim=16, num_layers=1, sample_width=8,
                                        sample_height=8, sample_frames=9, patch_size=2, temporal_compression_ratio=4,
                                        max_text_seq_length=TEXT)
    inputs = dict(hidden_states=randn(B, 3, 4, 8, 8), encoder_hidden_states=randn(B, TEXT, 16),
                  timestep=torch.tensor([3, 5]), return_dict=False)
    return model, inputs, flexsparse.Joint("prefix", TEXT), 48


class HunyuanBlocks(nn.Module):
    """HunyuanVideo's double-stream block, then its single-stream one, without the text padding mask the model
    passes them (``hunyuan_video_model``)."""

    def __init__(self):
        super().__init__()
        from diffusers.models.transformers import transformer_hunyuan_video as hunyuan
        self.double_stream = hunyuan.HunyuanVideoTransformerBlock(2, 8, mlp_ratio=2.0)
        self.single_stream = hunyuan.HunyuanVideoSingleTransformerBlock(2, 8, mlp_ratio=2.0)

    def forward(self, hidden_states, encoder_hidden_states, temb, return_dict=False):
        hidden_states, encoder_hidden_states = self.double_stream(hidden_states, encoder_hidden_states, temb)
        return torch.cat(self.single_stream(hidden_states, encoder_hidden_states, temb), dim=1), None


def hunyuan_video():
    inputs = dict(hidden_states=randn(B, 64, 16), encoder_hidden_states=randn(B, TEXT, 16), temb=randn(B, 16))
    return HunyuanBlocks(), inputs, flexsparse.Joint("suffix", TEXT), 64


MODELS = {"sd3": sd3, "flux": flux, "cogvideox": cogvideox, "hunyuan_video": hunyuan_video}
JOINT_MODULES = {"sd3": ["transformer_blocks.0.attn", "transformer_blocks.1.attn"],
                 "flux": ["transformer_blocks.0.attn", "single_transformer_blocks.0.attn"],
                 "cogvideox": ["transformer_blocks.0.attn1"],
                 "hunyuan_video": ["double_stream.attn", "single_stream.attn"]}


def build(name: str):
    """``(model, inputs, joint, visual tokens)`` of a tiny fp64 model in eval mode."""
    pytest.importorskip("diffusers")
    torch.manual_seed(0)
    model, inputs, joint, visual = MODELS[name]()
    return model.double().eval(), inputs, joint, visual


def run(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs)[0]


@pytest.mark.parametrize("name", MODELS)
def test_each_joint_call_gets_its_joint_and_equals_the_method_by_hand(name, joints):
    model, inputs, joint, _ = build(name)
    dense = run(model, inputs)
    with ByHand(topk(1), joint):
        by_hand = run(model, inputs)
    report = flexsparse.patch(model, topk(1), backend="torch")
    assert list(report) == JOINT_MODULES[name] and report.skipped == {}
    out = run(model, inputs)
    assert joints == {module: [joint] for module in JOINT_MODULES[name]}
    torch.testing.assert_close(out, by_hand, **TOL)
    assert (out - dense).abs().max() > 1e-4
    assert torch.equal(run(copy.deepcopy(model), inputs), out)


@pytest.mark.parametrize("name", MODELS)
def test_full_is_the_original_and_every_visual_block_is_dense(name):
    model, inputs, joint, visual = build(name)
    dense = run(model, inputs)
    flexsparse.patch(model, {"method": "full"})
    assert torch.equal(run(model, inputs), dense)
    flexsparse.unpatch(model)
    every_block = topk(visual // BLOCK)
    flexsparse.patch(model, every_block, backend="torch")
    torch.testing.assert_close(run(model, inputs), dense, **TOL)
    assert flexsparse.unpatch(model) == JOINT_MODULES[name]
    assert not any("forward" in module.__dict__ for module in model.modules())
    with ByHand(every_block, None):                   # the text as visual tokens: a block of keys is dropped
        assert (run(model, inputs) - dense).abs().max() > 1e-4


def test_token_grid_covers_the_visual_tokens_of_flux():
    model, inputs, joint, _ = build("flux")
    with ByHand(topk(1), joint, order=morton_order_2d(8, 8)):
        by_hand = run(model, inputs)
    with ByHand(topk(1), joint):
        raster = run(model, inputs)
    flexsparse.patch(model, {**topk(1), "token_grid": [8, 8]}, backend="torch")
    out = run(model, inputs)
    torch.testing.assert_close(out, by_hand, **TOL)
    assert (out - raster).abs().max() > 1e-4
    flexsparse.unpatch(model)
    flexsparse.patch(model, topk(1), backend="torch", token_grid=(4, 4))
    with pytest.raises(ValueError, match=r"token_grid=\(4, 4\) has 16 tokens but the attention got 71 queries, 7 of "
                                         r"them text"):
        run(model, inputs)


class JoiningBlock(nn.Module):
    """A single-stream block that flexsparse's tables do not name: it joins its text before its image tokens."""

    def __init__(self):
        super().__init__()
        from diffusers.models.transformers.transformer_flux import FluxAttention
        self.attn = FluxAttention(query_dim=16, heads=2, dim_head=8, out_dim=16, bias=True, pre_only=True)

    def forward(self, hidden_states, encoder_hidden_states):
        return self.attn(torch.cat([encoder_hidden_states, hidden_states], dim=1))


class JoinedBlock(JoiningBlock):
    """A single-stream block that gets its text and image tokens already joined (as Chroma's)."""

    def forward(self, hidden_states):
        return self.attn(hidden_states)


def dense_lines(caplog, reason: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if f"runs dense attention ({reason})" in r.getMessage()]


def test_single_stream_blocks_of_unknown_layout_are_skipped_or_dense(caplog, monkeypatch):
    pytest.importorskip("diffusers")
    caplog.set_level(logging.WARNING, logger="flexsparse")
    model = nn.ModuleDict({"joined": JoinedBlock(), "joining": JoiningBlock()}).double().eval()
    image, text = randn(B, 64, 16), randn(B, TEXT, 16)
    with torch.no_grad():
        dense = model["joining"](image, text)
        with ByHand(topk(1), flexsparse.Joint("prefix", TEXT)):
            by_hand = model["joining"](image, text)
    report = flexsparse.patch(model, topk(1), backend="torch")
    assert list(report) == ["joining.attn"]
    assert report.skipped == {"joined.attn": "single-stream attention whose block gets its text and image tokens "
                                             "already joined, so their lengths are unknown (named in layers=, it "
                                             "attends them all as visual tokens)"}
    with torch.no_grad():
        assert torch.equal(model["joining"](image, text), dense)
        monkeypatch.setitem(SINGLE_STREAM_BLOCKS, "JoiningBlock", "prefix")
        torch.testing.assert_close(model["joining"](image, text), by_hand, **TOL)
    [line] = dense_lines(caplog, "unknown text side")
    assert "module 'joining.attn'" in line and f"{TEXT} of its {64 + TEXT} tokens are text that JoiningBlock" in line
    flexsparse.unpatch(model)
    monkeypatch.delitem(SINGLE_STREAM_BLOCKS, "JoiningBlock")
    flexsparse.patch(model, topk(1), backend="torch", strict=True)
    with pytest.raises(DenseFallbackError, match=r"\(unknown text side\)"):
        model["joining"](image, text)


def test_a_processor_of_unknown_layout_runs_dense_until_named(caplog, monkeypatch):
    flux_module = pytest.importorskip("diffusers.models.transformers.transformer_flux")

    class RenamedProcessor(flux_module.FluxAttnProcessor):
        """Flux's joint processor under a name that flexsparse's table lacks."""
    attn = flux_module.FluxAttention(query_dim=16, heads=2, dim_head=8, added_kv_proj_dim=16, out_dim=16,
                                     context_pre_only=False, bias=True, processor=RenamedProcessor()).double().eval()
    caplog.set_level(logging.WARNING, logger="flexsparse")
    image, text = randn(B, 64, 16), randn(B, TEXT, 16)
    with torch.no_grad():
        dense = torch.cat(attn(image, text), dim=1)
        with ByHand(topk(1), flexsparse.Joint("prefix", TEXT)):
            by_hand = torch.cat(attn(image, text), dim=1)
        flexsparse.patch(attn, topk(1), backend="torch")
        assert torch.equal(torch.cat(attn(image, text), dim=1), dense)
        assert len(dense_lines(caplog, "unknown text side")) == 1
        monkeypatch.setitem(JOINT_PROCESSORS, "RenamedProcessor", "prefix")
        torch.testing.assert_close(torch.cat(attn(image, text), dim=1), by_hand, **TOL)
        assert (by_hand - dense).abs().max() > 1e-4


def test_vit_class_token_is_a_prefix(joints):
    torch.manual_seed(0)
    model, patches = TinyViT().double().eval(), randn(B, 64, 32)
    cls = flexsparse.Joint("prefix", 1)
    with torch.no_grad():
        dense = model(patches)
        with ByHand(topk(1), cls, order=morton_order_2d(8, 8)):
            by_hand = model(patches)
        flexsparse.patch(model, {**topk(1), "token_grid": [8, 8]}, backend="torch")
        torch.testing.assert_close(model(patches), by_hand, **TOL)
        assert joints == {"blocks.0.attn": [cls], "blocks.1.attn": [cls]}
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="eager", fullgraph=True)
        torch.testing.assert_close(compiled(patches), by_hand, **TOL)
        flexsparse.unpatch(model)
        flexsparse.patch(model, {**topk(4), "token_grid": [8, 8]}, backend="torch")
        torch.testing.assert_close(model(patches), dense, **TOL)


def wan():
    from diffusers import WanTransformer3DModel
    model = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4,
                                  out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=1,
                                  cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=32)
    inputs = dict(hidden_states=randn(B, 4, 2, 8, 8), encoder_hidden_states=randn(B, TEXT, 16),
                  timestep=torch.tensor([3, 5]), return_dict=False)
    return model, inputs, None, 32


def pixart():
    from diffusers import PixArtTransformer2DModel
    model = PixArtTransformer2DModel(sample_size=8, num_layers=1, attention_head_dim=8, num_attention_heads=2,
                                     in_channels=4, out_channels=8, cross_attention_dim=16, caption_channels=16,
                                     patch_size=1)
    inputs = dict(hidden_states=randn(B, 4, 8, 8), encoder_hidden_states=randn(B, TEXT, 16),
                  timestep=torch.tensor([3, 5]), added_cond_kwargs={"resolution": None, "aspect_ratio": None},
                  return_dict=False)
    return model, inputs, None, 64


def ltx():
    from diffusers import LTXVideoTransformer3DModel
    model = LTXVideoTransformer3DModel(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8,
                                       cross_attention_dim=16, num_layers=1, caption_channels=16)
    inputs = dict(hidden_states=randn(B, 32, 4), encoder_hidden_states=randn(B, TEXT, 16),
                  timestep=torch.tensor([3, 5]), encoder_attention_mask=torch.ones(B, TEXT), num_frames=2, height=4,
                  width=4, return_dict=False)
    return model, inputs, None, 32


def hunyuan_video_model():
    """The whole HunyuanVideo transformer (text refiner, double- and single-stream blocks); its prompts padded to
    7 tokens (7 and 3 real), which it passes to every block as a key padding mask."""
    from diffusers import HunyuanVideoTransformer3DModel
    model = HunyuanVideoTransformer3DModel(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8,
                                           num_layers=1, num_single_layers=1, num_refiner_layers=1, mlp_ratio=2.0,
                                           patch_size=1, patch_size_t=1, text_embed_dim=16, pooled_projection_dim=8,
                                           rope_axes_dim=(2, 2, 4), guidance_embeds=False)
    prompt = (torch.arange(TEXT) < torch.tensor([[TEXT], [3]])).long()
    inputs = dict(hidden_states=randn(B, 4, 2, 8, 8), timestep=torch.tensor([3, 5]),
                  encoder_hidden_states=randn(B, TEXT, 16), encoder_attention_mask=prompt,
                  pooled_projections=randn(B, 8), return_dict=False)
    return model, inputs, None, 128


def test_hunyuan_video_attends_its_padded_prompts_sparsely():
    """HunyuanVideo's text padding mask (bool key padding over the joint sequence, visual tokens all kept) runs the
    method with the padding text keys left out (``Joint.mask``), not dense: strict passes, a top-K over every visual
    block equals the unpatched model (it would not with the padding attended), fewer blocks differ; the prompt's
    refiner attention is skipped by default."""
    pytest.importorskip("diffusers")
    torch.manual_seed(0)
    model, inputs, _, _ = hunyuan_video_model()
    model = model.double().eval()
    dense = run(model, inputs)
    report = flexsparse.patch(model, topk(8), backend="torch", strict=True)
    assert list(report) == ["transformer_blocks.0.attn", "single_transformer_blocks.0.attn"]
    assert list(report.skipped) == ["context_embedder.token_refiner.refiner_blocks.0.attn"]
    torch.testing.assert_close(run(model, inputs), dense, **TOL)
    flexsparse.unpatch(model)
    flexsparse.patch(model, topk(2), backend="torch", strict=True)
    assert (run(model, inputs) - dense).abs().max() > 1e-3


@pytest.mark.parametrize("name", ["flux", pytest.param("sd3", marks=pytest.mark.exhaustive),
                                  pytest.param("cogvideox", marks=pytest.mark.exhaustive),
                                  pytest.param("hunyuan_video", marks=pytest.mark.exhaustive),
                                  pytest.param("wan", marks=pytest.mark.exhaustive),
                                  pytest.param("pixart", marks=pytest.mark.exhaustive),
                                  pytest.param("ltx", marks=pytest.mark.exhaustive),
                                  pytest.param("hunyuan_video_model", marks=pytest.mark.exhaustive)])
def test_patched_models_compile_fullgraph_and_train(name):
    """``torch.compile(patched, fullgraph=True)``: no graph break (``torch._dynamo.explain``), and a training step's
    output and parameter gradients equal eager ones."""
    pytest.importorskip("diffusers")
    torch.manual_seed(0)
    model, inputs, _, _ = {**MODELS, "wan": wan, "pixart": pixart, "ltx": ltx,
                           "hunyuan_video_model": hunyuan_video_model}[name]()
    model = model.double()
    flexsparse.patch(model, topk(2), backend="torch")
    assert_fullgraph_step_equals_eager(model, lambda module: module(**inputs)[0], TOL)


def test_ltx_cross_attention_is_skipped_and_runs_dense_when_named(caplog):
    """LTX-Video's ``attn2`` (one attention class for self- and cross-attention, no ``is_cross_attention`` flag) is
    left out by default; named in ``layers=``, a call whose text is as long as its visual tokens runs dense (the
    lengths alone would let the method run on q and k of two sequences), under strict an error."""
    pytest.importorskip("diffusers")
    torch.manual_seed(0)
    model, inputs, _, n_visual = ltx()
    model = model.double()
    inputs = {**inputs, "encoder_hidden_states": randn(B, n_visual, 16), "encoder_attention_mask": None}
    with torch.no_grad():
        dense = model(**inputs)[0]
    report = flexsparse.patch(model, topk(1), backend="torch")
    assert list(report) == ["transformer_blocks.0.attn1"]
    assert report.skipped == {"transformer_blocks.0.attn2": "cross-attention (patched only when named in layers=)"}
    flexsparse.unpatch(model)
    flexsparse.patch(model, topk(1), layers="*.attn2", backend="torch")
    with caplog.at_level(logging.WARNING, logger="flexsparse"), torch.no_grad():
        torch.testing.assert_close(model(**inputs)[0], dense, **TOL)
    assert any("(cross-attention)" in r.getMessage() and f"{n_visual} encoder_hidden_states" in r.getMessage()
               for r in caplog.records)
    flexsparse.unpatch(model)
    flexsparse.patch(model, topk(1), layers="*.attn2", backend="torch", strict=True)
    with pytest.raises(DenseFallbackError, match="cross-attention"), torch.no_grad():
        model(**inputs)


def test_a_joint_calls_text_padding_runs_the_method_and_other_masks_run_dense(caplog):
    """``SparseSDPA`` with ``joint``: a bool key padding mask ``(B, 1, 1, N)`` that keeps every visual token becomes
    ``Joint.mask`` (the method runs); one that masks a visual token, or a float mask, runs dense SDPA with it."""
    site = SparseSDPA(topk(1), head_dim=8, num_heads=2, backend="torch").double()
    n, joint = 64 + TEXT, flexsparse.Joint("suffix", TEXT)
    q, k, v = (randn(B, 2, n, 8) for _ in range(3))
    keys = torch.ones(B, 1, 1, n, dtype=torch.bool)
    keys[1, ..., n - 3:] = False
    want = flexsparse.attention(q, k, v, topk(1), backend="torch",
                                joint=flexsparse.Joint("suffix", TEXT, keys[:, 0, 0, n - TEXT:]))
    with caplog.at_level(logging.WARNING, logger="flexsparse"):
        torch.testing.assert_close(site(q, k, v, attn_mask=keys, joint=joint), want, **TOL)
        assert not caplog.records
        visual = keys.clone()
        visual[0, ..., 5] = False
        for mask in (visual, torch.zeros(B, 1, n, n, dtype=torch.float64)):
            torch.testing.assert_close(site(q, k, v, attn_mask=mask, joint=joint),
                                       F.scaled_dot_product_attention(q, k, v, attn_mask=mask), **TOL)
    assert [r.getMessage().split("(")[1].split(")")[0] for r in caplog.records] == ["attn_mask"]
