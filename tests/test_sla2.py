"""SLA2: SoftTop-k, learnable router, torch backend vs the fp64 dense reference (hard and soft), alpha."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flexsparse
from flexsparse.backends import BACKENDS
from flexsparse.config import Config
from flexsparse.masks import SoftBlockMask
from flexsparse.methods import METHODS
from flexsparse.methods.dense import block_select_bruteforce, expand_kv_heads, span_means
from flexsparse.methods.sla2 import router as sla2_router
from flexsparse.methods.sla2.method import alpha_logits_at
from flexsparse.methods.sla2.softtopk import soft_topk, soft_topk_logits
from flexsparse.triton.block_sparse import naive as block_naive
from flexsparse.triton.linear import naive as linear_naive
from flexsparse.triton.pooling.naive import key_mean

from _sla_testing import assert_all_close, cast, cast_params, leaf_params, leaf_qkv, qkv_selecting_alike, run
from helpers import exhaustive_where, rel_err


def sla2_config(**kw):
    return {"method": "sla2", **kw}


SLA2 = METHODS["sla2"]
TORCH = BACKENDS["torch"]


def route(q, k, cfg, proj_q, proj_k):
    """SLA2's router on the torch backend: the hard selection or the SoftTop-k mask."""
    return sla2_router.route(q, k, cfg, TORCH, proj_q, proj_k)


def smoothed_keys(k, k_mean):
    return sla2_router.smoothed_keys(k, k_mean, TORCH)


def params_for(cfg, d, heads, n, dtype=torch.float64, noise=0.3):
    return leaf_params(SLA2.init_params(Config.from_dict(cfg), d, heads, n), dtype, noise)


# ----------------------------------------------------------------------------------- SoftTop-k

@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 4), n=st.integers(1, 300), frac=st.floats(0.0, 1.0), tau=st.floats(0.01, 1.0),
       spread=st.floats(0.1, 10.0), seed=st.integers(0, 10_000))
