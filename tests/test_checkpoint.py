"""SparseAttention checkpoints: the config entry of state_dict (torch.save with weights_only, safetensors), refusal
of a different method, config, head_dim or num_heads and of non-finite parameters, the escape, older checkpoints."""
import copy
import io
import json
import re

import pytest
import torch
from torch import nn

import flexsparse
from flexsparse.training.layers import set_config

from helpers import qkv
from stand_ins import TinyModel

D, H, N = 8, 2, 64
SLA = {"method": "sla", "block_size": 16, "topk_ratio": 0.25}
SLA2 = {"method": "sla2", "block_size": 16, "topk_ratio": 0.25}
VSA = {"method": "vsa", "block_size": 16, "topk": 2, "gate": True}
LEARNED = [SLA, SLA2, VSA]


def layer(config: dict, head_dim: int = D, num_heads: int = H) -> flexsparse.SparseAttention:
    return flexsparse.SparseAttention(config, head_dim=head_dim, num_heads=num_heads, seq_len=N, backend="torch")


def trained(config: dict, **sizes) -> flexsparse.SparseAttention:
    """A layer whose parameters are moved off their initial values."""
    module = layer(config, **sizes)
    with torch.no_grad():
        for param in module.parameters():
            param.add_(torch.randn_like(param))
    return module


def params(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: param.detach().clone() for name, param in module.named_parameters()}


def assert_same_params(module: nn.Module, expected: dict[str, torch.Tensor]) -> None:
    got = params(module)
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[name], expected[name]) for name in got)


