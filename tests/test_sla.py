"""SLA: torch backend vs the fp64 dense reference on identical selections, router, combine, errors."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flexsparse
from flexsparse.backends import BACKENDS, flex_backend
from flexsparse.config import Config
from flexsparse.masks import sla_block_counts
from flexsparse.methods import METHODS
from flexsparse.methods.dense import block_select_bruteforce, expand_kv_heads, span_means
from flexsparse.triton.block_sparse import naive as block_naive
from flexsparse.triton.linear import naive as linear_naive

from _sla_testing import assert_all_close, cast, cast_params, leaf_params, leaf_qkv, qkv_selecting_alike, run
from helpers import NewStorages, exhaustive_where, rel_err


def sla_config(**kw):
    return {"method": "sla", **kw}


SLA = METHODS["sla"]


def sla_select(q, k, cfg):
    """SLA's selection on the torch backend (critical blocks and negligible blocks; v and params unused)."""
    return SLA.select(q, k, None, cfg, BACKENDS["torch"], {})


def params_for(cfg, d, dtype=torch.float64):
    return leaf_params(SLA.init_params(Config.from_dict(cfg), d, 1, None), dtype)


# (B, H, Hk, N, D, config): every variant, ragged and exact lengths, GQA, separate block sizes.
CASES = [
    (1, 1, 1, 1, 8, sla_config(block_size=4, topk_ratio=0.5)),
    (2, 2, 1, 15, 8, sla_config(block_q=4, block_k=8, topk_ratio=0.5, negligible_ratio=0.0, feature_map="elu")),
    (1, 4, 2, 15, 4, sla_config(block_size=4, topk_ratio=0.25, negligible_ratio=0.25, feature_map="relu")),
    (2, 2, 2, 17, 8, sla_config(block_q=8, block_k=4, topk_ratio=0.3, linear="full")),
    (1, 2, 1, 17, 8, sla_config(block_q=4, block_k=16, topk_ratio=0.5, linear="full", feature_map="elu")),
    (1, 2, 1, 17, 8, sla_config(block_size=16, topk_ratio=0.5, negligible_ratio=0.5)),   # linear branch empty
    (1, 3, 1, 64, 8, sla_config(block_size=16, topk_ratio=0.25, negligible_ratio=0.5, feature_map="relu")),
    (1, 2, 1, 1000, 8, sla_config(block_q=16, block_k=8, topk_ratio=0.05, negligible_ratio=0.1)),
    (1, 2, 2, 1000, 8, sla_config(block_size=4, topk_ratio=0.05, linear="full", feature_map="relu")),
    (1, 2, 1, 4097, 8, sla_config(block_size=64, topk_ratio=0.05, negligible_ratio=0.1)),
]


@pytest.mark.parametrize("b,h,hk,n,d,cfg", exhaustive_where(CASES, lambda case: case[3] > 1000),
                         ids=[f"N{c[3]}-{i}" for i, c in enumerate(CASES)])
def test_torch_matches_reference_fp64(b, h, hk, n, d, cfg):
    q, k, v = leaf_qkv(b, h, hk, n, d)
    params = params_for(cfg, d)
    got = run(q, k, v, cfg, params, "torch")
    want = run(q, k, v, cfg, params, "reference")
    # The torch backend's masked linear branch is the global sums minus the skipped blocks; with relu's zeros
    # the remaining mass can be a tiny fraction of the global one, and the subtraction loses that factor
    # (|err| / (1 + |ref|) up to 2e-10 over 200 seeds of these cases, 2e-15 for the other feature maps).
    cancels = cfg.get("feature_map") == "relu" and cfg.get("linear", "masked") == "masked"
    tol = 1e-8 if cancels else 1e-10
    assert_all_close(got, want, rtol=tol, atol=tol)
    gq, gk, gv, _, gbias = got[2]                   # proj_weight's is 0 when the linear branch is empty
    assert all(g.abs().sum() > 0 for g in ((gq, gk, gv, gbias) if n > 1 else (gv, gbias)))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(1, 70), block_q=st.sampled_from([4, 8, 16]), block_k=st.sampled_from([4, 8, 16]),
       heads=st.sampled_from([(1, 1), (2, 1), (4, 2), (2, 2)]), linear=st.sampled_from(["masked", "full"]),
       feature_map=st.sampled_from(["softmax", "elu", "relu"]), topk_ratio=st.floats(0.05, 0.7),
       negligible=st.sampled_from([0.0, 0.2]), seed=st.integers(0, 1000))
