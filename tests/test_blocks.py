"""full, topk and vsa: torch backend vs the dense fp64 reference on identical selections."""
import dataclasses

import pytest
import torch

import flexsparse as fs
from flexsparse.backends import BACKENDS
from flexsparse.methods.blocks import select_blocks
from flexsparse.methods.dense import block_select_bruteforce

from helpers import exhaustive_where, grads, qkv, rel_err

# the single-level block methods of the registry: a block-sparse branch configured by block_q, block_k and topk
BLOCK_METHODS = [name for name, method in fs.METHODS.items() if method.sparse_branch == "block"
                 and {"block_q", "block_k", "topk"} <= {f.name for f in dataclasses.fields(method.config)}]

CASES = [  # (N, block_q, block_k, heads, kv_heads, topk)
    (1, 4, 4, 2, 1, 1), (15, 4, 4, 2, 2, 2), (17, 8, 4, 4, 2, 3), (17, 4, 16, 1, 1, 1),
    (1000, 16, 16, 2, 1, 5), (1000, 64, 8, 2, 2, 7), (4097, 64, 64, 2, 1, 4),
]
CASES = exhaustive_where(CASES, lambda case: case[0] > 1000)


def run_both(q, k, v, cfg, params=None):
    outs = {}
    for backend in ("torch", "reference"):
        o, lse = fs.attention(q, k, v, cfg, backend=backend, return_lse=True, params=params)
        leaves = (q, k, v, *(params or {}).values())
        outs[backend] = (o, lse, grads([o, lse], leaves))
    return outs


@pytest.mark.parametrize("method", BLOCK_METHODS)
@pytest.mark.parametrize("n, block_q, block_k, heads, kv_heads, topk", CASES)
def test_block_methods_match_reference(method, n, block_q, block_k, heads, kv_heads, topk):
    q, k, v = qkv(heads=heads, kv_heads=kv_heads, n=n, d=8, requires_grad=True)
    cfg = {"method": method, "block_q": block_q, "block_k": block_k, "topk": topk}
    outs = run_both(q, k, v, cfg)
    (o_t, l_t, g_t), (o_r, l_r, g_r) = outs["torch"], outs["reference"]
    assert rel_err(o_t, o_r) < 1e-12 and rel_err(l_t, l_r) < 1e-12
    for a, b in zip(g_t, g_r):
        assert rel_err(a, b) < 1e-11


def test_vsa_gate_parameters_get_gradients():
    q, k, v = qkv(heads=2, kv_heads=1, n=100, d=8, requires_grad=True)
    cfg = {"method": "vsa", "block_size": 8, "topk": 3, "gate": True}
    attn = fs.SparseAttention(cfg, head_dim=8, num_heads=2).double()
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_()
    params = dict(attn.params.items())
    outs = run_both(q, k, v, cfg, params)
    (o_t, l_t, g_t), (o_r, l_r, g_r) = outs["torch"], outs["reference"]
    assert rel_err(o_t, o_r) < 1e-12 and rel_err(l_t, l_r) < 1e-12
    for a, b in zip(g_t, g_r):
        assert b.abs().sum() > 0 and rel_err(a, b) < 1e-11


def test_vsa_zero_gate_is_the_fine_branch():
    q, k, v = qkv(heads=2, n=100, d=8)
    attn = fs.SparseAttention({"method": "vsa", "block_size": 8, "topk": 3, "gate": True}, head_dim=8,
                              num_heads=2).double()
    fine = fs.attention(q, k, v, {"method": "topk", "block_size": 8, "topk": 3}, backend="torch")
    assert torch.equal(attn(q, k, v), fine)


def test_vsa_gate_needs_params_in_functional_api():
    q, k, v = qkv(n=64, d=8)
    with pytest.raises(ValueError, match="SparseAttention"):
        fs.attention(q, k, v, {"method": "vsa", "block_size": 8, "topk": 2, "gate": True})


@pytest.mark.parametrize("n, block_q, block_k, heads, kv_heads, topk", CASES)
def test_block_selection_matches_bruteforce(n, block_q, block_k, heads, kv_heads, topk):
    q, k, v = qkv(heads=heads, kv_heads=kv_heads, n=n, d=8)
    cfg = fs.Config.from_dict({"method": "topk", "block_q": block_q, "block_k": block_k, "topk": topk})
    sel = select_blocks(q, k, v, cfg, BACKENDS["torch"])
    assert torch.equal(sel.indices, block_select_bruteforce(q, k, topk, block_q, block_k).indices)


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_full_matches_reference_and_sdpa(kv_heads):
    q, k, v = qkv(heads=2, kv_heads=kv_heads, n=257, d=16, requires_grad=True)
    outs = run_both(q, k, v, {"method": "full"})
    (o_t, l_t, g_t), (o_r, l_r, g_r) = outs["torch"], outs["reference"]
    assert rel_err(o_t, o_r) < 1e-12 and rel_err(l_t, l_r) < 1e-12
    for a, b in zip(g_t, g_r):
        assert rel_err(a, b) < 1e-11


def test_topk_with_all_blocks_is_dense():
    q, k, v = qkv(heads=2, n=100, d=8)
    dense = fs.attention(q, k, v, {"method": "full"}, backend="reference")
    assert rel_err(fs.attention(q, k, v, {"method": "topk", "block_size": 8, "topk": 13}, backend="torch"),
                   dense) < 1e-12
