"""GPU (``pytest -m gpu``): random shapes and configs through the Triton kernels, drawn fresh on every run
(hypothesis), against the ``torch`` backend in fp32 on the same selection.

The parametrized GPU tests pin the shapes the kernels were written for; these draw the rest: ragged and tiny N,
every block size pair the kernels take (so every kernel variant: the Gluon ones on sm_90, the batched and the
ragged LLSA paths), GQA, head dims 32 to 128, bf16 and fp16, the FP8 forward, and whole methods end to end on
``triton`` and on ``flex`` (compiled FlexAttention). Each test draws ``FLEXSPARSE_FUZZ_EXAMPLES`` cases (default 8:
the GPU suite's share; a campaign sets more), the two tests that compile every case a quarter of them. A failure
prints its case as drawn (no shrinking), which hypothesis's ``@example`` can pin.
"""
from __future__ import annotations

import math
import os

import pytest
import torch
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

import triton_support as ts

pytest.importorskip("triton")

import flexsparse  # noqa: E402
from flexsparse.backends import BACKENDS  # noqa: E402
from flexsparse.masks import num_blocks  # noqa: E402
from flexsparse.methods import METHODS  # noqa: E402

from _sla_testing import run  # noqa: E402
from helpers import config_fields, draw_level_topk, grads, selections_by_search  # noqa: E402
from test_triton_blocks import NAMES, _method_params, grad_run, torch_branch, triton_branch  # noqa: E402
from test_triton_llsa import _leaf_run  # noqa: E402

gpu = ts.gpu
TRITON, TORCH = BACKENDS["triton"], BACKENDS["torch"]
# no shrinking: GPU time is scarce, and a failing case is reported as drawn
EXAMPLES = int(os.environ.get("FLEXSPARSE_FUZZ_EXAMPLES", "8"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None, phases=[Phase.explicit, Phase.generate],
                suppress_health_check=list(HealthCheck))
FUZZ_COMPILED = settings(FUZZ, max_examples=math.ceil(EXAMPLES / 4))
LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}


@st.composite
def block_cases(draw):
    """(B, Nq, Nk, block_q, block_k, H, Hk, D, K, dtype): self- or cross-length, any block pair of 16..128."""
    nq = draw(st.integers(1, 9000))
    nk = nq if draw(st.booleans()) else draw(st.integers(1, 9000))
    block_q, block_k = draw(st.sampled_from([16, 32, 64, 128])), draw(st.sampled_from([16, 32, 64, 128]))
    kv_heads = draw(st.sampled_from([1, 2]))
    heads = kv_heads * draw(st.sampled_from([1, 2, 3]))
    topk = draw(st.integers(1, min(num_blocks(nk, block_k), 40)))
    return (draw(st.sampled_from([1, 2])), nq, nk, block_q, block_k, heads, kv_heads,
            draw(st.sampled_from([32, 64, 96, 128])), topk, draw(st.sampled_from(sorted(LOW))))


@st.composite
def llsa_cases(draw):
    """(N, block, topk per level finest first, H, Hk, D, dtype), K within what each level can fill."""
    block = draw(st.sampled_from([8, 16, 32]))
    levels = draw(st.integers(1, 3))
    n = draw(st.integers(1, 40000))
    top = draw_level_topk(draw, n, block, levels, cap=24)
    kv_heads = draw(st.sampled_from([1, 2]))
    heads = kv_heads * draw(st.sampled_from([1, 2]))
    d = draw(st.sampled_from([32, 64, 128]))
    return n, block, tuple(top), heads, kv_heads, d, draw(st.sampled_from(sorted(LOW)))


