"""LLSA: selection vs brute force, torch backend vs the dense fp64 reference (outputs, LSE, gradients)."""
import pytest
import torch

import flexsparse as fs
from flexsparse.masks import auto_levels, num_blocks
from flexsparse.masks.levels import fewest_candidates, level_span
from flexsparse.methods.dense import span_means
from flexsparse.methods.llsa.method import plan
from flexsparse.methods.llsa.reference import llsa_dense, llsa_select_bruteforce
from flexsparse.triton.llsa.naive import llsa_attention
from flexsparse.triton.pooling.naive import pool_pyramid
from flexsparse.triton.selection.naive import llsa_topk

import triton_support as ts
from helpers import exhaustive_where, grads, qkv, rel_err


def valid_topk(n, block, levels, want, top=None):
    """Largest per-level K <= want that the config checks accept at length n (the top level's at most ``top``)."""
    topk = [0] * levels
    topk[-1] = min(want if top is None else top, num_blocks(n, block**levels))
    for level in range(levels - 2, -1, -1):
        topk[level] = min(want, fewest_candidates(n, block, level + 1, topk[level + 1]))
    return topk


def config(n, block, levels, want=3):
    return {"method": "llsa", "block_size": block, "levels": levels, "topk": valid_topk(n, block, levels, want)}


def selection_for(q, k, cfg):
    cfg = fs.Config.from_dict(cfg)
    levels, topk = plan(cfg, q.shape[2])
    return llsa_topk(q, k, topk, cfg.block_size)


CASES = [  # (N, block, levels, heads, kv_heads, D)
    (1, 4, 1, 2, 1, 8), (15, 4, 2, 2, 2, 8), (17, 4, 2, 4, 2, 8), (17, 8, 1, 1, 1, 8),
    (1000, 4, 4, 2, 1, 16), (1000, 8, 3, 2, 2, 16), (1000, 16, 2, 2, 1, 16),
    (4097, 16, 2, 2, 2, 16), (4097, 64, 1, 1, 1, 16), (4097, 8, 3, 2, 1, 16),
]
CASES = exhaustive_where(CASES, lambda case: case[0] > 1000)


@pytest.mark.parametrize("n, block, levels, heads, kv_heads, d", CASES)
def test_torch_matches_reference_fp64(n, block, levels, heads, kv_heads, d):
    q, k, v = qkv(batch=2, heads=heads, kv_heads=kv_heads, n=n, d=d, requires_grad=True)
    cfg = config(n, block, levels)
    o_t, lse_t = fs.attention(q, k, v, cfg, backend="torch", return_lse=True)
    o_r, lse_r = fs.attention(q, k, v, cfg, backend="reference", return_lse=True)
    assert rel_err(o_t, o_r) < 1e-12
    assert rel_err(lse_t, lse_r) < 1e-12
    for g_t, g_r in zip(grads([o_t, lse_t], (q, k, v)), grads([o_r, lse_r], (q, k, v))):
        assert rel_err(g_t, g_r) < 1e-11


@pytest.mark.parametrize("n, block, levels", [(64, 64, 4), (70, 4, 6), (37, 2, 32), (50, 65536, 3)])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_levels_past_the_sequence_match_reference_fp64(n, block, levels, backend):
    """Levels whose spans ``b^l`` reach past N hold one token (the mean of all N, weight ln N), padded to no more
    than the sequence: the torch backend and the triton backend's PyTorch bodies (fp64) against the reference."""
    q, k, v = qkv(batch=1, heads=2, kv_heads=1, n=n, d=8, requires_grad=True)
    cfg = config(n, block, levels)
    with ts.triton_ops_on_cpu():
        o_t, lse_t = fs.attention(q, k, v, cfg, backend=backend, return_lse=True)
    o_r, lse_r = fs.attention(q, k, v, cfg, backend="reference", return_lse=True)
    assert rel_err(o_t, o_r) < 1e-12 and rel_err(lse_t, lse_r) < 1e-12
    for g_t, g_r in zip(grads([o_t, lse_t], (q, k, v)), grads([o_r, lse_r], (q, k, v))):
        assert rel_err(g_t, g_r) < 1e-11