def test_torch_matches_reference_random_configs(n, block_q, block_k, heads, linear, feature_map, topk_ratio,
                                                negligible, seed):
    negligible = negligible if linear == "masked" else 0.0
    cfg = sla_config(block_q=block_q, block_k=block_k, topk_ratio=topk_ratio, negligible_ratio=negligible,
                     linear=linear, feature_map=feature_map)
    torch.manual_seed(seed)
    q, k, v = leaf_qkv(1, heads[0], heads[1], n, 8, seed=seed)
    params = params_for(cfg, 8)
    # fp64, but the torch backend's masked branch is "global sum minus skipped blocks": with relu features a
    # row can keep a tiny fraction of the mass and lose digits to cancellation (seen: 2.8e-9 relative)
    assert_all_close(run(q, k, v, cfg, params, "torch"), run(q, k, v, cfg, params, "reference"),
                     rtol=1e-8, atol=1e-9)


@pytest.mark.parametrize("linear", ["masked", "full"])
def test_fp32_matches_fp64_reference(linear):
    cfg = sla_config(block_q=8, block_k=4, topk_ratio=0.2, linear=linear,
                     negligible_ratio=0.1 if linear == "masked" else 0.0)
    config = Config.from_dict(cfg)

    def select(q, k):
        selection = sla_select(q, k, config)
        return tuple(x for x in (selection.indices, selection.excluded) if x is not None)

    q, k, v = qkv_selecting_alike(select, 2, 4, 2, 203, 16)
    params = cast_params(params_for(cfg, 16), torch.float32)
    got = run(q, k, v, cfg, params, "torch")                         # reference: the same values in fp64
    want = run(*cast((q, k, v), torch.float64), cfg, cast_params(params, torch.float64), "reference")
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.float32
    assert_all_close(got, want, rtol=1e-4, atol=1e-4)


def test_bf16_close_to_fp64_reference():
    cfg = sla_config(block_size=16, topk_ratio=0.2, negligible_ratio=0.1)
    q, k, v = leaf_qkv(1, 2, 1, 300, 32, dtype=torch.bfloat16)
    params = params_for(cfg, 32)
    got = run(q, k, v, cfg, params, "torch")                         # reference: the same values in fp64
    want = run(*cast((q, k, v), torch.float64), cfg, params, "reference")
    assert got[0].dtype == torch.bfloat16
    assert rel_err(got[0], want[0]) < 2e-2
    assert rel_err(got[1], want[1]) < 1e-2
    for a, b in zip(got[2], want[2]):
        assert rel_err(a, b) < 3e-2