@st.composite
def fp8_cases(draw):
    """(N, H, Hk, D, block_q, block_k, K): the FP8 forward's shapes (Nq = Nk), any block pair of 16..128."""
    n = draw(st.integers(1, 9000))
    block_q, block_k = draw(st.sampled_from([16, 32, 64, 128])), draw(st.sampled_from([16, 32, 64, 128]))
    kv_heads = draw(st.sampled_from([1, 2]))
    return (n, kv_heads * draw(st.sampled_from([1, 2, 3])), kv_heads, draw(st.sampled_from([32, 64, 96, 128])),
            block_q, block_k, draw(st.integers(1, min(num_blocks(n, block_k), 40))))


def draw_options(draw, cfg: dict, fields: set[str]) -> dict:
    """``cfg`` with the sparse-linear options its method has drawn: feature map, SLA's linear branch."""
    if "feature_map" in fields:
        cfg["feature_map"] = draw(st.sampled_from(["softmax", "elu", "relu"]))
    if "linear" in fields:
        cfg["linear"] = draw(st.sampled_from(["masked", "full"]))
    return cfg


@st.composite
def method_cases(draw):
    """(config, N, H, Hk, D, layout): every method of the registry on ``backend="triton"`` on random blocks and
    sparsities (by its config's keys: hierarchical ``levels``, a block ``topk`` or a ``topk_ratio``), deterministic or
    not, on contiguous inputs or views (``method_leaves``)."""
    method = draw(st.sampled_from(ts.triton_methods()))
    fields = config_fields(method)
    n = draw(st.integers(1, 5000))
    cfg = {"method": method}
    if "topk_ratio" in fields:
        cfg.update(block_q=draw(st.sampled_from([32, 64, 128])), block_k=draw(st.sampled_from([32, 64])),
                   topk_ratio=draw(st.sampled_from([0.05, 0.2, 0.5])))
        draw_options(draw, cfg, fields)
    elif "topk" in fields:
        block = draw(st.sampled_from([8, 16] if "levels" in fields else [16, 32, 64, 128]))
        cfg.update(block_size=block, topk=draw(st.integers(1, min(num_blocks(n, block), 12))))
    if "deterministic" in fields:
        cfg["deterministic"] = draw(st.booleans())
    kv_heads = draw(st.sampled_from([1, 2]))
    return (cfg, n, kv_heads * draw(st.sampled_from([1, 2])), kv_heads, draw(st.sampled_from([32, 64, 128])),
            draw(st.sampled_from(["bhnd", "bnhd"])))


def method_leaves(n, heads, kv_heads, d, dtype, layout: str, grid: bool = False):
    """q ``(1, H, N, D)``, k, v ``(1, Hk, N, D)`` with gradients: contiguous (``"bhnd"``), or views of
    ``(1, N, H, D)`` tensors as a model's projections give them (``"bnhd"``). ``grid``: multiples of 1/16 in
    [-4, 4], whose block sums are exact in any order, so that selections cannot depend on how a reduction adds."""
    tensors = ts.make_qkv(1, heads, kv_heads, n, n, d, torch.float32, "cuda")
    tensors = [((x * 16).round().clamp(-64, 64) / 16 if grid else x).to(dtype) for x in tensors]
    if layout == "bhnd":
        return [x.requires_grad_() for x in tensors]
    return [x.transpose(1, 2).contiguous().requires_grad_().transpose(1, 2) for x in tensors]


