import pytest
import torch

import flexsparse as fs
from flexsparse.config import MAX_BLOCK, MAX_LEVELS, Config
from flexsparse.methods.llsa.config import LLSAConfig
from flexsparse.methods.sla.config import SLAConfig
from flexsparse.methods.topk.config import TopKConfig

from _sla_testing import assert_all_close, leaf_params, leaf_qkv, run
from helpers import qkv, rel_err

EXAMPLES = [
    {"method": "full"},
    {"method": "topk", "block_size": 16, "topk": 4},
    {"method": "topk", "block_q": 32, "block_k": 16, "topk": 2, "quant": {"dtype": "fp8_e4m3"}},
    {"method": "vsa", "block_size": 8, "topk": 3, "gate": True},
    {"method": "llsa", "block_size": 16, "topk": 8, "levels": "auto"},
    {"method": "llsa", "block_size": 4, "topk": [2, 3, 4], "levels": 3, "deterministic": True},
    {"method": "sla", "block_q": 64, "block_k": 32, "topk_ratio": 0.1, "linear": "full", "feature_map": "elu"},
    {"method": "sla2", "topk_ratio": 0.03, "router": "soft", "tau": 0.2, "alpha_per_head": True},
    *(method.example for method in fs.METHODS.values()),     # every registered method's example
]


@pytest.mark.parametrize("config", EXAMPLES, ids=lambda c: c["method"])
def test_round_trip(config):
    cfg = Config.from_dict(config)
    assert cfg.method == config["method"]
    again = Config.from_dict(cfg.to_dict())
    assert again == cfg
    assert Config.from_dict(again.to_dict()).to_dict() == cfg.to_dict()


def test_block_size_alias_sets_both_and_conflicts_raise():
    cfg = Config.from_dict({"method": "topk", "block_size": 32})
    assert (cfg.block_q, cfg.block_k) == (32, 32)
    with pytest.raises(ValueError, match="block_size"):
        Config.from_dict({"method": "topk", "block_size": 32, "block_q": 16})


def test_unknown_method_lists_valid_ones():
    with pytest.raises(ValueError, match=r"unknown method 'nsa'.*llsa"):
        Config.from_dict({"method": "nsa"})
    with pytest.raises(ValueError, match="needs a 'method'"):
        Config.from_dict({"topk": 3})


def test_unknown_key_is_named_with_valid_keys():
    with pytest.raises(ValueError, match=r"\['top_k'\].*valid keys.*topk"):
        Config.from_dict({"method": "llsa", "top_k": 8})
    with pytest.raises(ValueError, match=r"unknown key.*'quant'"):
        Config.from_dict({"method": "llsa", "quant": {"bits": 8}})


@pytest.mark.parametrize("config, match", [
    ({"method": "LLSA"}, r"unknown method 'LLSA' \(did you mean 'llsa' for 'LLSA'\?\)"),
    ({"method": "topk", "blocksize": 16}, r"did you mean 'block_size' for 'blocksize'\?\); valid keys: .*'block_size'"),
    ({"method": "sla", "topk_ration": 0.1, "linaer": "full"},
     r"did you mean 'linear' for 'linaer', 'topk_ratio' for 'topk_ration'\?"),
    ({"method": "topk", "quant": {"qk_dtpye": "int8"}}, r"in config 'quant' \(did you mean 'qk_dtype' for 'qk_dtpye'"),
    ({"method": "sla", "topk": 0.2, "BLKQ": 64, "BLKK": 32},      # the public SLA code's names
     r"did you mean 'block_k' for 'BLKK', 'block_q' for 'BLKQ', 'topk_ratio' for 'topk'\?"),
    ({"method": "sla2", "topk": 0.05}, r"did you mean 'topk_ratio' for 'topk'\?"),
    ({"method": "sla", "feature_map": "Softmax"}, r"got 'Softmax' \(did you mean 'softmax' for 'Softmax'\?\)"),
])
def test_misspelt_names_get_a_suggestion(config, match):
    """A key, method or choice close to a valid one (case aside) is named in the error; aliases count as keys."""
    with pytest.raises(ValueError, match=match):
        Config.from_dict(config)


def test_unrelated_names_get_no_suggestion():
    with pytest.raises(ValueError) as info:
        Config.from_dict({"method": "topk", "zzz": 1})
    assert "did you mean" not in str(info.value)


@pytest.mark.parametrize("config, match", [
    ({"method": "llsa", "topk": 0}, "'topk' must be >= 1"),
    ({"method": "llsa", "topk": 2.5}, "'topk' must be an int"),
    ({"method": "llsa", "block_size": 1}, "'block_size' must be >= 2"),
    ({"method": "llsa", "topk": [4, 4], "levels": 3}, "one K per level"),
    ({"method": "llsa", "levels": "many"}, "'levels' must be an int"),
    ({"method": "llsa", "levels": 33}, "'levels' must be <= 32, got 33"),
    ({"method": "llsa", "topk": [1] * 33}, "'topk' must be an int or a list of 1 to 32 ints"),
    ({"method": "llsa", "block_size": 2**31}, "'block_size' must be <= 2147483647, got 2147483648"),
    ({"method": "topk", "block_size": 2**62}, "'block_size' must be <= 2147483647"),
    ({"method": "sla", "topk_ratio": 0.0}, "'topk_ratio'"),
    ({"method": "topk", "topk": -1}, "'topk' must be >= 1"),
    ({"method": "topk", "topk": "3"}, "'topk' must be an int"),
    ({"method": "vsa", "topk": True}, "'topk' must be an int"),
    ({"method": "sla", "topk_ratio": 1.5}, "'topk_ratio'"),
    ({"method": "sla2", "topk_ratio": -0.1}, "'topk_ratio'"),
    ({"method": "sla2", "topk_ratio": float("nan")}, "'topk_ratio'"),
    ({"method": "sla", "linear": "dense"}, "'linear' must be one of"),
    ({"method": "sla", "feature_map": "hedgehog"}, "'feature_map'"),
    ({"method": "sla", "negligible_ratio": 0.1, "linear": "full"}, "negligible_ratio"),
    ({"method": "sla2", "alpha_init": 1.0}, "alpha_init"),
    ({"method": "vsa", "gate": "yes"}, "'gate' must be a bool"),
])
def test_bad_values_name_the_key(config, match):
    with pytest.raises((ValueError, TypeError), match=match):
        Config.from_dict(config)