@pytest.mark.parametrize("n, block, levels, heads, kv_heads, d", CASES)
def test_selection_matches_bruteforce(n, block, levels, heads, kv_heads, d):
    q, k, _ = qkv(batch=2, heads=heads, kv_heads=kv_heads, n=n, d=d)
    cfg = config(n, block, levels)
    sel = selection_for(q, k, cfg)
    ref = llsa_select_bruteforce(q, k, tuple(cfg["topk"]), block)
    assert sel.levels == levels
    for a, b in zip(sel.indices, ref.indices):
        assert a.dtype == torch.int32 and torch.equal(a, b)
        assert torch.all(a[..., 1:] > a[..., :-1]), "indices must be ascending and distinct"


@pytest.mark.parametrize("n, block, levels", [(1024, 16, 2), (1000, 16, 2), (300, 4, 3), (257, 16, 2), (61, 3, 3)])
def test_every_k_up_to_the_fewest_candidates_fills_its_rows(n, block, levels, monkeypatch):
    """With the top level's K below its tokens, K_l at its bound (the fewest level-l tokens under K_{l+1} parents, the
    ragged last one among them when there is one; below the level's tokens) is accepted and the selection equals
    brute force, every row distinct; one more is clamped back to the bound with a warning naming 'topk[0]'."""
    tight = valid_topk(n, block, levels, want=n, top=min(2, num_blocks(n, level_span(n, block, levels)) - 1))
    assert tight[0] < num_blocks(n, block)
    q, k, _ = qkv(batch=1, heads=2, kv_heads=1, n=n, d=8)
    cfg = {"method": "llsa", "block_size": block, "levels": levels, "topk": tight}
    assert plan(fs.Config.from_dict(cfg), n) == (levels, tuple(tight))
    sel = selection_for(q, k, cfg)
    for a, b in zip(sel.indices, llsa_select_bruteforce(q, k, tuple(tight), block).indices):
        assert torch.equal(a, b) and torch.all(a[..., 1:] > a[..., :-1])
    monkeypatch.setattr(fs._checks, "_CLAMPED", set())                   # each clamp warns once per process
    with pytest.warns(UserWarning, match=rf"'topk\[0\]'={tight[0] + 1} covers all {tight[0]} .*clamped to {tight[0]}"):
        assert plan(fs.Config.from_dict({**cfg, "topk": [tight[0] + 1, *tight[1:]]}), n)[1] == tuple(tight)


def test_a_parent_set_without_a_ragged_token_offers_all_its_children():
    """N = 1024, b = 32: one level-2 token with 32 full children, so K_1 = 9 under K_2 = 1 is legal."""
    assert plan(fs.Config.from_dict({"method": "llsa", "block_size": 32, "levels": 2, "topk": [9, 1]}), 1024) == \
        (2, (9, 1))


@pytest.mark.parametrize("n, block, levels", [(300, 4, 3), (257, 16, 2), (1000, 8, 2)])
def test_pooled_leaves_get_the_level_weights(n, block, levels):
    """Gradients w.r.t. pooled K/V as independent leaves: catches a missing or wrong level weight."""
    q, k, v = qkv(heads=2, kv_heads=1, n=n, d=8, requires_grad=True)
    sel = selection_for(q, k, config(n, block, levels))
    k_lv = [torch.randn_like(x, requires_grad=True) for x in pool_pyramid(k.detach(), block, levels)]
    v_lv = [torch.randn_like(x, requires_grad=True) for x in pool_pyramid(v.detach(), block, levels)]
    scale = 8**-0.5
    o_t, lse_t = llsa_attention(q, [k, *k_lv], [v, *v_lv], sel, scale)
    o_r, lse_r = llsa_dense(q, k, v, sel, scale, k_lv, v_lv)
    assert rel_err(o_t, o_r) < 1e-12
    leaves = (q, k, v, *k_lv, *v_lv)
    for g_t, g_r in zip(grads([o_t, lse_t], leaves), grads([o_r, lse_r], leaves)):
        assert g_r.abs().sum() > 0
        assert rel_err(g_t, g_r) < 1e-11