@st.composite
def flex_cases(draw):
    """(config, N, H, Hk, D, dtype): every method of the registry on ``backend="flex"`` with the block sizes flex
    takes on CUDA (multiples of 16, query and key blocks apart where the method has both), D 32..128, bf16 / fp16 /
    fp32."""
    method = draw(st.sampled_from([name for name, m in METHODS.items() if "flex" in m.backends]))
    fields = config_fields(method)
    n = draw(st.integers(1, 5000))
    cfg = {"method": method}
    if "levels" in fields:
        block = draw(st.sampled_from([16, 32]))
        cfg.update(block_size=block, topk=draw(st.integers(1, min(num_blocks(n, block), 12))))
    elif "topk" in fields:
        block_q, block_k = draw(st.sampled_from([16, 32, 64, 128])), draw(st.sampled_from([16, 32, 64, 128]))
        cfg.update(block_q=block_q, block_k=block_k, topk=draw(st.integers(1, min(num_blocks(n, block_k), 12))))
    elif "topk_ratio" in fields:
        cfg.update(block_q=draw(st.sampled_from([32, 64, 128])), block_k=draw(st.sampled_from([16, 32, 64])),
                   topk_ratio=draw(st.sampled_from([0.05, 0.2, 0.5])))
        draw_options(draw, cfg, fields)
    kv_heads = draw(st.sampled_from([1, 2]))
    return (cfg, n, kv_heads * draw(st.sampled_from([1, 2])), kv_heads, draw(st.sampled_from([32, 64, 96, 128])),
            draw(st.sampled_from(["bf16", "fp16", "fp32"])))


def _assert_near(names, got, want, tol: float = 2e-2, scales: dict | None = None):
    """Every low-precision result finite and within ``tol`` relative L2 error of its fp32 counterpart, or, for a
    result named in ``scales``, within ``tol`` of that scale in max norm."""
    for name, a, b in zip(names, got, want):
        assert torch.isfinite(a).all(), name
        err = ts.rel_err(a, b)
        if err >= tol and scales and name in scales:
            err = (a.float() - b.float()).abs().max().item() / scales[name]
        assert err < tol, name


@gpu
@FUZZ
@given(case=block_cases())
def test_gpu_fuzz_block_sparse_kernels(case):
    """The block-sparse forward and backward (Triton and Gluon kernels) on a random selection: O, LSE, dQ, dK, dV
    within bf16/fp16 rounding of the fp32 torch backend on the same values."""
    bsz, nq, nk, block_q, block_k, heads, kv_heads, d, topk, dtype = case
    q, k, v = ts.make_qkv(bsz, heads, kv_heads, nq, nk, d, LOW[dtype], "cuda")
    selection = ts.random_selection(bsz, heads, nq, nk, block_q, block_k, topk, "cuda")
    got = grad_run(triton_branch, q, k, v, selection, d**-0.5)
    want = grad_run(torch_branch, q.float(), k.float(), v.float(), selection, d**-0.5)
    _assert_near(NAMES, got, want)


@gpu
@pytest.mark.long
@FUZZ
@given(case=llsa_cases())
@example(case=(2, 32, (1, 1, 1), 1, 1, 32, "fp16"))
def test_gpu_fuzz_llsa_kernels(case):
    """LLSA's kernels on the Triton selection of random inputs: O, LSE, dQ and the gradients of every level of the
    pyramid (separate leaves) within bf16/fp16 rounding of the fp32 torch backend on the same selection."""
    n, block, topk, heads, kv_heads, d, dtype = case
    q, k, v = ts.make_qkv(1, heads, kv_heads, n, n, d, LOW[dtype], "cuda")
    selection = TRITON.llsa_select(q, k, v, block, topk).selection
    levels = len(topk)
    got = _leaf_run(TRITON.llsa_softmax, q, k, v, selection, levels, d**-0.5, q.dtype)
    want = _leaf_run(TORCH.llsa_softmax, q.float(), k.float(), v.float(), selection, levels, d**-0.5, q.dtype)
    # a pooled level's gradient is a sum of terms that largely cancel (its few query rows' dS over the same few
    # keys at tiny N), so it can be far smaller than the dS the kernel rounds; it is held to the largest gradient of
    # its kind (found on an H200: N=2, b=32, K=(1, 1, 1), fp16, dk1 3.2 % relative L2)
    scales = {f"{kind}{i}": max(x.abs().max().item() for x in want[first:first + levels + 1])
              for kind, first in (("dk", 3), ("dv", 4 + levels)) for i in range(1, levels + 1)}
    _assert_near(["o", "lse", "dq"] + [f"dk{i}" for i in range(levels + 1)] + [f"dv{i}" for i in range(levels + 1)],
                 got, want, scales=scales)


