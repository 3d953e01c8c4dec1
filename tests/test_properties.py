"""Property-based tests: random shapes and configs, torch backend == fp64 reference (values, LSE and the
gradients of q, k, v and of the learned parameters)."""
import dataclasses

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flexsparse as fs
from flexsparse.masks import num_blocks

from helpers import draw_level_topk, qkv, rel_err

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# the single-level block methods of the registry: a block-sparse branch configured by block_q, block_k and topk
BLOCK_METHODS = [name for name, method in fs.METHODS.items() if method.sparse_branch == "block"
                 and {"block_q", "block_k", "topk"} <= {f.name for f in dataclasses.fields(method.config)}]


@st.composite
def llsa_cases(draw):
    n = draw(st.integers(1, 400))
    block = draw(st.sampled_from([2, 3, 4, 8]))
    levels = draw(st.integers(1, 3))
    top = draw_level_topk(draw, n, block, levels)
    kv_heads = draw(st.sampled_from([1, 2]))
    heads = kv_heads * draw(st.sampled_from([1, 2]))
    return n, {"method": "llsa", "block_size": block, "levels": levels, "topk": top}, heads, kv_heads


@st.composite
def block_cases(draw):
    n = draw(st.integers(1, 400))
    block_q, block_k = draw(st.sampled_from([1, 4, 16])), draw(st.sampled_from([2, 8, 32]))
    topk = draw(st.integers(1, num_blocks(n, block_k)))
    kv_heads = draw(st.sampled_from([1, 2]))
    heads = kv_heads * draw(st.sampled_from([1, 3]))
    method = draw(st.sampled_from(BLOCK_METHODS))
    return n, {"method": method, "block_q": block_q, "block_k": block_k, "topk": topk}, heads, kv_heads


@st.composite
def sla_cases(draw):
    """SLA and SLA2 configs (every linear mode, feature map and router; the learned parameters moved off their
    initial values so that each one changes the output)."""
    n = draw(st.integers(1, 300))
    block_q, block_k = draw(st.sampled_from([4, 8, 16])), draw(st.sampled_from([4, 8, 16]))
    cfg = {"method": draw(st.sampled_from(["sla", "sla2"])), "block_q": block_q, "block_k": block_k,
           "topk_ratio": draw(st.sampled_from([0.05, 0.25, 0.5, 0.8])),
           "feature_map": draw(st.sampled_from(["softmax", "elu", "relu"]))}
    if cfg["method"] == "sla":
        cfg["linear"] = draw(st.sampled_from(["masked", "full"]))
        if cfg["linear"] == "masked":
            cfg["negligible_ratio"] = draw(st.sampled_from([0.0, 0.2]))
    else:
        cfg.update(alpha_per_head=draw(st.booleans()), smooth_k=draw(st.sampled_from(["all", "router"])),
                   router=draw(st.sampled_from(["hard", "soft"])))
    kv_heads = draw(st.sampled_from([1, 2]))
    heads = kv_heads * draw(st.sampled_from([1, 2]))
    return n, cfg, heads, kv_heads


def check(case):
    n, cfg, heads, kv_heads = case
    q, k, v = qkv(batch=1, heads=heads, kv_heads=kv_heads, n=n, d=4, requires_grad=True)
    o_t, l_t = fs.attention(q, k, v, cfg, backend="torch", return_lse=True)
    o_r, l_r = fs.attention(q, k, v, cfg, backend="reference", return_lse=True)
    assert rel_err(o_t, o_r) < 1e-12 and rel_err(l_t, l_r) < 1e-12
    g_t = torch.autograd.grad((o_t * o_r.detach()).sum() + l_t.sum(), (q, k, v))
    g_r = torch.autograd.grad((o_r * o_r.detach()).sum() + l_r.sum(), (q, k, v))
    for a, b in zip(g_t, g_r):
        assert rel_err(a, b) < 1e-10


@SETTINGS
@given(llsa_cases())
def test_llsa_any_shape(case):
    check(case)


@SETTINGS
@given(block_cases())
def test_block_methods_any_shape(case):
    check(case)


@SETTINGS
@given(sla_cases())
def test_sla_family_any_shape(case):
    n, cfg, heads, kv_heads = case
    d = 8
    init = fs.SparseAttention(cfg, head_dim=d, num_heads=heads, seq_len=n, backend="reference").params
    params = {name: (p.detach().double() + 0.3 * torch.randn_like(p, dtype=torch.float64)).requires_grad_()
              for name, p in init.items()}
    q, k, v = qkv(batch=1, heads=heads, kv_heads=kv_heads, n=n, d=d, requires_grad=True)
    leaves = (q, k, v, *params.values())
    results = []
    for backend in ("torch", "reference"):
        o, lse = fs.attention(q, k, v, cfg, backend=backend, return_lse=True, params=params)
        gen = torch.Generator().manual_seed(1)
        loss = (o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum() + (lse * torch.randn(
            lse.shape, generator=gen, dtype=lse.dtype)).sum()
        results.append((o, lse, torch.autograd.grad(loss, leaves, allow_unused=True)))  # a hard router: none
    (o_t, l_t, g_t), (o_r, l_r, g_r) = results
    # relu features can sum to ~0 under the masked branch's total-minus-kept form: a small denominator amplifies
    # the rounding of the subtraction (test_sla.py bounds the same cancellation)
    tol = 1e-8 if cfg["feature_map"] == "relu" else 1e-11
    assert rel_err(o_t, o_r) < tol and rel_err(l_t, l_r) < tol
    for name, a, b in zip(("q", "k", "v", *params), g_t, g_r):
        assert (a is None) == (b is None), name
        assert a is None or rel_err(a, b) < 10 * tol, name