@pytest.mark.parametrize("n,block_q,block_k,heads", [(57, 8, 4, (2, 1)), (64, 16, 16, (2, 2)), (300, 4, 16, (4, 2))])
def test_selection_matches_bruteforce(n, block_q, block_k, heads):
    cfg = Config.from_dict(sla_config(block_q=block_q, block_k=block_k, topk_ratio=0.25, negligible_ratio=0.25))
    q, k, _ = leaf_qkv(2, heads[0], heads[1], n, 8)
    k = k + 3 * torch.randn(8, dtype=k.dtype)       # a large key mean: the raw-key router selects as the smoothed one
    selection = sla_select(q, k, cfg)
    tk = -(-n // block_k)
    topk, bottomk = sla_block_counts(0.25, 0.25, tk)
    assert selection.indices.dtype == torch.int32 and selection.indices.shape[-1] == topk
    want = block_select_bruteforce(q.detach(), k.detach(), topk, block_q, block_k, smooth_k=True)
    assert torch.equal(selection.indices, want.indices)
    kk = expand_kv_heads(k.detach(), heads[0])
    scores = span_means(q.detach(), block_q) @ span_means(kk - kk.mean(2, keepdim=True), block_k).transpose(-1, -2)
    bottom = scores.argsort(-1)[..., :bottomk].sort(-1).values
    assert torch.equal(selection.excluded.long(), bottom)


def test_selection_of_fp32_and_bf16_router_is_fp32():
    """The router pools and scores in fp32 whatever the input dtype: bf16 inputs select the same
    blocks as the fp32 copy of those bf16 values."""
    cfg = Config.from_dict(sla_config(block_size=8, topk_ratio=0.1))
    q, k, _ = leaf_qkv(1, 2, 2, 512, 64, dtype=torch.bfloat16)
    got = sla_select(q, k, cfg).indices
    want = sla_select(q.float(), k.float(), cfg).indices
    assert torch.equal(got, want)


@pytest.mark.parametrize("ratios,tk,want", [((0.05, 0.0, 20), 20, (1, 0)), ((0.29, 0.0, 100), 100, (29, 0)),
                                             ((0.01, 0.0, 10), 10, (1, 0)), ((0.3, 0.2, 10), 10, (3, 2)),
                                             ((0.5, 0.5, 1), 1, (1, 0))])
def test_block_counts(ratios, tk, want):
    assert sla_block_counts(ratios[0], ratios[1], ratios[2]) == want


@pytest.mark.exhaustive
def test_block_counts_trace_with_dynamic_sequence_lengths():
    """``torch.compile(fullgraph=True, dynamic=True)`` over two sequence lengths: the block counts are symbolic
    sizes there, so their ratio arithmetic must trace (``round`` of a symbolic float broke the graph); the
    compiled outputs equal eager ones."""
    module = flexsparse.SparseAttention({"method": "sla", "block_size": 16, "topk_ratio": 0.1, "negligible_ratio": 0.1},
                                        head_dim=16, num_heads=2, backend="torch")
    torch._dynamo.reset()
    compiled = torch.compile(module, fullgraph=True, dynamic=True)
    for n in (256, 336):
        q, k, v = (torch.randn(1, 2, n, 16) for _ in range(3))
        torch.testing.assert_close(compiled(q, k, v), module(q, k, v))


def test_block_counts_that_do_not_fit_raise():
    with pytest.raises(ValueError, match="negligible_ratio"):
        sla_block_counts(0.5, 0.6, 10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("linear", ["masked", "full"])
def test_fresh_module_is_exactly_the_sparse_branch(dtype, linear):
    cfg = sla_config(block_q=8, block_k=16, topk_ratio=0.25, linear=linear)
    module = flexsparse.SparseAttention(cfg, head_dim=16, num_heads=4, backend="torch")
    q, k, v = cast(leaf_qkv(2, 4, 2, 77, 16), dtype)
    out, lse = module(q, k, v, return_lse=True)
    sparse, sparse_lse = block_naive.block_sparse_attention(q, k, v, sla_select(q, k, module.config), 16 ** -0.5)
    assert torch.equal(out, sparse) and torch.equal(lse, sparse_lse)
    assert set(dict(module.named_parameters())) == {"params.proj_weight", "params.proj_bias"}
    assert all(p.dtype == torch.float32 and not p.any() for p in module.parameters())


def test_masked_and_full_differ_once_proj_is_nonzero():
    q, k, v = leaf_qkv(1, 2, 1, 96, 8)
    outs = {}
    for linear in ("masked", "full"):
        cfg = sla_config(block_size=8, topk_ratio=0.25, linear=linear)
        zero = {name: p.double() for name, p in SLA.init_params(Config.from_dict(cfg), 8, 2, None).items()}
        outs[linear, "zero"] = flexsparse.attention(q, k, v, cfg, backend="torch", params=zero)
        outs[linear, "proj"] = flexsparse.attention(q, k, v, cfg, backend="torch", params=params_for(cfg, 8))
    assert torch.equal(outs["masked", "zero"], outs["full", "zero"])
    assert rel_err(outs["masked", "proj"], outs["full", "proj"]) > 1e-2


def test_masked_linear_is_exactly_zero_when_every_block_is_skipped():
    cfg = Config.from_dict(sla_config(block_size=16, topk_ratio=0.5, negligible_ratio=0.5))
    q, k, v = leaf_qkv(1, 2, 1, 40, 8)                      # Tk = 3: 1 critical + 1 negligible ...
    sel = sla_select(q, k, cfg)
    assert sel.indices.shape[-1] + sel.excluded.shape[-1] == 2     # ... leaves one marginal block
    assert linear_naive.masked_linear_attention(q, k, v, sel, feature_map="softmax", eps=1e-5).abs().min() > 0
    full = Config.from_dict(sla_config(block_size=32, topk_ratio=0.5, negligible_ratio=0.5))
    sel = sla_select(q, k, full)                                    # Tk = 2: nothing left
    out = linear_naive.masked_linear_attention(q, k, v, sel, feature_map="softmax", eps=1e-5)
    assert torch.equal(out, torch.zeros_like(q))


def test_masked_linear_equals_block_sums_over_marginal_blocks():
    """Independent check of 'global minus skipped': phi(Q_i) sum_marginal h_j / (eps + phi(Q_i) sum_marginal z_j)."""
    cfg = Config.from_dict(sla_config(block_q=4, block_k=8, topk_ratio=0.3, negligible_ratio=0.25))
    q, k, v = (x.detach() for x in leaf_qkv(1, 2, 1, 30, 8))
    sel = sla_select(q, k, cfg)
    got = linear_naive.masked_linear_attention(q, k, v, sel, feature_map="elu", eps=1e-5)
    phi_q, phi_k = torch.nn.functional.elu(q) + 1, torch.nn.functional.elu(k) + 1
    want = torch.empty_like(q)
    for h in range(2):
        for i in range(sel.num_q_blocks):
            skipped = set(sel.indices[0, h, i].tolist()) | set(sel.excluded[0, h, i].tolist())
            keys = [t for t in range(30) if t // 8 not in skipped]
            hq = phi_q[0, h, i * 4:(i + 1) * 4]
            num = hq @ (phi_k[0, 0, keys].T @ v[0, 0, keys])
            want[0, h, i * 4:(i + 1) * 4] = num / (1e-5 + hq @ phi_k[0, 0, keys].sum(0, keepdim=True).T)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_long_sequence_has_no_quadratic_memory():
    """N = 131072: an N x N fp32 tensor would need 68 GB; the torch backend is O(N * K * block)."""
    cfg = sla_config(block_size=64, topk_ratio=0.002, negligible_ratio=0.002)
    q, k, v = (x.detach().float() for x in leaf_qkv(1, 1, 1, 131072, 8))
    params = {name: p for name, p in SLA.init_params(Config.from_dict(cfg), 8, 1, None).items()}
    params["proj_weight"] = torch.eye(8)
    with torch.no_grad(), NewStorages(q, k, v) as new:
        out = flexsparse.attention(q, k, v, cfg, backend="torch", params=params)
    assert out.shape == q.shape and torch.isfinite(out).all()
    assert max(size for _, size in new.allocated) < 2**30           # an N x N fp32 tensor: 64 GiB


def test_functional_call_needs_params():
    q, k, v = leaf_qkv(1, 1, 1, 16, 8)
    with pytest.raises(ValueError, match="SparseAttention"):
        flexsparse.attention(q, k, v, sla_config(block_size=4))


@pytest.mark.parametrize("bad,match", [
    ({"proj_weight": torch.zeros(8, 8)}, "missing \\['proj_bias'\\]"),
    ({"proj_weight": torch.zeros(8, 8), "proj_bias": torch.zeros(8), "gate": torch.zeros(1)}, "unknown \\['gate'\\]"),
    ({"proj_weight": torch.zeros(8, 4), "proj_bias": torch.zeros(8)}, "proj_weight.*shape \\(8, 8\\)"),
    ({"proj_weight": torch.zeros(8, 8), "proj_bias": [0.0] * 8}, "proj_bias.*torch.Tensor"),
])
def test_bad_params_raise(bad, match):
    q, k, v = leaf_qkv(1, 1, 1, 16, 8)
    with pytest.raises((ValueError, TypeError), match=match):
        flexsparse.attention(q, k, v, sla_config(block_size=4), params=bad)


@pytest.mark.parametrize("cfg,match", [
    (sla_config(topk_ratio=0.0), "topk_ratio"),
    (sla_config(negligible_ratio=0.1, linear="full"), "negligible_ratio"),
    (sla_config(topk_ratio=0.6, negligible_ratio=0.5), "negligible_ratio"),
    (sla_config(linear="dense"), "linear"),
    (sla_config(feature_map="hedgehog"), "feature_map"),
    (sla_config(block_size=8, block_q=4), "block_size"),
])
def test_bad_config_raises(cfg, match):
    with pytest.raises(ValueError, match=match):
        Config.from_dict(cfg)


def test_cross_attention_is_rejected():
    q, k, v = leaf_qkv(1, 1, 1, 16, 8)
    params = params_for(sla_config(), 8)
    with pytest.raises(ValueError, match="same length"):
        flexsparse.attention(q, k[:, :, :8], v[:, :, :8], sla_config(block_size=4), backend="torch", params=params)


def test_lse_is_natural_log_of_the_sparse_branch():
    cfg = Config.from_dict(sla_config(block_size=4, topk_ratio=0.5))
    q, k, v = (x.detach() for x in leaf_qkv(1, 1, 1, 12, 8))
    _, lse = flexsparse.attention(q, k, v, cfg, backend="torch", return_lse=True, params=params_for(cfg.to_dict(), 8))
    sel = sla_select(q, k, cfg)
    for i in range(12):
        keys = [t for t in range(12) if t // 4 in sel.indices[0, 0, i // 4].tolist()]
        want = torch.logsumexp(q[0, 0, i] @ k[0, 0, keys].T / math.sqrt(8), dim=0)
        torch.testing.assert_close(lse[0, 0, i], want, rtol=1e-12, atol=1e-12)


def test_dense_block_form_of_the_masked_linear_branch_matches_the_gather_form():
    from helpers import qkv

    q, k, v = qkv(heads=4, kv_heads=2, n=333, d=8)
    for negligible in (0.0, 0.2):
        cfg = flexsparse.Config.from_dict({"method": "sla", "block_q": 16, "block_k": 32, "topk_ratio": 0.3,
                                           "negligible_ratio": negligible})
        selection = sla_select(q, k, cfg)
        for fmap in ("softmax", "elu", "relu"):
            a = linear_naive.masked_linear_attention(q, k, v, selection, feature_map=fmap, eps=1e-5)
            b = flex_backend.masked_linear_attention_dense_blocks(q, k, v, selection, feature_map=fmap, eps=1e-5)
            assert rel_err(b, a) < 1e-10


def test_dense_block_form_in_bf16_is_close_to_fp64_with_gradients():
    """bf16 inputs: the block-level state matmuls run in bf16 (fp32 accumulation); output and gradients stay
    within bf16 tolerance of the fp64 gather form."""
    from helpers import qkv

    q, k, v = qkv(heads=4, kv_heads=2, n=333, d=16)
    cfg = flexsparse.Config.from_dict({"method": "sla", "block_q": 16, "block_k": 32, "topk_ratio": 0.3})
    selection = sla_select(q, k, cfg)
    grad = torch.randn_like(q)
    results = []
    for dtype, form in ((torch.float64, linear_naive.masked_linear_attention),
                        (torch.bfloat16, flex_backend.masked_linear_attention_dense_blocks)):
        leaves = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
        out = form(*leaves, selection, feature_map="softmax", eps=1e-5)
        assert out.dtype == dtype
        out.backward(grad.to(dtype))
        results.append([out.double(), *(x.grad.double() for x in leaves)])
    for name, want, got in zip(("out", "dq", "dk", "dv"), *results):
        assert 0 < rel_err(got, want) < 2e-2, name


def test_dense_block_form_compiles_without_graph_breaks():
    """The function the flex backend compiles on CUDA traces as one graph (``fullgraph=True``) and the compiled
    forward and backward match eager in fp32 (here on the CPU inductor backend)."""
    from helpers import qkv

    q, k, v = qkv(heads=4, kv_heads=2, n=333, d=16, dtype=torch.float32)
    cfg = flexsparse.Config.from_dict({"method": "sla", "block_q": 16, "block_k": 32, "topk_ratio": 0.3,
                                       "negligible_ratio": 0.1})
    selection = sla_select(q, k, cfg)
    args = (linear_naive.skipped_blocks(selection), selection.num_k_blocks, 16, 32, "softmax", 1e-5)
    compiled = torch.compile(linear_naive.keep_weighted_linear, dynamic=False, fullgraph=True)
    grad = torch.randn_like(q)
    results = []
    for fn in (compiled, linear_naive.keep_weighted_linear):
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        out = fn(*leaves, *args)
        out.backward(grad)
        results.append([out.detach(), *(x.grad for x in leaves)])
    for name, got, want in zip(("out", "dq", "dk", "dv"), *results):
        assert rel_err(got, want) < 1e-5, name


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_compiled_dense_block_form_matches_eager_and_does_not_recompile_per_selection(dtype):
    """On CUDA the flex backend's masked linear branch runs compiled: output and gradients match the eager
    block-level form (and, loosely, the fp64 gather form); a new selection of the same shape reuses the graph."""
    from helpers import qkv

    q, k, v = (x.cuda() for x in qkv(heads=4, kv_heads=2, n=1000, d=64))
    grad = torch.randn_like(q)
    for step in range(2):
        cfg = flexsparse.Config.from_dict({"method": "sla", "block_size": 64, "topk_ratio": 0.25,
                                           "negligible_ratio": 0.1})
        selection = sla_select(q + step * torch.randn_like(q), k, cfg)
        frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        results = []
        for precision, run_form in ((torch.float64, "gather"), (dtype, "compiled"), (dtype, "eager")):
            leaves = [x.detach().to(precision).requires_grad_() for x in (q, k, v)]
            if run_form == "gather":
                out = linear_naive.masked_linear_attention(*leaves, selection, feature_map="softmax", eps=1e-5)
            elif run_form == "compiled":
                out = flex_backend.masked_linear_attention_dense_blocks(*leaves, selection,
                                                                        feature_map="softmax", eps=1e-5)
            else:
                out = linear_naive.keep_weighted_linear(*leaves, linear_naive.skipped_blocks(selection),
                                                        selection.num_k_blocks, 64, 64, "softmax", 1e-5)
            out.backward(grad.to(precision))
            results.append([out.double(), *(x.grad.double() for x in leaves)])
        if step == 1:
            assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames, "recompiled for a new selection"
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
        for name, want, got, eager in zip(("out", "dq", "dk", "dv"), *results):
            assert 0 < rel_err(got, want) < tol, name
            assert rel_err(got, eager) < tol / 2, name