@gpu
@pytest.mark.long
@FUZZ
@given(case=llsa_cases(), grid=st.booleans())
# found on an H100: rows of 736 candidates (b=32, K_2=23) at D=128 needed 270 KB of shared memory
# for two parents per program (selection.hierarchy.child_parents now takes one, or selection.naive.children_topk)
@example(case=(33940, 32, (12, 23), 2, 2, 128, "bf16"), grid=False)
def test_gpu_fuzz_llsa_selection_searches_agree(case, grid):
    """LLSA's selection kernels by each of their searches (``hierarchy.search`` forced each way; rows of more than
    256 candidates, whose int64 keys would spill heavily, always bisect): the same packed selection, on random or grid
    (tie-rich) inputs."""
    from flexsparse.triton.pooling.op import llsa_pool
    n, block, topk, heads, kv_heads, d, dtype = case
    q, k, _ = method_leaves(n, heads, kv_heads, d, LOW[dtype], "bhnd", grid)
    q_pyr, k_pyr = (llsa_pool(x.detach(), block, len(topk)) for x in (q, k))
    split, whole, int64, bisection = selections_by_search(q_pyr, k_pyr, n, block, topk, widest=256)
    assert torch.equal(split, bisection) and torch.equal(whole, bisection) and torch.equal(int64, bisection)


@gpu
@pytest.mark.long
@FUZZ
@given(case=method_cases())
@example(case=({"method": "sla", "block_q": 64, "block_k": 32, "topk_ratio": 0.5, "feature_map": "softmax",
                "linear": "masked", "deterministic": False}, 2528, 1, 1, 128, "bnhd"))   # fp32 D=128 SLA backward
def test_gpu_fuzz_methods_fp32(case):
    """``flexsparse.attention`` end to end (selection, both branches, the learned parameters' gradients) in fp32,
    on contiguous inputs or on a model's ``(B, N, H, D)`` views: triton against torch. The triton backend selects
    with the Triton kernels and the torch backend in PyTorch: inputs on which the two select alike
    (``ts.draw_selecting_alike``). ``deterministic=True``: a second triton run gives the same bits."""
    cfg, n, heads, kv_heads, d, layout = case
    params = _method_params(cfg, d, heads, n, "cuda")
    leaves = ts.draw_selecting_alike(lambda: method_leaves(n, heads, kv_heads, d, torch.float32, layout), cfg, params)
    got = run(*leaves, cfg, params, "triton")
    want = run(*leaves, cfg, params, "torch")
    if cfg["deterministic"]:
        again = run(*leaves, cfg, params, "triton")
        assert torch.equal(again[0], got[0]) and torch.equal(again[1], got[1])
        assert all(a is None or torch.equal(a, b) for a, b in zip(again[2], got[2]))
    ts.assert_runs_near(got, want, 1e-3, 2e-3)


@gpu
@FUZZ
@given(case=fp8_cases())
def test_gpu_fuzz_fp8_kernel(case):
    """The FP8 forward kernel on a random selection: within accumulation rounding of its PyTorch emulation (same
    quantized operands, same key order) and within FP8 rounding of the fake-quant spec."""
    fp8 = pytest.importorskip("test_triton_fp8")    # skipped without torchao, as that file
    n, heads, kv_heads, d, block_q, block_k, topk = case
    (q, k, v), selection = fp8._gpu_inputs(n, heads, kv_heads, d, block_q, block_k, topk)
    scale = d**-0.5
    pre = fp8.quantize_qkv(q, k, v, block_q, block_k)
    o, lse = fp8.block_attend_fp8(q, pre[2:], selection.indices, block_q, block_k, scale)
    want_o, want_lse = fp8.emulate_kernel(pre, selection.indices, block_q, block_k, scale,
                                          fp8.kernel_tiles(pre, selection.indices, block_q, block_k))
    # LSE by absolute error: the FP8 products carry ~1e-4 absolute logit error, and a short row's LSE sits near 0.
    # O within 1e-2: where the kernel's and the emulation's logits differ in the last bits, some e4m3 roundings of P
    # land one step apart, and over long rows that adds up (5.3e-3 at 36 blocks of 64 keys, D=128; a wrong key
    # block is an O(1) error)
    assert ts.rel_err(o, want_o) < 1e-2 and ts.lse_err(lse, want_lse) < 1e-3
    spec_o, spec_lse = fp8.fake_quant_branch(q, k, v, selection, scale)
    assert ts.rel_err(o, spec_o.float()) < 0.04 and ts.lse_err(lse, spec_lse) < 1e-3