# (method, key) for every block key of every method's config, aliases included
BLOCK_KEYS = [(method, key) for method, cls in sorted(Config.registry.items()) for key in ("block_size", "block_q",
              "block_k") if key in cls._field_names() + list(cls.ALIASES)]


@pytest.mark.parametrize("method, key", BLOCK_KEYS)
def test_every_block_key_is_bounded_by_int32(method, key):
    """Blocks of up to ``MAX_BLOCK`` tokens are legal (longer than any sequence: one block covers it); one more is
    a ValueError naming the key given, alias or field."""
    cfg = Config.from_dict({"method": method, key: MAX_BLOCK})
    assert getattr(cfg, "block_k" if key == "block_size" and method != "llsa" else key) == MAX_BLOCK
    with pytest.raises(ValueError, match=rf"config key '{key}' must be <= {MAX_BLOCK}, got {MAX_BLOCK + 1}"):
        Config.from_dict({"method": method, key: MAX_BLOCK + 1})


def test_llsa_levels_are_bounded():
    assert Config.from_dict({"method": "llsa", "levels": MAX_LEVELS, "topk": 1}).levels == MAX_LEVELS
    assert Config.from_dict({"method": "llsa", "topk": [1] * MAX_LEVELS}).topk == (1,) * MAX_LEVELS
    with pytest.raises(ValueError, match=rf"'levels' must be <= {MAX_LEVELS}, got {10**9}"):
        Config.from_dict({"method": "llsa", "levels": 10**9})


def test_config_object_and_dict_are_interchangeable():
    q, k, v = qkv(n=64, d=8)
    cfg = {"method": "topk", "block_size": 8, "topk": 2}
    a = fs.attention(q, k, v, cfg, backend="torch")
    b = fs.attention(q, k, v, TopKConfig(block_q=8, block_k=8, topk=2), backend="torch")
    assert torch.equal(a, b)


def test_switching_the_dict_switches_the_method():
    q, k, v = qkv(n=256, d=8)
    outs = {}
    for cfg in ({"method": "full"}, {"method": "topk", "block_size": 16, "topk": 2},
                {"method": "llsa", "block_size": 4, "topk": 2, "levels": 2}):
        outs[cfg["method"]] = fs.attention(q, k, v, cfg, backend="torch")
    dense = torch.softmax(q @ k.transpose(-1, -2) / 8**0.5, -1) @ v
    assert rel_err(outs["full"], dense) < 1e-12
    assert rel_err(outs["topk"], dense) > 1e-3
    assert rel_err(outs["llsa"], dense) > 1e-3
    assert rel_err(outs["llsa"], outs["topk"]) > 1e-3


def test_replace_revalidates():
    cfg = LLSAConfig()
    assert cfg.replace(topk=4).topk == 4
    with pytest.raises(ValueError):
        cfg.replace(topk=-1)
    assert isinstance(SLAConfig().replace(linear="full"), SLAConfig)


def test_config_registry_and_method_registry_agree():
    """Each method of ``flexsparse.METHODS`` registers its config class under its name, and nothing else does."""
    assert Config.registry.keys() == fs.METHODS.keys() and fs.METHODS is fs.methods.METHODS
    for name, method in fs.METHODS.items():
        assert method.name == name and method.config.method == name
        assert method.config is Config.registry[name]
        assert isinstance(Config.from_dict({"method": name}), method.config)


# A small size at which every method's example fits (e.g. 8 of 9 key blocks of 64 tokens), ragged for every block
# size, with GQA.
EXAMPLE_SIZE = dict(batch=1, heads=2, kv_heads=1, n=520, d=16)


@pytest.mark.parametrize("name", list(fs.METHODS))
def test_every_method_example_matches_the_reference(name):
    """The registry's example config of each method validates, and on the torch backend gives the reference
    backend's output, LSE and gradients (q, k, v and every learnable parameter, perturbed from their initial values
    so that every part is active) in fp64."""
    method = fs.METHODS[name]
    cfg = Config.from_dict(method.example)
    assert isinstance(cfg, method.config) and cfg.to_dict() == Config.from_dict(cfg.to_dict()).to_dict()
    size = EXAMPLE_SIZE
    q, k, v = leaf_qkv(size["batch"], size["heads"], size["kv_heads"], size["n"], size["d"])
    params = leaf_params(method.init_params(cfg, size["d"], size["heads"], size["n"]))
    got = run(q, k, v, method.example, params, "torch")
    want = run(q, k, v, method.example, params, "reference")
    assert got[0].shape == q.shape and got[1].shape == q.shape[:3]
    assert_all_close(got, want, rtol=1e-10, atol=1e-10)
    assert all(g is not None and g.abs().sum() > 0 for g in got[2][:3]), "q, k and v all get gradients"