@pytest.mark.parametrize("config", LEARNED, ids=lambda c: c["method"])
def test_round_trip_through_torch_save_with_weights_only(config):
    saved = trained(config)
    buffer = io.BytesIO()
    torch.save(saved.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    entry = json.loads(bytes(state["config"].tolist()).decode())
    assert entry == {**saved.config.to_dict(), "head_dim": D, "num_heads": H}
    fresh = layer(config)
    result = fresh.load_state_dict(state)
    assert not result.missing_keys and not result.unexpected_keys
    assert_same_params(fresh, params(saved))
    q, k, v = (x.float() for x in qkv(heads=H, n=N, d=D))
    assert torch.equal(fresh(q, k, v), saved(q, k, v))


@pytest.mark.parametrize("config", LEARNED, ids=lambda c: c["method"])
def test_round_trip_through_safetensors(config, tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    saved = trained(config)
    safetensors.save_file(saved.state_dict(), tmp_path / "layer.safetensors")
    fresh = layer(config)
    fresh.load_state_dict(safetensors.load_file(tmp_path / "layer.safetensors"))
    assert_same_params(fresh, params(saved))


def test_a_module_without_parameters_carries_its_config():
    llsa = {"method": "llsa", "block_size": 16, "topk": [2, 1], "levels": 2}
    assert list(layer(llsa).state_dict()) == ["config"]
    layer(llsa).load_state_dict(layer(llsa).state_dict())
    with pytest.raises(RuntimeError, match=r"checkpoint config has topk=\[2, 1\], this module has topk=\[3, 1\]"):
        layer({**llsa, "topk": [3, 1]}).load_state_dict(layer(llsa).state_dict())


MISMATCHES = [
    (SLA, SLA2, {}, "method='sla', this module has method='sla2'"),
    (SLA, {**SLA, "linear": "full"}, {}, "linear='masked', this module has linear='full'"),
    (SLA, {**SLA, "topk_ratio": 0.5}, {}, "topk_ratio=0.25, this module has topk_ratio=0.5"),
    (SLA, {**SLA, "feature_map": "elu"}, {}, "feature_map='softmax', this module has feature_map='elu'"),
    (SLA2, {**SLA2, "router": "soft"}, {}, "router='hard', this module has router='soft'"),
    (SLA, SLA, {"head_dim": 2 * D}, f"head_dim={D}, this module has head_dim={2 * D}"),
    (SLA, SLA, {"num_heads": 2 * H}, f"num_heads={H}, this module has num_heads={2 * H}"),
    (VSA, {**VSA, "topk": 3}, {}, "topk=2, this module has topk=3"),
]


@pytest.mark.parametrize("saved_config, config, sizes, message", MISMATCHES,
                         ids=["method", "linear", "topk_ratio", "feature_map", "router", "head_dim", "num_heads",
                              "vsa_topk"])
def test_a_different_method_config_or_shape_is_refused_naming_both_values(saved_config, config, sizes, message):
    model = nn.ModuleDict({"block": nn.ModuleDict({"attn": trained(config, **sizes)})})
    before = params(model)
    state = {f"block.attn.{key}": value for key, value in trained(saved_config).state_dict().items()}
    expected = re.escape(f"block.attn.config: checkpoint config has {message};")
    with pytest.raises(RuntimeError, match=expected) as refused:
        model.load_state_dict(state)
    assert "without_configs" in str(refused.value)
    with pytest.raises(RuntimeError, match="checkpoint config has"):
        model.load_state_dict(state, strict=False)
    assert_same_params(model, before)


def test_every_differing_key_is_named():
    with pytest.raises(RuntimeError, match="has linear='masked', topk_ratio=0.25, this module has linear='full', "
                                           "topk_ratio=0.5;"):
        layer({**SLA, "linear": "full", "topk_ratio": 0.5}).load_state_dict(trained(SLA).state_dict())


@pytest.mark.parametrize("saved_config, config", [
    (SLA, {**SLA, "deterministic": True}),
    (SLA, {**SLA, "quant": {"qk_dtype": "int8"}}),
    (SLA2, {**SLA2, "alpha_init": 0.5}),
], ids=["deterministic", "quant", "alpha_init"])
def test_keys_that_do_not_change_the_parameters_may_differ(saved_config, config):
    saved, fresh = trained(saved_config), layer(config)
    fresh.load_state_dict(saved.state_dict())
    assert_same_params(fresh, params(saved))


def test_without_configs_and_strict_false_load_into_another_config():
    saved = trained(SLA)
    model = nn.ModuleDict({"attn": layer({**SLA, "linear": "full", "topk_ratio": 0.5})})
    state = flexsparse.SparseAttention.without_configs({f"attn.{k}": v for k, v in saved.state_dict().items()})
    assert set(state) == {"attn.params.proj_weight", "attn.params.proj_bias"}
    assert model.load_state_dict(state, strict=False).missing_keys == ["attn.config"]
    assert_same_params(model["attn"], params(saved))


def test_a_checkpoint_without_the_config_entry_needs_strict_false():
    saved = trained(SLA)
    older = {key: value for key, value in saved.state_dict().items() if key != "config"}
    fresh = layer(SLA)
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "config"'):
        fresh.load_state_dict(older)
    fresh.load_state_dict(older, strict=False)
    assert_same_params(fresh, params(saved))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("config", LEARNED, ids=lambda c: c["method"])
def test_non_finite_parameters_are_refused_naming_the_parameter(config, bad):
    state = trained(config).state_dict()
    name = sorted(key for key in state if key.startswith("params."))[-1]
    state[name] = state[name].clone()
    state[name].view(-1)[-1] = bad
    model = nn.ModuleDict({"attn": layer(config)})
    before = params(model)
    state = {f"attn.{key}": value for key, value in state.items()}
    for strict in (True, False):
        with pytest.raises(RuntimeError, match=rf"attn\.{name} holds NaN or Inf"):
            model.load_state_dict(state, strict=strict)
        assert_same_params(model, before)


def test_a_config_entry_that_is_not_one_is_refused():
    state = {**trained(SLA).state_dict(), "config": torch.randn(4)}
    with pytest.raises(RuntimeError, match="config is not a SparseAttention config"):
        layer(SLA).load_state_dict(state)


def test_the_entry_follows_in_place_config_changes():
    model = nn.ModuleDict({"attn": trained(SLA2)})
    set_config(model, "attn", topk_ratio=0.5)
    state = model.state_dict()
    nn.ModuleDict({"attn": layer({**SLA2, "topk_ratio": 0.5})}).load_state_dict(state)
    with pytest.raises(RuntimeError, match="topk_ratio=0.5, this module has topk_ratio=0.25"):
        nn.ModuleDict({"attn": layer(SLA2)}).load_state_dict(state)


def test_the_entry_stays_bytes_across_dtypes_and_copies():
    saved = trained(SLA2)
    assert saved.to(torch.bfloat16).state_dict()["config"].dtype == torch.uint8
    saved = saved.double()
    state = copy.deepcopy(saved).state_dict()
    assert state["config"].dtype == torch.uint8 and torch.equal(state["config"], saved.state_dict()["config"])
    fresh = layer(SLA2)
    fresh.load_state_dict(state)
    assert all(torch.equal(p.double(), saved.params[name]) for name, p in fresh.params.items())


def test_patched_models_carry_and_check_the_entry():
    model = TinyModel("timm")
    flexsparse.patch(model, SLA, seq_len=N)
    state = model.state_dict()
    configs = sorted(key for key in state if key.endswith(".config"))
    assert configs == [f"blocks.{i}.attn.flexsparse.attention.config" for i in range(3)]
    other = TinyModel("timm")
    flexsparse.patch(other, {**SLA, "linear": "full"}, seq_len=N)
    with pytest.raises(RuntimeError) as refused:
        other.load_state_dict(state)
    assert all(f"{key}: checkpoint config has linear='masked'" in str(refused.value) for key in configs)