@gpu
@FUZZ_COMPILED
@given(case=flex_cases())
# found on an H100: under 128 queries inductor took its decoding kernel, which had no config for
# 16-token key blocks (flex.tile_options now forces the main kernel)
@example(case=({"method": "vsa", "block_q": 16, "block_k": 16, "topk": 1}, 73, 1, 1, 32, "fp16"))
def test_gpu_fuzz_flex_methods(case):
    """``backend="flex"`` (compiled FlexAttention, fresh graphs per case) against ``backend="torch"`` (fp32
    arithmetic) on the same inputs, so on the same selection (both select in PyTorch): output, LSE and the gradients
    of q, k, v and of the learned parameters, fp32 tight, bf16 / fp16 within their rounding. Catches block / head-dim /
    dtype combinations that fail to compile (``NoValidChoicesError``, shared memory) as well as wrong values."""
    cfg, n, heads, kv_heads, d, dtype = case
    dtype = {"fp32": torch.float32, **LOW}[dtype]
    torch._dynamo.reset()        # each case compiles on its own: no recompile limit shared across cases
    leaves = [x.requires_grad_() for x in ts.make_qkv(1, heads, kv_heads, n, n, d, dtype, "cuda")]
    params = _method_params(cfg, d, heads, n, "cuda")
    got = run(*leaves, cfg, params, "flex")
    want = run(*leaves, cfg, params, "torch")
    tol = 1e-3 if dtype == torch.float32 else 2e-2
    ts.assert_runs_near(got, want, tol, 2 * tol)


@gpu
@FUZZ_COMPILED
@given(case=method_cases(), dtype=st.sampled_from(["bf16", "fp32"]))
# found on an H100: one sparse block per row, so torch 2.11's inductor rewrote the linear branch's
# keep map into an fp32 tensor typed bf16 (masks.keep_map)
@example(case=({"method": "sla2", "block_q": 32, "block_k": 32, "topk_ratio": 0.05, "feature_map": "softmax",
                "deterministic": True}, 623, 4, 2, 128, "bnhd"), dtype="bf16")
def test_gpu_fuzz_compiled_triton_methods(case, dtype):
    """``torch.compile(fullgraph=True)`` of a call on ``backend="triton"`` (fresh graphs per case) against the eager
    call: the same custom ops, so the output is equal up to the order of inductor's reductions of partial sums
    (the methods' glue), and so are the gradients. Grid-valued inputs: the routers' pooling, which inductor
    compiles, then gives the same selection."""
    cfg, n, heads, kv_heads, d, layout = case
    dtype = {"fp32": torch.float32, **LOW}[dtype]
    torch._dynamo.reset()
    leaves = method_leaves(n, heads, kv_heads, d, dtype, layout, grid=True)
    params = _method_params(cfg, d, heads, n, "cuda")

    def call(q, k, v, params):
        return flexsparse.attention(q, k, v, cfg, backend="triton", return_lse=True, params=params)

    results = []
    for fn in (torch.compile(call, fullgraph=True), call):
        out, lse = fn(*leaves, params)
        results.append((out, lse, grads([out, lse], [*leaves, *params.values()])))
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    ts.assert_runs_near(*results, tol, tol)