def test_softtopk_rows_sum_to_count(rows, n, frac, tau, spread, seed):
    count = max(1, min(n, round(frac * n)))
    scores = spread * torch.randn(rows, n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    mask = soft_topk(scores, count, tau, 30)
    assert ((mask >= 0) & (mask <= 1)).all()
    torch.testing.assert_close(mask.sum(-1), torch.full((rows,), float(count), dtype=torch.float64),
                               rtol=0, atol=1e-6)


def test_softtopk_fp32_rows_sum_to_count():
    scores = torch.randn(64, 200).softmax(-1)
    mask = soft_topk(scores, 10, 0.1, 30)
    assert mask.dtype == torch.float32
    torch.testing.assert_close(mask.sum(-1), torch.full((64,), 10.0), rtol=0, atol=1e-4)


@pytest.mark.parametrize("count,tau", [(1, 1.0), (2, 0.5), (5, 0.1)])
def test_softtopk_gradcheck(count, tau):
    scores = torch.randn(3, 7, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda s: soft_topk(s, count, tau, 40), (scores,))


def test_softtopk_row_sums_have_zero_gradient_and_order_is_kept():
    scores = torch.randn(4, 9, dtype=torch.float64, requires_grad=True)
    mask = soft_topk(scores, 3, 0.2, 30)
    (grad,) = torch.autograd.grad(mask.sum(), scores)
    assert grad.abs().max() < 1e-12
    assert (mask.gather(-1, scores.argsort(-1)).diff(dim=-1) >= 0).all()


def test_softtopk_tends_to_hard_topk_and_full_count_is_all_ones():
    scores = torch.randn(5, 12, dtype=torch.float64)
    hard = torch.zeros_like(scores).scatter_(-1, scores.topk(4, -1).indices, 1.0)
    torch.testing.assert_close(soft_topk(scores, 4, 1e-9, 80), hard, rtol=0, atol=1e-8)
    assert torch.equal(soft_topk(scores, 12, 0.1, 30), torch.ones_like(scores))


@pytest.mark.parametrize("count,tau", [(0, 0.1), (13, 0.1), (3, 0.0)])
def test_softtopk_bad_arguments_raise(count, tau):
    with pytest.raises(ValueError, match="count" if tau else "tau"):
        soft_topk_logits(torch.randn(2, 12), count, tau, 30)


# ----------------------------------------------------------------------------------- params, router

def test_init_params():
    cfg = Config.from_dict(sla2_config(block_q=16, alpha_init=0.7))
    p = SLA2.init_params(cfg, 8, 4, 33)
    assert set(p) == {"proj_q", "proj_k", "alpha_logit"}
    assert torch.equal(p["proj_q"], torch.eye(8)) and torch.equal(p["proj_k"], torch.eye(8))
    assert p["alpha_logit"].shape == (1, 3) and p["alpha_logit"].dtype == torch.float32
    torch.testing.assert_close(torch.sigmoid(p["alpha_logit"]), torch.full((1, 3), 0.7))
    assert SLA2.init_params(cfg.replace(alpha_per_head=True), 8, 4, 33)["alpha_logit"].shape == (4, 3)
    with pytest.raises(ValueError, match="seq_len"):
        SLA2.init_params(cfg, 8, 4, None)
    with pytest.raises(ValueError, match="seq_len"):
        flexsparse.SparseAttention(cfg, head_dim=8, num_heads=4)


@pytest.mark.parametrize("smooth_k", ["all", "router"])
@pytest.mark.parametrize("n,block_q,block_k,heads", [(57, 8, 4, (2, 1)), (300, 16, 8, (4, 2))])
def test_untrained_router_equals_sla_selection(smooth_k, n, block_q, block_k, heads):
    cfg = Config.from_dict(sla2_config(block_q=block_q, block_k=block_k, topk_ratio=0.2, smooth_k=smooth_k))
    q, k, _ = (x.detach() for x in leaf_qkv(2, heads[0], heads[1], n, 8))
    k = k + 3 * torch.randn(8, dtype=k.dtype)
    p = SLA2.init_params(cfg, 8, heads[0], n)
    got = route(q, k, cfg, p["proj_q"], p["proj_k"])
    want = METHODS["sla"].select(q, k, None, Config.from_dict({"method": "sla", "block_q": block_q,
                                                                "block_k": block_k, "topk_ratio": 0.2}), TORCH, {})
    assert torch.equal(got.indices, want.indices)


@pytest.mark.parametrize("smooth_k", ["all", "router"])
def test_trained_hard_router_matches_bruteforce(smooth_k):
    cfg = Config.from_dict(sla2_config(block_q=8, block_k=4, topk_ratio=0.25, smooth_k=smooth_k))
    q, k, _ = (x.detach() for x in leaf_qkv(2, 4, 2, 70, 8))
    k = k + 2 * torch.randn(8, dtype=k.dtype)
    p = params_for(cfg.to_dict(), 8, 4, 70, noise=0.5)
    wq, wk = p["proj_q"].detach(), p["proj_k"].detach()
    got = route(q, k, cfg, wq, wk)
    want = block_select_bruteforce(q @ wq.T, k @ wk.T, 4, 8, 4, smooth_k=True)
    assert torch.equal(got.indices, want.indices)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_smoothed_keys_round_once_and_differentiate_the_whole_map(dtype):
    """``k - mean_N k`` in one pass equals the fp32 difference rounded once; its gradient is ``g - mean_N g``
    (the mean's dependence on k included, not counted twice)."""
    k = (5 + 2 * torch.randn(2, 3, 37, 8)).to(dtype).requires_grad_()
    got = smoothed_keys(k, key_mean(k))
    assert got.dtype == dtype
    assert torch.equal(got, (k.detach().float() - key_mean(k.detach())).to(dtype))
    grad = torch.randn(got.shape)
    got.backward(grad.to(dtype))
    k64 = k.detach().double().requires_grad_()
    (k64 - k64.mean(2, keepdim=True)).backward(grad.to(dtype).double())
    assert rel_err(k.grad.double(), k64.grad) < (1e-6 if dtype == torch.float32 else 1e-2)
    assert rel_err(k.grad.double(), grad.double()) > 1e-2          # the mean's share is there and matters
    x = torch.randn(1, 2, 9, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: smoothed_keys(t, key_mean(t)), (x,))


def test_smoothed_keys_compile_fullgraph_with_backward():
    k = torch.randn(1, 2, 33, 8, requires_grad=True)
    fn = torch.compile(lambda t: smoothed_keys(t, key_mean(t)).square().sum(), fullgraph=True, backend="aot_eager")
    fn(k).backward()
    k2 = k.detach().clone().requires_grad_()
    (k2 - k2.mean(2, keepdim=True)).square().sum().backward()
    torch.testing.assert_close(k.grad, k2.grad)


@pytest.mark.parametrize("router", ["hard", "soft"])
def test_backward_makes_no_zero_block_sum_gradient(router, monkeypatch):
    """Both branches on the smoothed keys (``smooth_k="all"``, the mean from the pooled block sums): the smoothing
    mean reaches ``_SmoothedKeys`` detached, so with the hard router (no gradient to the router either) the backward
    runs no block-sum gradient pass, which would broadcast zeros over k and add them to its gradient; the soft
    router's gradient to the pooled keys does run one."""
    from flexsparse.methods.sla2 import router as sla2_router
    from flexsparse.triton.pooling import naive as pooling
    calls, means = [], []
    backward, smoothing = pooling._BlockSums.backward, sla2_router._SmoothedKeys.apply

    def counted(ctx, grad):
        calls.append(float(grad.abs().sum()))
        return backward(ctx, grad)

    monkeypatch.setattr(pooling._BlockSums, "backward", staticmethod(counted))
    monkeypatch.setattr(sla2_router._SmoothedKeys, "apply", lambda k, mean, backend: means.append(
        mean.requires_grad) or smoothing(k, mean, backend))
    cfg = sla2_config(block_size=8, topk_ratio=0.25, router=router, smooth_k="all")
    q, k, v = leaf_qkv(1, 2, 1, 48, 8)
    flexsparse.attention(q, k, v, cfg, backend="torch", params=params_for(cfg, 8, 2, 48)).sum().backward()
    assert means == [False]
    if router == "hard":
        assert calls == []
    else:
        assert calls and all(total > 0 for total in calls)


@pytest.mark.parametrize("router_softmax", [True, False])
def test_soft_router_mask(router_softmax):
    """M = SoftTop-k(softmax(proj_q(Qbar) proj_k(Kbar)^T / sqrt(D))), rows summing to the hard count."""
    cfg = Config.from_dict(sla2_config(block_q=8, block_k=4, topk_ratio=0.25, router="soft", smooth_k="router",
                                       router_softmax=router_softmax))
    q, k, _ = (x.detach() for x in leaf_qkv(1, 2, 1, 70, 8))
    p = params_for(cfg.to_dict(), 8, 2, 70)
    mask = route(q, k, cfg, p["proj_q"], p["proj_k"])
    assert isinstance(mask, SoftBlockMask) and mask.logits.requires_grad
    kk = expand_kv_heads(k, 2)
    scores = (span_means(q, 8) @ p["proj_q"].T) @ (span_means(kk - kk.mean(2, keepdim=True), 4) @ p["proj_k"].T).mT
    scores = scores / math.sqrt(8)
    want = soft_topk(scores.softmax(-1) if router_softmax else scores, 4, 0.1, 30)
    torch.testing.assert_close(torch.sigmoid(mask.logits), want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(torch.sigmoid(mask.logits).sum(-1), torch.full((1, 2, 9), 4.0, dtype=torch.float64))


# ----------------------------------------------------------------------------------- torch vs reference

CASES = [
    (1, 1, 1, 1, 8, sla2_config(block_size=4, topk_ratio=0.5)),
    (2, 2, 1, 15, 8, sla2_config(block_q=4, block_k=8, topk_ratio=0.5, feature_map="elu", alpha_per_head=True)),
    (1, 4, 2, 17, 8, sla2_config(block_q=8, block_k=4, topk_ratio=0.3, feature_map="relu", smooth_k="router")),
    (1, 2, 1, 17, 8, sla2_config(block_size=16, topk_ratio=0.5)),                  # linear branch empty
    (1, 4, 2, 64, 8, sla2_config(block_q=16, block_k=8, topk_ratio=0.3, router="soft", alpha_per_head=True)),
    (2, 2, 2, 33, 8, sla2_config(block_q=8, block_k=4, topk_ratio=0.2, router="soft", router_softmax=False,
                                 smooth_k="router", feature_map="elu", tau=0.5)),
    (1, 2, 1, 17, 8, sla2_config(block_size=16, topk_ratio=1.0, router="soft")),     # M = 1: linear weight 0
    (1, 2, 1, 1000, 8, sla2_config(block_q=16, block_k=8, topk_ratio=0.05)),
    (1, 2, 1, 300, 8, sla2_config(block_q=16, block_k=8, topk_ratio=0.05, router="soft", feature_map="relu")),
    (1, 2, 1, 4097, 8, sla2_config(block_size=64, topk_ratio=0.05, alpha_per_head=True)),
]


@pytest.mark.parametrize("b,h,hk,n,d,cfg", exhaustive_where(CASES, lambda case: case[3] > 1000),
                         ids=[f"N{c[3]}-{i}" for i, c in enumerate(CASES)])
def test_torch_matches_reference_fp64(b, h, hk, n, d, cfg):
    q, k, v = leaf_qkv(b, h, hk, n, d)
    params = params_for(cfg, d, h, n)
    got = run(q, k, v, cfg, params, "torch")
    want = run(q, k, v, cfg, params, "reference")
    assert_all_close(got, want, rtol=1e-10, atol=1e-10)
    gq, gk, gv, gpq, gpk, galpha = got[2]
    assert all(g.abs().sum() > 0 for g in ((gq, gk, gv, galpha) if n > 1 else (gv, galpha)))
    if cfg.get("router", "hard") == "hard":
        assert gpq is None and gpk is None                 # hard top-k: the router gets no gradient
    elif cfg["topk_ratio"] < 1:
        assert gpq.abs().sum() > 0 and gpk.abs().sum() > 0


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(1, 60), block_q=st.sampled_from([4, 8, 16]), block_k=st.sampled_from([4, 8, 16]),
       heads=st.sampled_from([(1, 1), (2, 1), (4, 2)]), router=st.sampled_from(["hard", "soft"]),
       feature_map=st.sampled_from(["softmax", "elu", "relu"]), topk_ratio=st.floats(0.05, 0.7),
       smooth_k=st.sampled_from(["all", "router"]), per_head=st.booleans(), seed=st.integers(0, 1000))
def test_torch_matches_reference_random_configs(n, block_q, block_k, heads, router, feature_map, topk_ratio,
                                                smooth_k, per_head, seed):
    cfg = sla2_config(block_q=block_q, block_k=block_k, topk_ratio=topk_ratio, router=router,
                      feature_map=feature_map, smooth_k=smooth_k, alpha_per_head=per_head, tau=0.3)
    torch.manual_seed(seed)
    q, k, v = leaf_qkv(1, heads[0], heads[1], n, 8, seed=seed)
    params = params_for(cfg, 8, heads[0], n)
    assert_all_close(run(q, k, v, cfg, params, "torch"), run(q, k, v, cfg, params, "reference"),
                     rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("router", ["hard", "soft"])
def test_fp32_matches_fp64_reference(router):
    cfg = sla2_config(block_q=8, block_k=4, topk_ratio=0.2, router=router, tau=0.5)
    params = cast_params(params_for(cfg, 16, 4, 203), torch.float32)
    config = Config.from_dict(cfg)

    def select(q, k):  # the hard router's blocks; the soft one has none to flip
        if router == "soft":
            return ()
        proj = [params[name].detach().to(q.dtype) for name in ("proj_q", "proj_k")]
        return (route(q.detach(), k.detach(), config, *proj).indices,)

    q, k, v = qkv_selecting_alike(select, 2, 4, 2, 203, 16)
    got = run(q, k, v, cfg, params, "torch")                         # reference: the same values in fp64
    want = run(*cast((q, k, v), torch.float64), cfg, cast_params(params, torch.float64), "reference")
    assert got[0].dtype == torch.float32
    assert_all_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("router", ["hard", "soft"])
def test_bf16_close_to_fp64_reference(router):
    cfg = sla2_config(block_q=32, block_k=16, topk_ratio=0.2, router=router, tau=0.5)
    q, k, v = leaf_qkv(1, 2, 1, 300, 32, dtype=torch.bfloat16)
    params = params_for(cfg, 32, 2, 300)
    got = run(q, k, v, cfg, params, "torch")                         # reference: the same values in fp64
    want = run(*cast((q, k, v), torch.float64), cfg, params, "reference")
    assert got[0].dtype == torch.bfloat16
    assert rel_err(got[0], want[0]) < 2e-2 and rel_err(got[1], want[1]) < 1e-2
    for a, b in zip(got[2], want[2]):
        assert (a is None) == (b is None)
        if a is not None:
            assert rel_err(a, b) < 5e-2


def test_soft_branch_chunks_equal_one_pass():
    """Row chunks with recompute (small max_elements) give the same output, LSE and gradients."""
    q, k, v = leaf_qkv(1, 4, 2, 50, 8)
    log_w = torch.nn.functional.logsigmoid(torch.randn(1, 4, 7, 13, dtype=torch.float64)).requires_grad_()
    results = []
    for max_elements in (1 << 26, 1):
        out, lse = block_naive.soft_block_attention(q, k, v, log_w, 8, 4, 0.3, max_elements=max_elements)
        grads = torch.autograd.grad((out * out).sum() + lse.sum(), (q, k, v, log_w))
        results.append((out, lse, grads))
    assert_all_close(results[0], results[1], rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------------- combine, smoothing

@pytest.mark.parametrize("logit,branch", [(40.0, "sparse"), (-40.0, "linear")])
def test_alpha_mixes_the_two_branches(logit, branch):
    cfg = Config.from_dict(sla2_config(block_q=8, block_k=4, topk_ratio=0.25, smooth_k="router"))
    q, k, v = (x.detach() for x in leaf_qkv(1, 2, 1, 40, 8))
    params = {name: p.double() for name, p in SLA2.init_params(cfg, 8, 2, 40).items()}
    params["alpha_logit"] = torch.full_like(params["alpha_logit"], logit)
    out = flexsparse.attention(q, k, v, cfg, backend="torch", params=params)
    sel = route(q, k, cfg, params["proj_q"], params["proj_k"])
    if branch == "sparse":
        want, _ = block_naive.block_sparse_attention(q, k, v, sel, 8 ** -0.5)
    else:
        want = linear_naive.masked_linear_attention(q, k, v, sel, feature_map="softmax", eps=1e-5)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)


def test_alpha_is_per_query_block():
    cfg = sla2_config(block_q=8, block_k=4, topk_ratio=0.25)
    q, k, v = (x.detach() for x in leaf_qkv(1, 2, 1, 20, 8))
    params = {name: p.double() for name, p in SLA2.init_params(Config.from_dict(cfg), 8, 2, 20).items()}
    base = flexsparse.attention(q, k, v, cfg, backend="torch", params=params)
    params["alpha_logit"] = params["alpha_logit"].clone()
    params["alpha_logit"][0, 1] = -3.0                              # only tokens 8..15 change
    changed = flexsparse.attention(q, k, v, cfg, backend="torch", params=params)
    differs = (changed - base).abs().amax(dim=(0, 1, 3)) > 1e-6
    assert differs.tolist() == [8 <= t < 16 for t in range(20)]


def test_smooth_k_all_smooths_every_branch():
    q, k, v = (x.detach() for x in leaf_qkv(1, 2, 1, 48, 8))
    k = k + 2 * torch.randn(8, dtype=k.dtype)                      # a large key mean
    params = params_for(sla2_config(block_size=8), 8, 2, 48)
    out_all = flexsparse.attention(q, k, v, sla2_config(block_size=8, smooth_k="all"), backend="torch",
                                   params=params)
    out_router = flexsparse.attention(q, k, v, sla2_config(block_size=8, smooth_k="router"), backend="torch",
                                      params=params)
    presmoothed = flexsparse.attention(q, k - k.mean(2, keepdim=True), v, sla2_config(block_size=8, smooth_k="router"),
                                       backend="torch", params=params)
    torch.testing.assert_close(out_all, presmoothed, rtol=1e-12, atol=1e-12)
    assert rel_err(out_all, out_router) > 1e-3                    # the linear branch sees a different K


def _bf16_error_at_logit_scale(std: float, smooth_k: str, backend: str, device: str, seed: int = 0) -> float:
    """Relative L2 error of a bf16 call against fp64 on the same (bf16-rounded) inputs and parameters: N = 2048,
    D = 64, keys with a common offset, q and k scaled so that the logits have standard deviation ``std``."""
    gen = torch.Generator().manual_seed(seed)
    n, d = 2048, 64
    cfg = sla2_config(block_q=64, block_k=64, topk_ratio=0.1, smooth_k=smooth_k)
    params = {name: value + 0.05 * torch.randn(value.shape, generator=gen)
              for name, value in params_for(cfg, d, 2, n).items()}
    q, k, v = (torch.randn(1, 2, n, d, generator=gen) for _ in range(3))
    k = k + 2 * torch.randn(d, generator=gen)
    q, k, v = (x.bfloat16().to(device) for x in (q * std**0.5, k * std**0.5, v + 1))
    got = flexsparse.attention(q, k, v, cfg, backend=backend, params={n_: p.to(device) for n_, p in params.items()})
    want = flexsparse.attention(*(x.double() for x in (q, k, v)), cfg, backend="reference",
                                params={n_: p.double().to(device) for n_, p in params.items()})
    return rel_err(got.double(), want)


@pytest.mark.parametrize("std", [1, 3, 10, 30])
def test_default_smoothing_is_accurate_in_bf16(std):
    """bf16 against fp64 within 5e-3 at logits of standard deviation up to 30 with the default ``smooth_k``
    (``"router"``); ``"all"`` re-rounds the smoothed keys and is worse at large logits (docs/methods.md)."""
    assert Config.from_dict(sla2_config()).smooth_k == "router"
    default = _bf16_error_at_logit_scale(std, "router", "torch", "cpu")
    assert default <= 5e-3
    if std == 30:
        assert _bf16_error_at_logit_scale(std, "all", "torch", "cpu") > 1.5 * default


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("std", [1, 30])
def test_gpu_default_smoothing_is_accurate_in_bf16(std):
    assert _bf16_error_at_logit_scale(std, "router", "triton", "cuda") <= 5e-3


def test_soft_router_with_tiny_tau_approaches_hard_router():
    q, k, v = (x.detach() for x in leaf_qkv(1, 2, 1, 64, 8))
    hard = sla2_config(block_size=8, topk_ratio=0.25, router_softmax=False)
    params = params_for(hard, 8, 2, 64)
    out_hard = flexsparse.attention(q, k, v, hard, backend="torch", params=params)
    out_soft = flexsparse.attention(q, k, v, {**hard, "router": "soft", "tau": 1e-9, "softtopk_iters": 80},
                                    backend="torch", params=params)
    torch.testing.assert_close(out_soft, out_hard, rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------------- alpha at any length

def logits_at_by_hand(stored: torch.Tensor, blocks: int) -> torch.Tensor:
    """The documented rule written out: call block ``i`` of ``blocks`` sits at the normalised centre
    ``(i + 0.5) / blocks``, stored block ``j`` of ``T`` at ``(j + 0.5) / T``; the logit there is the linear
    interpolation of the two stored blocks around it, the outer stored value past the outer centres."""
    t = stored.shape[1]
    columns = []
    for i in range(blocks):
        x = min(max((i + 0.5) / blocks * t - 0.5, 0.0), t - 1.0)   # position in units of stored blocks
        lo = math.floor(x)
        hi, w = min(lo + 1, t - 1), x - lo
        columns.append((1 - w) * stored[:, lo] + w * stored[:, hi])
    return torch.stack(columns, 1)


@pytest.mark.parametrize("t,blocks", [(1, 1), (1, 5), (6, 6), (6, 4), (6, 13), (7, 2), (3, 1), (5, 64)])
def test_alpha_logits_at_follows_the_rule(t, blocks):
    stored = torch.randn(3, t, dtype=torch.float64, requires_grad=True)
    got = alpha_logits_at(stored, blocks)
    assert got.shape == (3, blocks)
    if t == blocks:
        assert got is stored
    torch.testing.assert_close(got, logits_at_by_hand(stored, blocks), rtol=1e-13, atol=1e-13)
    weight = torch.randn(3, blocks, dtype=torch.float64)
    (g_got,) = torch.autograd.grad((got * weight).sum(), stored)
    (g_hand,) = torch.autograd.grad((logits_at_by_hand(stored, blocks) * weight).sum(), stored)
    torch.testing.assert_close(g_got, g_hand, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("backend", ["torch", "reference"])
@pytest.mark.parametrize("per_head", [False, True])
def test_alpha_trained_at_one_length_runs_at_others(backend, per_head):
    """A module stored at N=96 (6 query blocks of 16) trains a few Adam steps there, then runs at N=61 (4 blocks,
    the last ragged) and N=203 (13): the output equals the method called with the stored logits interpolated by
    hand to the call's blocks, and the gradient reaches every stored block, equal to the hand-made path's."""
    cfg = sla2_config(block_q=16, block_k=8, topk_ratio=0.25, alpha_per_head=per_head)
    module = flexsparse.SparseAttention(cfg, head_dim=8, num_heads=2, seq_len=96, backend=backend).double()
    stored = module.params["alpha_logit"]
    assert stored.shape == (2 if per_head else 1, 6)
    optimizer = torch.optim.Adam(module.parameters(), lr=0.2)
    for _ in range(3):
        q, k, v = (x.detach() for x in leaf_qkv(2, 2, 1, 96, 8))
        loss = (module(q, k, v) - flexsparse.attention(q, k, v, {"method": "full"})).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert stored.detach().unique().numel() > 1                  # trained: the blocks differ
    for n, blocks in ((61, 4), (203, 13)):
        q, k, v = (x.detach() for x in leaf_qkv(2, 2, 1, n, 8))
        weight = torch.randn(2, 2, n, 8, dtype=torch.float64)
        out = module(q, k, v)
        (grad,) = torch.autograd.grad((out * weight).sum(), stored)
        leaf = stored.detach().clone().requires_grad_()
        explicit = {"proj_q": module.params["proj_q"].detach(), "proj_k": module.params["proj_k"].detach(),
                    "alpha_logit": logits_at_by_hand(leaf, blocks)}
        want = flexsparse.attention(q, k, v, cfg, backend=backend, params=explicit)
        (grad_want,) = torch.autograd.grad((want * weight).sum(), leaf)
        torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(grad, grad_want, rtol=1e-10, atol=1e-12)
        assert (grad != 0).all()


@pytest.mark.parametrize("per_head", [False, True])
def test_alpha_at_the_stored_length_is_the_parameter_itself(per_head):
    """Equal block counts: the backends get the stored tensor itself, so outputs and gradients are bit-identical to
    passing it straight through; a length with the same block count (N=90 for 96 in blocks of 16) too."""
    cfg = Config.from_dict(sla2_config(block_q=16, block_k=8, topk_ratio=0.25, alpha_per_head=per_head))
    params = params_for(cfg.to_dict(), 8, 2, 96)
    for n in (96, 90):
        q = leaf_qkv(1, 2, 1, n, 8)[0]
        assert SLA2.check_params(cfg, q, params)["alpha_logit"] is params["alpha_logit"]
    q, k, v = leaf_qkv(1, 2, 1, 96, 8)
    module = flexsparse.SparseAttention(cfg, head_dim=8, num_heads=2, seq_len=96, backend="torch").double()
    with torch.no_grad():
        for name, value in params.items():
            module.params[name].copy_(value)
    got = module(q, k, v)
    want = flexsparse.attention(q, k, v, cfg, backend="torch", params=params)
    assert torch.equal(got, want)
    assert torch.equal(torch.autograd.grad(got.sum(), module.params["alpha_logit"])[0],
                       torch.autograd.grad(want.sum(), params["alpha_logit"])[0])


# ----------------------------------------------------------------------------------- errors

def test_functional_call_needs_params():
    q, k, v = leaf_qkv(1, 2, 1, 16, 8)
    with pytest.raises(ValueError, match="SparseAttention"):
        flexsparse.attention(q, k, v, sla2_config(block_size=4))


@pytest.mark.parametrize("change,error,match", [
    ({"proj_q": torch.eye(4)}, ValueError, "proj_q.*shape \\(8, 8\\)"),
    ({"alpha_logit": torch.zeros(2, 4)}, ValueError, "alpha_logit.*shape \\(1, T\\).*got \\(2, 4\\)"),
    ({"alpha_logit": torch.zeros(4)}, ValueError, "alpha_logit.*shape \\(1, T\\).*got \\(4,\\)"),
    ({"alpha_logit": torch.zeros(1, 0)}, ValueError, "alpha_logit.*T >= 1.*got \\(1, 0\\)"),
    ({"alpha_logit": torch.zeros(1, 4, dtype=torch.int64)}, TypeError, "alpha_logit.*floating-point"),
    ({"alpha_logit": [[0.0] * 4]}, TypeError, "alpha_logit.*torch.Tensor"),
    ({"extra": torch.zeros(1)}, ValueError, "unknown \\['extra'\\]"),
])
def test_bad_params_raise(change, error, match):
    q, k, v = leaf_qkv(1, 2, 1, 16, 8)
    params = {**SLA2.init_params(Config.from_dict(sla2_config(block_size=4)), 8, 2, 16), **change}
    with pytest.raises(error, match=match):
        flexsparse.attention(q, k, v, sla2_config(block_size=4), params=params)


def test_per_head_alpha_needs_a_row_per_head():
    cfg = sla2_config(block_size=4, alpha_per_head=True)
    q, k, v = leaf_qkv(1, 2, 1, 16, 8)
    params = {**SLA2.init_params(Config.from_dict(cfg), 8, 2, 16), "alpha_logit": torch.zeros(1, 4)}
    with pytest.raises(ValueError, match="shape \\(2, T\\): one row per head"):
        flexsparse.attention(q, k, v, cfg, params=params)


@pytest.mark.parametrize("cfg,match", [
    (sla2_config(alpha_init=1.0), "alpha_init"),
    (sla2_config(router="topk"), "router"),
    (sla2_config(smooth_k="none"), "smooth_k"),
    (sla2_config(tau=0.0), "tau"),
    (sla2_config(softtopk_iters=0), "softtopk_iters"),
    (sla2_config(negligible_ratio=0.1), "negligible_ratio"),
])
def test_bad_config_raises(cfg, match):
    with pytest.raises(ValueError, match=match):
        Config.from_dict(cfg)