def test_level_weight_is_ln_count():
    """One query attending only the top level of a single full block: weights b^L cancel; a ragged
    top token carries ln(count) exactly."""
    n, block = 6, 4  # level-1 tokens cover 4 and 2 fine tokens
    q, k, v = qkv(batch=1, heads=1, n=n, d=4)
    sel = selection_for(q, k, {"method": "llsa", "block_size": block, "topk": 1, "levels": 1})
    o, lse = llsa_dense(q, k, v, sel, 0.5)
    means_k, means_v = span_means(k, 4), span_means(v, 4)
    for i in range(n):
        chosen = sel.indices[0][0, 0, i // block, 0].item()
        fine = range(chosen * block, min(n, chosen * block + block))
        logits = [0.5 * (q[0, 0, i] @ k[0, 0, j]) for j in fine]
        logits += [0.5 * (q[0, 0, i] @ means_k[0, 0, t]) + torch.log(torch.tensor(float(c), dtype=q.dtype))
                   for t, c in ((0, 4), (1, 2))]
        logits = torch.stack(logits)
        assert torch.allclose(lse[0, 0, i], torch.logsumexp(logits, 0))
        p = torch.softmax(logits, 0)
        expect = (sum(p[j] * v[0, 0, f] for j, f in enumerate(fine)) + p[-2] * means_v[0, 0, 0]
                  + p[-1] * means_v[0, 0, 1])
        assert torch.allclose(o[0, 0, i], expect)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
def test_low_precision_close_to_fp64(dtype, tol):
    q, k, v = qkv(heads=2, kv_heads=1, n=1000, d=32)
    cfg = config(1000, 8, 2, want=4)
    sel = selection_for(q, k, cfg)
    o_r, lse_r = llsa_dense(q, k, v, sel, 32**-0.5)
    lows = [x.to(dtype).requires_grad_() for x in (q, k, v)]
    o, lse = llsa_attention(lows[0], [lows[1], *pool_pyramid(lows[1], 8, 2)],
                            [lows[2], *pool_pyramid(lows[2], 8, 2)], sel, 32**-0.5)
    assert o.dtype == dtype and lse.dtype == torch.float32
    assert rel_err(o, o_r) < tol and rel_err(lse, lse_r) < tol
    o.float().square().sum().backward()
    assert all(torch.isfinite(x.grad).all() for x in lows)


def test_ties_go_to_the_smallest_index():
    n, block, d = 64, 4, 8
    q, k, v = qkv(batch=1, heads=1, n=n, d=d)
    k = k[:, :, :block].repeat(1, 1, n // block, 1)   # every key block identical: all scores tie
    sel = selection_for(q, k, {"method": "llsa", "block_size": block, "topk": 2, "levels": 2})
    assert torch.equal(sel.indices[1][0, 0], torch.tensor([[0, 1]] * 4, dtype=torch.int32))
    # level-1 candidates are children of {0, 1}: tokens 0..7; ties -> 0 and 1
    assert torch.equal(sel.indices[0][0, 0], torch.tensor([[0, 1]] * 16, dtype=torch.int32))


def test_auto_levels_keep_the_top_level_small():
    for n, expect in [(1, 1), (4096, 1), (4097, 2), (16384, 2), (65536, 2), (65537, 3), (262144, 3)]:
        assert auto_levels(n, 16, 1) == expect, n
    assert auto_levels(4097 * 16, 16, 17) == 3   # 3 levels leave 17 top tokens: enough for K=17
    assert auto_levels(4097 * 16, 16, 18) == 2 and auto_levels(1 << 20, 16, 8) == 3
    assert auto_levels(300, 4, 100) == 1


def test_module_and_functional_agree():
    q, k, v = qkv(heads=2, n=100, d=8)
    cfg = config(100, 4, 2)
    attn = fs.SparseAttention(cfg, head_dim=8, num_heads=2, backend="torch")
    assert len(list(attn.parameters())) == 0
    assert torch.equal(attn(q, k, v), fs.attention(q, k, v, cfg, backend="torch"))


@pytest.mark.exhaustive
def test_compiles_with_dynamic_sequence_lengths():
    """``torch.compile(fullgraph=True, dynamic=True)`` over lengths with the same levels and a ragged one: the
    pyramid and selection arithmetic traces with symbolic sizes, and the outputs equal eager ones."""
    module = fs.SparseAttention({"method": "llsa", "block_size": 16, "topk": 2, "levels": 2}, head_dim=16,
                                num_heads=2, backend="torch")
    torch._dynamo.reset()
    compiled = torch.compile(module, fullgraph=True, dynamic=True)
    for n in (288, 400, 333):
        q, k, v = (torch.randn(1, 2, n, 16) for _ in range(3))
        torch.testing.assert_close(compiled(q, k, v), module(q, k, v))
