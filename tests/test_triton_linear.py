"""The masked linear branch of SLA / SLA2 in Triton (the triton backend's ``masked_linear_attention``,
``mixed_linear_output`` and ``sparse_linear_output``; ops ``flexsparse::masked_linear`` and ``masked_linear_bwd``;
kernels ``triton.linear.fwd`` / ``linear.bwd``).

CPU (CI): the kernels run through the Triton interpreter in fp32 (and fp16) on tiny shapes, both strategies (gather,
dense block sums; forced through ``FLEXSPARSE_TRITON_TILES``), against the PyTorch path of the same ops (fp64
inputs, exact) and the PyTorch branch's references (``triton.linear.naive``) (outputs and gradients of q, k, v):
with and without excluded blocks, GQA, odd N, block_q != block_k, head dims that are not powers of two, the
three feature maps, no skipped block (= full linear attention) and all but one skipped; all blocks skipped
gives exactly 0; opcheck of both ops; ``mixed_linear_output`` (op ``masked_linear_mix``: SLA's projection and SLA2's
alpha lerp in the output kernel) against the branch combined in PyTorch (outputs and the gradients of q, k, v,
o_s, weight, bias, alpha's logit); SLA2's one-pass kernels ``lerp_mix_bwd`` (the lerp's backward) and ``center_tokens``
(smoothed keys) against their PyTorch paths. They run in a child pytest started with ``TRITON_INTERPRET=1``
(``test_interpreter_suite``).
GPU (``pytest -m gpu``): bf16 and fp32 at realistic sizes (D 64 / 96 / 128, GQA, ragged N), both strategies,
against the PyTorch path (fp64); the default strategy against the torch backend, eager and
``torch.compile(fullgraph=True)``; opcheck; bitwise reproducible gradients; ``mixed_linear_output`` in bf16 against the
unfused combine, eager and compiled; ``lerp_mix_bwd`` (rounded once) and ``center_tokens`` (bitwise against
PyTorch) in bf16; on
sm_90 the Gluon forward that mixes the branch in its epilogue (``linear.mix_ws``) against the two ops.
"""
from __future__ import annotations

import json
from functools import partial

import pytest
import torch

import triton_support as ts

pytest.importorskip("triton")

from flexsparse.backends import BACKENDS  # noqa: E402
from flexsparse.backends.base import Backend  # noqa: E402
from flexsparse.backends.triton_backend import TritonBackend  # noqa: E402
from flexsparse.masks import BlockSelection, num_blocks, sla_block_counts  # noqa: E402
from flexsparse.methods.dense import block_mask_dense, sparse_linear_dense  # noqa: E402
from flexsparse.triton.linear import naive as linear_naive  # noqa: E402
from flexsparse.triton.linear import op as linear_op  # noqa: E402
from flexsparse.triton.linear.naive import skipped_blocks  # noqa: E402
from flexsparse.triton.pooling.op import center_tokens  # noqa: E402
from flexsparse.triton.selection.naive import block_topk  # noqa: E402

cpu_only, cpu_parent, gpu = ts.cpu_only, ts.cpu_parent, ts.gpu
TRITON, TORCH = BACKENDS["triton"], BACKENDS["torch"]


test_interpreter_suite, test_interpreter_suite_exhaustive = ts.interpreter_suites(__file__)
DEFAULT_TIER_CASES = 1   # interpreter tests: the first case of each in the default tier (conftest)


def _inputs(b, h, hk, nq, nk, d, dtype=torch.float32, device="cpu"):
    return ts.make_qkv(b, h, hk, nq, nk, d, dtype, device, key_offset=0.5)


def _selection(q, k, block_q, block_k, topk_ratio, negligible_ratio):
    """SLA's router on the given q, k: ``BlockSelection`` with ``excluded`` when ``negligible_ratio > 0``."""
    topk, bottomk = sla_block_counts(topk_ratio, negligible_ratio, num_blocks(k.shape[2], block_k))
    q_bar, k_bar = TORCH.router_inputs(q.float(), k.float(), block_q, block_k)
    top, bottom = block_topk(q_bar, k_bar, topk, bottomk=bottomk)
    return BlockSelection(top, block_q, block_k, q.shape[2], k.shape[2], excluded=bottom)


def _run(fn, q, k, v, selection, feature_map, eps=1e-5):
    """Output and gradients of q, k, v of a fixed random loss."""
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = fn(*leaves, selection, feature_map=feature_map, eps=eps)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(0)).to(out)
    (out.float() * weight.float()).sum().backward()
    return [out] + [x.grad for x in leaves]


# (B, H, Hk, Nq, Nk, D, block_q, block_k, topk_ratio, negligible_ratio, feature map)
CASES = [
    (1, 2, 1, 37, 37, 8, 8, 4, 0.3, 0.2, "softmax"),       # GQA, odd N, block_q != block_k, excluded blocks
    (2, 2, 2, 50, 50, 16, 16, 16, 0.25, 0.0, "elu"),       # no excluded blocks
    (1, 4, 2, 29, 45, 8, 8, 16, 0.34, 0.0, "relu"),        # Nq != Nk, GQA, block_k > block_q
    (1, 2, 1, 70, 70, 8, 4, 8, 0.2, 0.3, "elu"),           # several skipped per row, long CSC lists
]


@cpu_only
@pytest.mark.parametrize("b,h,hk,nq,nk,d,bq,bk,ratio,negligible,fmap", CASES)
def test_matches_torch_backend(b, h, hk, nq, nk, d, bq, bk, ratio, negligible, fmap):
    q, k, v = _inputs(b, h, hk, nq, nk, d)
    selection = _selection(q, k, bq, bk, ratio, negligible)
    assert (selection.excluded is not None) == (negligible > 0)
    got = _run(TRITON.masked_linear_attention, q, k, v, selection, fmap)
    want = _run(linear_naive.masked_linear_attention, q, k, v, selection, fmap)
    for name, a, w in zip(["o", "dq", "dk", "dv"], got, want):
        assert ts.rel_err(a, w) < 1e-5, name


@cpu_only
@pytest.mark.parametrize("fmap", ["softmax", "relu"])
def test_matches_dense_reference(fmap):
    """Token-level dense spec (fp64 autograd): linear attention weighted by 1 off the skipped blocks."""
    b, h, hk, n, d, bq, bk = 1, 2, 1, 45, 8, 8, 4
    q, k, v = _inputs(b, h, hk, n, n, d)
    # q with a positive mean: a relu row with phi(q) ~ 0 has a normaliser ~ eps, where the kernel's fp32 "all
    # minus selected" sums cancel (dk off by ~1e-3 in 1 of ~50 draws; fp64 dense has no subtraction)
    q = q + 1.0
    selection = _selection(q, k, bq, bk, 0.25, 0.25)
    got = _run(TRITON.masked_linear_attention, q, k, v, selection, fmap)
    skipped = block_mask_dense(skipped_blocks(selection), n, n, bq, bk)

    def dense(q, k, v, selection, feature_map, eps):
        zeros = torch.zeros(skipped.shape, dtype=q.dtype)
        return sparse_linear_dense(q, k, v, zeros, (~skipped).to(q.dtype), 1.0, feature_map, eps)[2]

    want = _run(dense, q.double(), k.double(), v.double(), selection, fmap)
    for name, a, w in zip(["o", "dq", "dk", "dv"], got, want):
        assert ts.rel_err(a, w) < 1e-5, name


@cpu_only
@pytest.mark.parametrize("ratio,negligible", [(1.0, 0.0), (0.34, 0.67)])   # all selected; 1 selected + 2 excluded
def test_every_block_skipped_gives_exactly_zero(ratio, negligible):
    q, k, v = _inputs(1, 2, 1, 40, 40, 8)
    selection = _selection(q, k, 16, 16, ratio, negligible)
    assert skipped_blocks(selection).shape[-1] == 3                       # Tk = 3
    out = TRITON.masked_linear_attention(q, k, v, selection, feature_map="softmax", eps=1e-5)
    assert torch.equal(out, torch.zeros_like(q))


def _op_run(q, k, v, skipped, bq, bk, fmap, eps=1e-5):
    """``flexsparse::masked_linear``: output, query-block states and the gradients of q, k, v of a fixed
    random loss (torch.autograd through the registered backward)."""
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out, rows_h, rows_z = linear_op.masked_linear(*leaves, skipped, bq, bk, fmap, eps)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(0)).to(out.device)
    (out.double() * weight.double()).sum().backward()
    return [out, rows_h, rows_z] + [x.grad for x in leaves]


OP_NAMES = ["o", "rows_h", "rows_z", "dq", "dk", "dv"]
# (B, H, Hk, N, D, block_q, block_k, skipped per row (-1: all but one), feature map)
OP_CASES = [
    (1, 4, 2, 100, 16, 16, 32, 1, "softmax"),    # GQA, ragged last key block
    (1, 4, 2, 193, 32, 32, 16, 3, "elu"),        # GQA, block_q > block_k
    (2, 2, 2, 193, 16, 16, 16, 0, "relu"),       # empty skipped lists: full linear attention
    (1, 4, 2, 100, 32, 16, 16, -1, "softmax"),   # all but one key block skipped
    (1, 2, 1, 100, 24, 32, 32, 2, "elu"),        # head dim not a power of two (masked dims)
    (1, 2, 2, 193, 16, 64, 32, 2, "relu"),       # blocks larger than the interpreter's 16-row tiles
]


STRATEGIES = {"gather": {"dense_ratio": 2.0, "dense_ratio_bwd": 2.0},   # linear_fwd.dense, forward / backward
              "dense": {"dense_ratio": 0.0, "dense_ratio_bwd": 0.0},
              "gather_then_dense": {"dense_ratio": 2.0, "dense_ratio_bwd": 0.0}}


@pytest.fixture(params=list(STRATEGIES))
def strategy(request, monkeypatch):
    """Each test runs with the gather and with the dense block-sum strategy forced, and with a gather forward
    before a dense backward (``FLEXSPARSE_TRITON_TILES``, read at every call)."""
    monkeypatch.setenv("FLEXSPARSE_TRITON_TILES", json.dumps({"linear": STRATEGIES[request.param]}))
    return request.param


@cpu_only
@pytest.mark.parametrize("b,h,hk,n,d,bq,bk,width,fmap", OP_CASES)
def test_kernels_match_pytorch_path(b, h, hk, n, d, bq, bk, width, fmap, strategy):
    """fp32 kernels (interpreter) against the ops' PyTorch path on fp64 copies of the same inputs."""
    q, k, v = _inputs(b, h, hk, n, n, d)
    tk = num_blocks(n, bk)
    skipped = ts.random_selection(b, h, n, n, bq, bk, tk - 1 if width < 0 else width).indices
    got = _op_run(q, k, v, skipped, bq, bk, fmap)
    want = _op_run(q.double(), k.double(), v.double(), skipped, bq, bk, fmap)
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.float32
    for name, a, w in zip(OP_NAMES, got, want):
        assert ts.rel_err(a, w) < 1e-5, name


@cpu_only
@pytest.mark.parametrize("fmap", ["softmax", "elu", "relu"])
def test_kernels_match_torch_linear_reference(fmap):
    """Against the PyTorch gather form (``linear.naive``, fp64) through a ``BlockSelection`` of the same skipped table,
    and with nothing skipped against full linear attention."""
    b, h, hk, n, d, bq, bk = 1, 4, 2, 193, 16, 32, 16
    q, k, v = _inputs(b, h, hk, n, n, d)
    selection = ts.random_selection(b, h, n, n, bq, bk, 4)
    skipped = selection.indices
    got = _op_run(q, k, v, skipped, bq, bk, fmap)
    want = _run(linear_naive.masked_linear_attention, q.double(), k.double(), v.double(), selection, fmap)
    for name, a, w in zip(["o", "dq", "dk", "dv"], got[:1] + got[3:], want):
        assert ts.rel_err(a, w) < 1e-5, name
    got = _op_run(q, k, v, skipped[..., :0], bq, bk, fmap)
    full = _run(lambda q, k, v, s, feature_map, eps: linear_naive.linear_attention(q, k, v, feature_map=feature_map,
                                                                                   eps=eps),
                q.double(), k.double(), v.double(), selection, fmap)
    for name, a, w in zip(["o", "dq", "dk", "dv"], got[:1] + got[3:], full):
        assert ts.rel_err(a, w) < 1e-5, f"full {name}"


@cpu_only
def test_fp16_kernels(strategy):
    """fp16 inputs: fp32 states and exact fp32 dots, output and gradients in fp16."""
    q, k, v = _inputs(1, 4, 2, 100, 100, 16)
    skipped = ts.random_selection(1, 4, 100, 100, 16, 32, 2).indices
    got = _op_run(q.half(), k.half(), v.half(), skipped, 16, 32, "softmax")
    want = _op_run(q.double(), k.double(), v.double(), skipped, 16, 32, "softmax")
    assert got[0].dtype == torch.float16 and got[3].dtype == torch.float16
    for name, a, w in zip(OP_NAMES, got, want):
        assert ts.rel_err(a, w) < 5e-3, name


@cpu_only
def test_unknown_feature_map_and_wide_heads():
    """A feature map the kernels do not know raises naming the argument; D > 128 keeps the PyTorch path."""
    q, k, v = _inputs(1, 2, 1, 40, 40, 16)
    skipped = ts.random_selection(1, 2, 40, 40, 16, 16, 1).indices
    with pytest.raises(ValueError, match="feature_map"):
        linear_op.masked_linear(q, k, v, skipped, 16, 16, "gelu", 1e-5)
    q, k, v = _inputs(1, 2, 1, 40, 40, 136)
    assert not linear_op.linear_kernels(q)
    got = _op_run(q, k, v, skipped, 16, 16, "elu")
    want = _op_run(q.double(), k.double(), v.double(), skipped, 16, 16, "elu")
    for name, a, w in zip(OP_NAMES, got, want):
        assert ts.rel_err(a, w) < 1e-5, name


@cpu_parent
def test_strategy_rule():
    from flexsparse.triton.linear.fwd import dense, linear_tiles
    skipped = torch.zeros(1, 1, 4, 3, dtype=torch.int32)
    cuda = torch.device("cuda")
    bf16_64, bf16_128 = linear_tiles(cuda, 64, torch.bfloat16), linear_tiles(cuda, 128, torch.bfloat16)
    assert dense(skipped, 150, bf16_64) and not dense(skipped, 151, bf16_64)      # 2% forward at D <= 64
    assert dense(skipped, 600, bf16_64, backward=True) and not dense(skipped, 601, bf16_64, backward=True)
    assert dense(skipped, 600, bf16_128) and not dense(skipped, 601, bf16_128)    # 0.5% at D = 128
    assert not dense(skipped, 10, linear_tiles(cuda, 64, torch.float32))           # fp32: always gather
    assert not dense(skipped, 10, linear_tiles(cuda, 64, torch.float32), backward=True)
    assert not dense(skipped[..., :0], 10, {"dense_ratio": 0.0})                   # nothing skipped
    assert not dense(skipped, 10, linear_tiles(torch.device("cpu"), 64, torch.float32))


@cpu_only
def test_opcheck_kernels(strategy):
    q, k, v = _inputs(1, 4, 2, 50, 50, 16)
    skipped = ts.random_selection(1, 4, 50, 50, 16, 16, 2).indices
    args = (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), skipped, 16, 16, "elu", 1e-5)
    utils = ("test_schema", "test_autograd_registration")   # fake tensors cannot run interpreted kernels
    torch.library.opcheck(linear_op.masked_linear.op, args, test_utils=utils)
    out, rows_h, rows_z = linear_op.masked_linear(*args)
    bwd_args = (torch.randn_like(out), q.detach(), k.detach(), v.detach(), skipped, rows_h, rows_z, 16, 16, "elu",
                1e-5)
    torch.library.opcheck(linear_op.masked_linear_bwd.op, bwd_args, test_utils=utils)
    torch.library.opcheck(linear_op.masked_linear_bwd.op, bwd_args + (None, None, None, out.detach()), test_utils=utils)
    torch.library.opcheck(linear_op.masked_linear_bwd.op, bwd_args + (None, None, None, out.detach(), torch.eye(16)),
                          test_utils=utils)


@cpu_only
@pytest.mark.parametrize("b,h,hk,n,d,bq,bk,width,fmap", OP_CASES[:2])
def test_backward_from_saved_output_equals_recomputed(b, h, hk, n, d, bq, bk, width, fmap, strategy):
    """``masked_linear_bwd`` given the forward's O_l (the query-gradient kernel reads it: one product fewer) equals
    the kernel that recomputes it, fp32 (interpreter): dq, dk, dv."""
    q, k, v = _inputs(b, h, hk, n, n, d)
    skipped = ts.random_selection(b, h, n, n, bq, bk, width).indices
    out, rows_h, rows_z = linear_op.masked_linear(q, k, v, skipped, bq, bk, fmap, 1e-5)
    do = torch.randn_like(out)
    recomputed = linear_op.masked_linear_bwd(do, q, k, v, skipped, rows_h, rows_z, bq, bk, fmap, 1e-5)
    saved = linear_op.masked_linear_bwd(do, q, k, v, skipped, rows_h, rows_z, bq, bk, fmap, 1e-5, o_l=out)
    for name, a, w in zip("qkv", saved, recomputed):
        assert w.abs().max() > 0, name
        assert ts.rel_err(a, w) < 1e-6, name


@cpu_only
@pytest.mark.parametrize("b,h,hk,n,d,bq,bk,width,fmap", OP_CASES[:2])
def test_backward_through_projection_equals_projected_gradient(b, h, hk, n, d, bq, bk, width, fmap, strategy):
    """``masked_linear_bwd`` given SLA's ``W`` and the combine's gradient equals it given ``dout W``: fp16 (the
    query-gradient kernel projects it) and fp32 (a matmul first), interpreter and the PyTorch path: dq, dk, dv."""
    for dtype, tol in ((torch.float16, 3e-3), (torch.float32, 1e-5)):
        q, k, v = _inputs(b, h, hk, n, n, d, dtype)
        skipped = ts.random_selection(b, h, n, n, bq, bk, width).indices
        out, rows_h, rows_z = linear_op.masked_linear(q, k, v, skipped, bq, bk, fmap, 1e-5)
        dout, weight = torch.randn_like(out), torch.randn(d, d) / d**0.5
        for interpreted in (True, False):
            with ts.interpreter_env(interpreted):
                projected = linear_op.masked_linear_bwd(dout @ weight.to(dtype), q, k, v, skipped, rows_h, rows_z, bq,
                                                        bk, fmap, 1e-5, o_l=out)
                got = linear_op.masked_linear_bwd(dout, q, k, v, skipped, rows_h, rows_z, bq, bk, fmap, 1e-5, o_l=out,
                                                  weight=weight)
            for name, a, w in zip("qkv", got, projected):
                assert w.abs().max() > 0, name
                assert ts.rel_err(a, w) < tol, (name, dtype, interpreted)


def _assert_column_sums(x: torch.Tensor, bias_dtype: torch.dtype) -> None:
    """``linear_op.column_sums(x)`` against an fp64 sum: one rounding to ``bias_dtype`` and an accumulation error
    of a few fp32 (fp64 for fp64) ulps of the column's root sum of squares."""
    rows = x.shape[0]
    want = x.double().sum(0)
    accumulation = torch.finfo(torch.float64 if x.dtype == torch.float64 else torch.float32).eps
    bound = want.abs() * torch.finfo(bias_dtype).eps + 64 * accumulation * (rows * x.double().square().sum(0)).sqrt()
    got = linear_op.column_sums(x, bias_dtype)
    assert got.shape == want.shape and got.dtype == bias_dtype
    assert ((got.double() - want).abs() <= bound).all(), rows


COLUMN_SUMS_DTYPES = [(torch.bfloat16, torch.float32), (torch.float16, torch.float16), (torch.float64, torch.float64)]


@cpu_parent
@pytest.mark.parametrize("dtype, bias_dtype", COLUMN_SUMS_DTYPES)
def test_bias_gradient_column_sums_on_both_paths(monkeypatch, dtype, bias_dtype):
    """SLA's bias gradient: the row sum and the matmul with ones (from SUMS_BY_MATMUL rows, lowered here)."""
    rows, d = int(torch.randint(300, 900, ())), int(torch.randint(1, 5, ())) * 16
    x = torch.randn(rows, d, dtype=torch.float64).to(dtype)
    for threshold in (rows + 1, rows):
        monkeypatch.setattr(linear_op, "SUMS_BY_MATMUL", threshold)
        _assert_column_sums(x, bias_dtype)


@cpu_parent
def test_bias_gradient_column_sums_of_symbolic_rows_take_the_sum(monkeypatch):
    """A graph traced for any length sums without comparing the length (no guard on it)."""
    from torch.fx.experimental.proxy_tensor import make_fx
    monkeypatch.setattr(linear_op, "SUMS_BY_MATMUL", 1)
    x = torch.randn(37, 16)
    traced = make_fx(lambda x: linear_op.column_sums(x, torch.float32), tracing_mode="symbolic")(x)
    targets = {str(node.target) for node in traced.graph.nodes if node.op == "call_function"}
    assert "aten.sum.dim_IntList" in targets and not any("bmm" in t or "ones" in t for t in targets), targets
    torch.testing.assert_close(traced(x), x.sum(0))


@cpu_parent
def test_triton_backend_gets_the_triton_branch():
    assert type(TRITON).masked_linear_attention is TritonBackend.masked_linear_attention
    assert type(TORCH).masked_linear_attention is Backend.masked_linear_attention


@cpu_parent
def test_cpu_fallback_without_interpreter():
    """Without the interpreter the op bodies gather in PyTorch; same results as the torch backend."""
    q, k, v = _inputs(2, 4, 2, 41, 41, 8)
    selection = _selection(q, k, 8, 4, 0.2, 0.2)
    with ts.interpreter_env(False):
        got = _run(TRITON.masked_linear_attention, q, k, v, selection, "elu")
    want = _run(linear_naive.masked_linear_attention, q, k, v, selection, "elu")
    for name, a, w in zip(["o", "dq", "dk", "dv"], got, want):
        assert ts.rel_err(a, w) < 1e-5, name


@cpu_parent
def test_opcheck_cpu_fallback():
    q, k, v = _inputs(1, 2, 1, 37, 37, 8)
    selection = _selection(q, k, 8, 4, 0.3, 0.2)
    args = (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), skipped_blocks(selection), 8, 4, "softmax",
            1e-5)
    with ts.interpreter_env(False):  # aot_dispatch_dynamic takes ~10 s on 2 cores: the GPU opcheck runs it
        torch.library.opcheck(linear_op.masked_linear.op, args,
                              test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


MIXES = ["proj", "alpha_shared", "alpha_per_head"]


def _mix_params(kind: str, heads: int, tq: int, d: int, device="cpu") -> dict:
    """Random (never zero) mixing parameters of ``kind``, fp32: SLA's weight and bias or SLA2's alpha logits, on a
    grid of 1/32 in (-4, 4) (exact in bf16 and fp16: every float dtype of them gives the same alpha)."""
    gen = torch.Generator().manual_seed(1)
    if kind == "proj":
        return {"weight": torch.randn(d, d, generator=gen).div(d**0.5).to(device),
                "bias": torch.randn(d, generator=gen).to(device)}
    rows = heads if kind == "alpha_per_head" else 1
    logit = torch.randn(rows, tq, generator=gen).mul(32).round().clamp(-127, 127).div(32)
    return {"alpha_logit": logit.to(device)}


def _unfused(q, k, v, selection, o_s, fmap, weight=None, bias=None, alpha_logit=None):
    """The branch (``masked_linear_attention``) combined in PyTorch as the methods do without the fused kernel."""
    o_l = TRITON.masked_linear_attention(q, k, v, selection, feature_map=fmap, eps=1e-5)
    if weight is not None:
        return o_s + torch.nn.functional.linear(o_l, weight.to(q.dtype), bias.to(q.dtype))
    tokens = torch.arange(q.shape[2], device=q.device) // selection.block_q
    return torch.lerp(o_l, o_s, torch.sigmoid(alpha_logit).to(q.dtype)[:, tokens].unsqueeze(-1))


def _mix_run(fn, q, k, v, selection, o_s, params, fmap):
    """Output and the gradients of q, k, v, o_s and the mixing parameters of a fixed random loss."""
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, o_s)]
    extra = {name: t.detach().clone().requires_grad_() for name, t in params.items()}
    out = fn(*leaves[:3], selection, leaves[3], fmap, **extra)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(0)).to(out.device)
    (out.float() * weight).sum().backward()
    return {"out": out, **{n: x.grad for n, x in zip("qkvs", leaves)}, **{n: t.grad for n, t in extra.items()}}


def _fused(q, k, v, selection, o_s, fmap, **params):
    return TRITON.mixed_linear_output(q, k, v, selection, o_s, feature_map=fmap, eps=1e-5, **params)


@cpu_only
@pytest.mark.parametrize("kind", MIXES)
@pytest.mark.parametrize("b,h,hk,nq,nk,d,bq,bk,ratio,negligible,fmap", CASES[:3])
def test_mixed_output_matches_unfused(kind, b, h, hk, nq, nk, d, bq, bk, ratio, negligible, fmap, strategy):
    """The combine in the output kernel (fp32, interpreter) equals the branch combined in PyTorch: output and the
    gradients of q, k, v, o_s and weight / bias / alpha's logits (GQA, odd N, block_q != block_k, excluded blocks)."""
    q, k, v = _inputs(b, h, hk, nq, nk, d)
    o_s = torch.randn_like(q)
    selection = _selection(q, k, bq, bk, ratio, negligible)
    params = _mix_params(kind, h, selection.num_q_blocks, d)
    got = _mix_run(_fused, q, k, v, selection, o_s, params, fmap)
    want = _mix_run(_unfused, q, k, v, selection, o_s, params, fmap)
    assert set(got) == set(want) and got["out"].dtype == q.dtype
    for name in want:
        assert want[name].abs().max() > 0, name                    # every gradient is exercised
        assert ts.rel_err(got[name], want[name]) < 1e-5, name


@cpu_only
def test_mixed_output_inference_all_skipped_and_opcheck():
    """Without gradients O_l is not stored (same output as with it); every block skipped gives None (O_l = 0:
    the methods combine in PyTorch); opcheck of ``masked_linear_mix``; weight together with alpha's logits is
    refused."""
    q, k, v = _inputs(1, 4, 2, 50, 50, 16)
    o_s = torch.randn_like(q)
    selection = _selection(q, k, 16, 16, 0.25, 0.0)
    params = _mix_params("proj", 4, selection.num_q_blocks, 16)
    with torch.no_grad():
        out = _fused(q, k, v, selection, o_s, "elu", **params)
    trained = _fused(q, k, v, selection, o_s, "elu", **{n: t.clone().requires_grad_() for n, t in params.items()})
    assert trained.requires_grad and torch.equal(out, trained.detach())
    everything = BlockSelection(torch.zeros(1, 4, 4, 1, dtype=torch.int32), 16, 16, 50, 50,
                                excluded=torch.arange(1, 4, dtype=torch.int32).expand(1, 4, 4, 3).contiguous())
    assert _fused(q, k, v, everything, o_s, "elu", **params) is None
    skipped = skipped_blocks(selection)
    args = (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), skipped, o_s.requires_grad_(),
            params["weight"].requires_grad_(), params["bias"].requires_grad_(), None, 16, 16, "elu", 1e-5, True)
    torch.library.opcheck(linear_op.masked_linear_mix.op, args,
                          test_utils=("test_schema", "test_autograd_registration"))
    with pytest.raises(ValueError, match="either weight .* or alpha_logit"):
        linear_op.masked_linear_mix(q, k, v, skipped, o_s, params["weight"], None, torch.ones(1, 4), 16, 16, "elu",
                                  1e-5, False)


@cpu_only
@pytest.mark.parametrize("kind", MIXES)
def test_mixed_output_rounds_fp32_parameters_in_kernel(kind):
    """fp16 inputs with SLA's bias or SLA2's alpha logits in fp32 (as the methods pass them, uncast): the output
    kernel rounds the bias, and alpha (the logits' fp32 sigmoid), to fp16, so the output is bitwise the one of the
    parameters cast beforehand (logits exact in fp16: the same alpha); the lerp's backward likewise, on the kernel
    and on the PyTorch path."""
    q, k, v = _inputs(1, 2, 1, 37, 37, 16, torch.float16)
    o_s = torch.randn_like(q)
    selection = _selection(q, k, 8, 8, 0.3, 0.0)
    params = _mix_params(kind, 2, selection.num_q_blocks, 16)
    cast = {name: t if name == "weight" else t.half() for name, t in params.items()}
    assert not torch.equal(_fused(q, k, v, selection, o_s, "elu", **cast), o_s)
    assert torch.equal(_fused(q, k, v, selection, o_s, "elu", **params), _fused(q, k, v, selection, o_s, "elu", **cast))
    if kind != "proj":
        dout, o_l = torch.randn_like(q), torch.randn_like(q)
        for interpreted in (True, False):
            with ts.interpreter_env(interpreted):
                got = linear_op.lerp_mix_bwd(dout, o_s, o_l, params["alpha_logit"], 8)
                want = linear_op.lerp_mix_bwd(dout, o_s, o_l, cast["alpha_logit"], 8)
            assert all(torch.equal(a, b) for a, b in zip(got, want))


def _both_run(fn, q, k, v, selection, params, fmap):
    """Output, LSE and the gradients of q, k, v and the mixing parameters of a fixed random loss on both."""
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    extra = {name: t.detach().clone().requires_grad_() for name, t in params.items()}
    out, lse = fn(*leaves, selection, fmap, **extra)
    gen = torch.Generator().manual_seed(0)
    weight, lse_weight = (torch.randn(x.shape, generator=gen).to(x.device) for x in (out, lse))
    ((out.float() * weight).sum() + (lse * lse_weight).sum()).backward()
    return {"out": out, "lse": lse, **{n: x.grad for n, x in zip("qkv", leaves)},
            **{n: t.grad for n, t in extra.items()}}


def _one_op(q, k, v, selection, fmap, quant=None, **params):
    return TRITON.sparse_linear_output(q, k, v, selection, 0.3, deterministic=True, quant=quant, feature_map=fmap,
                                       eps=1e-5, **params)


def _two_ops(q, k, v, selection, fmap, quant=None, **params):
    """The sparse branch (op ``block_attn``, or ``block_attn_fp8`` with ``quant``) and ``mixed_linear_output`` as
    separate ops, autograd summing dq, dk, dv."""
    o_s, lse = TRITON.block_sparse_attention(q, k, v, selection, 0.3, deterministic=True, quant=quant)
    return _fused(q, k, v, selection, o_s, fmap, **params), lse


@cpu_only
@pytest.mark.parametrize("kind", MIXES)
@pytest.mark.parametrize("b,h,hk,nq,nk,d,bq,bk,ratio,negligible,fmap", CASES[:3])
def test_sparse_linear_output_matches_two_ops(kind, b, h, hk, nq, nk, d, bq, bk, ratio, negligible, fmap):
    """Both branches and the combine in one op (``flexsparse::sparse_linear_mix``, whose linear kernels add their
    dq, dk, dv to the sparse branch's) equal the two ops (fp32, interpreter): output, LSE and the gradients of q,
    k, v (GQA: summed over the group in both) and weight / bias / alpha's logits, with a gradient on the LSE as well."""
    q, k, v = _inputs(b, h, hk, nq, nk, d)
    selection = _selection(q, k, bq, bk, ratio, negligible)
    params = _mix_params(kind, h, selection.num_q_blocks, d)
    got = _both_run(_one_op, q, k, v, selection, params, fmap)
    want = _both_run(_two_ops, q, k, v, selection, params, fmap)
    assert set(got) == set(want)
    for name in want:
        assert want[name].abs().max() > 0, name
        assert ts.rel_err(got[name], want[name]) < 1e-5, name


@cpu_only
@pytest.mark.parametrize("kind", ["alpha_per_head", "proj"])      # the default tier's case: the fused mix_fp8
@pytest.mark.parametrize("d", [16, 24])
@pytest.mark.parametrize("strategy", ["dense", "gather"])
def test_sparse_linear_output_with_quant_matches_two_ops(strategy, kind, d, monkeypatch):
    """With ``quant`` the one op's sparse branch is the FP8 forward: output and LSE equal the FP8 op's followed by
    ``mixed_linear_output``, and so do the gradients (the QAT ones of the sparse branch, the linear kernels adding
    theirs), an LSE gradient included (fp32, interpreter; torchao for the config). On the dense strategy SLA2's
    linear branch is mixed in the FP8 kernel's epilogue (``mix_fp8``; D = 24: masked head dims)."""
    pytest.importorskip("torchao")
    from flexsparse.config import QuantConfig
    from flexsparse.triton.linear import mix_fp8
    monkeypatch.setenv("FLEXSPARSE_TRITON_TILES", json.dumps({"linear": STRATEGIES[strategy]}))
    calls = []
    fused = mix_fp8.sparse_linear_forward_fp8
    monkeypatch.setattr(mix_fp8, "sparse_linear_forward_fp8", lambda *a, **kw: calls.append(1) or fused(*a, **kw))
    q, k, v = _inputs(1, 4, 2, 90, 90, d)
    selection = _selection(q, k, 16, 16, 0.25, 0.0)
    params = _mix_params(kind, 4, selection.num_q_blocks, d)
    got = _both_run(partial(_one_op, quant=QuantConfig()), q, k, v, selection, params, "softmax")
    assert bool(calls) == (strategy == "dense" and kind != "proj")
    want = _both_run(partial(_two_ops, quant=QuantConfig()), q, k, v, selection, params, "softmax")
    plain = _both_run(_one_op, q, k, v, selection, params, "softmax")
    assert torch.equal(got["out"], want["out"]) and torch.equal(got["lse"], want["lse"])
    assert ts.rel_err(got["out"], plain["out"]) > 1e-3
    for name in want:
        assert ts.rel_err(got[name], want[name]) < 1e-5, name


@cpu_only
def test_sparse_linear_mix_opcheck_and_inference():
    """opcheck of ``sparse_linear_mix``; without gradients O_l is not stored and the output is the same; every block
    skipped gives None (the methods run the sparse branch alone then)."""
    q, k, v = _inputs(1, 4, 2, 50, 50, 16)
    selection = _selection(q, k, 16, 16, 0.25, 0.0)
    params = _mix_params("alpha_per_head", 4, selection.num_q_blocks, 16)
    with torch.no_grad():
        out, lse = _one_op(q, k, v, selection, "relu", **params)
    trained = _one_op(q, k, v, selection, "relu", **{n: t.clone().requires_grad_() for n, t in params.items()})
    assert trained[0].requires_grad and torch.equal(out, trained[0].detach()) and torch.equal(lse, trained[1])
    everything = BlockSelection(torch.zeros(1, 4, 4, 1, dtype=torch.int32), 16, 16, 50, 50,
                                excluded=torch.arange(1, 4, dtype=torch.int32).expand(1, 4, 4, 3).contiguous())
    assert _one_op(q, k, v, everything, "relu", **params) is None
    args = (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), selection.indices.contiguous(),
            skipped_blocks(selection), None, None, params["alpha_logit"].requires_grad_(), 16, 16, 0.25, False, "relu",
            1e-5, True)
    for fp8 in (False, True):
        torch.library.opcheck(linear_op.sparse_linear_mix.op, (*args, fp8),
                              test_utils=("test_schema", "test_autograd_registration"))


def _assert_rounded_once(grads, dout, alpha_logit, block_q):
    """``grads = (d o_s, d O_l)`` are ``alpha dout`` and ``(1 - alpha) dout`` rounded once (half a unit in the last
    place, a hair more for the fp32 product rounded again; no cancellation error), alpha the logits' sigmoid rounded
    to dout's dtype. An fp32 sigmoid may differ from the exact one by a few units in fp32's last place, so alpha may
    round to either neighbour of the exact value in bf16 / fp16 (in fp32: lie within a few units of it, and
    ``1 - alpha`` rounds once more): the bound allows that much of ``dout``."""
    tokens = torch.arange(dout.shape[2], device=dout.device) // block_q
    exact = torch.sigmoid(alpha_logit.double())[:, tokens, None]
    eps = torch.finfo(dout.dtype).eps
    spread = 4 * eps if dout.dtype == torch.float32 else eps * exact
    for grad, weight in zip(grads, (exact, 1 - exact)):
        want = dout.double() * weight
        bound = 0.51 * eps * want.abs() + dout.double().abs() * spread + torch.finfo(dout.dtype).smallest_normal
        assert ((grad.double() - want).abs() <= bound).all()


def _lerp_inputs(b, h, n, d, bq, rows, dtype, device="cpu"):
    """dout, o_s, o_l ``(b, h, n, d)`` and alpha's logits ``(rows, Tq)`` in ``dtype``."""
    dout, o_s, o_l = (torch.randn(b, h, n, d).to(device=device, dtype=dtype) for _ in range(3))
    return dout, o_s, o_l, torch.randn(rows, num_blocks(n, bq)).mul(2).to(device=device, dtype=dtype)


LERP_CASES = [(2, 3, 37, 8, 16, 3), (1, 2, 300, 64, 128, 1), (1, 1, 20, 12, 64, 1), (2, 2, 64, 16, 32, 2)]


@cpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("b,h,n,d,bq,rows", LERP_CASES)
def test_lerp_mix_bwd_kernel_matches_pytorch_path(b, h, n, d, bq, rows, dtype):
    """SLA2's combine backward in one kernel pass (interpreter) and the PyTorch path: d o_s and d O_l the fp32
    products rounded once (``_assert_rounded_once``: within half a unit in the last place), alpha's logits'
    gradient to fp32 rounding of its sum times the sigmoid's derivative; ragged last blocks, blocks of several chunks,
    one logit row or one per head, head dims that are not powers of two."""
    args = _lerp_inputs(b, h, n, d, bq, rows, dtype)
    got = linear_op.lerp_mix_bwd(*args, bq)
    with ts.interpreter_env(False):
        want = linear_op.lerp_mix_bwd(*args, bq)
    _assert_rounded_once(got[:2], args[0], args[3], bq)
    _assert_rounded_once(want[:2], args[0], args[3], bq)
    assert got[2].shape == (rows, num_blocks(n, bq)) and got[2].dtype == torch.float32
    terms = (args[0].double() * (args[1] - args[2]).double()).flatten(-2)
    terms = torch.nn.functional.pad(terms, (0, num_blocks(n, bq) * bq * d - n * d)).unflatten(-1, (-1, bq * d))
    alpha = torch.sigmoid(args[3].double())
    slope = alpha * (1 - alpha)

    def per_logit(x):
        return (x.sum((0, -1)) if rows > 1 else x.sum((0, 1, -1)).unsqueeze(0)) * slope

    # an fp32 sum's error scales with the sum of |terms|, not with the sum itself, which can cancel (a seed gave
    # |sum| = 0.084 and a 1.2e-5 relative error against a 1e-5 bound)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert ((got[2].double() - per_logit(terms)).abs() <= tol * per_logit(terms.abs())).all()
    torch.library.opcheck(linear_op.lerp_mix_bwd.op, (*args, bq), test_utils=("test_schema",))  # fake: on the GPU


@cpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("b,h,n,d", [(2, 3, 37, 8), (1, 2, 300, 64), (1, 1, 5, 12)])
def test_center_tokens_kernel_matches_pytorch(b, h, n, d, dtype):
    """``x - mean`` in one kernel pass (interpreter) equals PyTorch's fp32 difference rounded once, also for a
    strided x (a transposed (B, N, H, D) layout) and ragged tiles."""
    x = (3 + torch.randn(b, n, h, d)).to(dtype).transpose(1, 2)
    mean = x.float().mean(2, keepdim=True)
    got = center_tokens(x, mean)
    assert got.dtype == dtype and torch.equal(got, (x.float() - mean).to(dtype))
    torch.library.opcheck(center_tokens.op, (x, mean), test_utils=("test_schema",))  # fake: on the GPU


@cpu_parent
def test_mixed_output_leaves_other_cases_to_pytorch():
    """``mixed_linear_output`` is None where the kernels do not run (CPU without the interpreter, fp64); the op itself
    raises there, naming what it needs."""
    q, k, v = _inputs(1, 2, 1, 40, 40, 8)
    selection = _selection(q, k, 8, 8, 0.2, 0.0)
    params = _mix_params("alpha_shared", 2, selection.num_q_blocks, 8)
    with ts.interpreter_env(False):
        assert _fused(q, k, v, selection, torch.randn_like(q), "elu", **params) is None
        with pytest.raises(ValueError, match="Triton kernels only"):
            linear_op.masked_linear_mix(q, k, v, skipped_blocks(selection), q, None, None, params["alpha_logit"], 8, 8,
                                        "elu", 1e-5, False)
    with ts.interpreter_env(True):
        assert _fused(q.double(), k.double(), v.double(), selection, q.double(), "elu", **params) is None


# (B, H, Tq, Tk, S, repeat, dtype): one skipped block, all but one, rows longer than a store tile (Tk x repeat >
# 1024), repeated rows (the backward's query tiles); bf16 on the GPU only (the interpreter has no bf16 constants).
KEEP_CASES = [(1, 2, 5, 7, 1, 1, torch.float32), (2, 3, 4, 9, 8, 2, torch.float16), (1, 1, 3, 700, 35, 2,
              torch.float16), (1, 2, 6, 1030, 3, 1, torch.float32)]


def _check_keep_rows(b, h, tq, tk, width, repeat, dtype, device="cpu"):
    """``dense.keep_rows`` equals ``masks.keep_map`` with repeated rows, on distinct random skipped ids per row."""
    from flexsparse.masks import keep_map
    from flexsparse.triton._runtime.sizes import repeat_rows
    from flexsparse.triton.linear.dense import keep_rows
    skipped = ts.random_selection(b, h, tq, tk, 1, 1, width, device).indices
    got = keep_rows(skipped, tk, dtype, repeat)
    assert got.dtype == dtype and got.is_contiguous()
    assert torch.equal(got, repeat_rows(keep_map(skipped, tk, dtype), repeat))


@cpu_only
@pytest.mark.parametrize("b,h,tq,tk,width,repeat,dtype", KEEP_CASES)
def test_keep_rows_kernel_equals_keep_map(b, h, tq, tk, width, repeat, dtype):
    _check_keep_rows(b, h, tq, tk, width, repeat, dtype)


# (C, M, K, D, transposed map, dtype): ragged tiles, the backward's keep^T (a transposed view), one row and column
SUMS_CASES = [(2, 5, 7, 16, False, torch.float32), (3, 70, 40, 24, True, torch.float16),
              (1, 1, 1, 16, False, torch.float32)]
ROUNDING = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 8e-3}


def _check_block_sums(c, m, k, d, transposed, dtype, device="cpu"):
    """``dense.block_sums``' one-launch kernel against fp64 matmuls of the same 0/1 map and states: ``a @ h`` rounded
    once to h's dtype, ``a @ z`` in fp32."""
    from flexsparse.triton.linear.dense import SMALL_SUMS, block_sums
    assert c * m * k * (d * d + d) <= SMALL_SUMS      # the kernel's size, not cuBLAS's
    a = (torch.rand((c, k, m) if transposed else (c, m, k), device=device) > 0.5).to(dtype)
    a = a.transpose(1, 2) if transposed else a
    h, z = (torch.randn(c, k, width, device=device).to(dtype) for width in (d * d, d))
    got_h, got_z = block_sums(a, h, z)
    assert got_h.dtype == dtype and got_z.dtype == torch.float32
    assert ts.rel_err(got_h, a.double() @ h.double()) < ROUNDING[dtype]
    assert ts.rel_err(got_z, a.double() @ z.double()) < 1e-6


@cpu_only
@pytest.mark.parametrize("c,m,k,d,transposed,dtype", SUMS_CASES)
def test_block_sums_kernel_matches_matmuls(c, m, k, d, transposed, dtype):
    _check_block_sums(c, m, k, d, transposed, dtype)


# (B, H, Hk, Tq, Tk, S, repeat, D, dtype): GQA, ragged tiles, the backward's repeated rows, one skipped block
SKIPPED_SUMS_CASES = [(2, 4, 2, 5, 37, 3, 1, 8, torch.float32), (1, 2, 1, 40, 9, 1, 2, 16, torch.float16)]


def _check_skipped_sums(b, h, hk, tq, tk, width, repeat, d, dtype, device="cpu"):
    """``dense.query_sums`` and ``key_sums`` from skipped lists, on the sums kernel (the map's tiles made in it)
    and on the ``keep_rows`` + ``block_sums`` path (``SMALL_SUMS = 0``), against fp64 matmuls of ``masks.keep_map``."""
    from flexsparse.masks import keep_map
    from flexsparse.triton._runtime.sizes import repeat_rows
    from flexsparse.triton.linear import dense
    skipped = ts.random_selection(b, h, tq, tk, 1, 1, width, device).indices
    group = h // hk
    keep = keep_map(skipped, tk, torch.float64).view(b, hk, group * tq, tk)
    hs, zs = (torch.randn(b, hk, tk, *shape, device=device).to(dtype) for shape in ((d, d), (d,)))
    d_hq, d_zq = (torch.randn(b, h, tq * repeat, *shape, device=device).to(dtype) for shape in ((d, d), (d,)))
    back = repeat_rows(keep.view(b, h, tq, tk), repeat).view(b, hk, group * tq * repeat, tk).transpose(-1, -2)
    want = (keep @ hs.double().flatten(-2), keep @ zs.double(),
            back @ d_hq.double().view(b, hk, -1, d * d), back @ d_zq.double().view(b, hk, -1, d))
    for small in (dense.SMALL_SUMS, 0):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(dense, "SMALL_SUMS", small)
            got = (*dense.query_sums(skipped, hs, zs), *dense.key_sums(skipped, d_hq, d_zq, hk, tk, repeat))
        for name, g, w in zip(("H", "Z", "dh", "dz"), got, want):
            assert g.dtype == (dtype if name in ("H", "dh") else torch.float32), name
            assert ts.rel_err(g.double().reshape(w.shape), w) < ROUNDING[dtype], (name, small)


@cpu_only
@pytest.mark.parametrize("b,h,hk,tq,tk,width,repeat,d,dtype", SKIPPED_SUMS_CASES)
def test_sums_from_skipped_lists_match_keep_map(b, h, hk, tq, tk, width, repeat, d, dtype):
    _check_skipped_sums(b, h, hk, tq, tk, width, repeat, d, dtype)


# ----------------------------------------------------------------------------------------------- GPU


@gpu
@pytest.mark.parametrize("dtype, bias_dtype", COLUMN_SUMS_DTYPES[:2])
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_bias_gradient_column_sums_on_both_paths(dtype, bias_dtype, d):
    for rows in (linear_op.SUMS_BY_MATMUL - 1, linear_op.SUMS_BY_MATMUL + 37):
        _assert_column_sums(torch.randn(rows, d, device="cuda").to(dtype), bias_dtype)


@gpu
@pytest.mark.parametrize("b,h,hk,tq,tk,width,repeat,d,dtype", SKIPPED_SUMS_CASES + [
    (2, 8, 8, 64, 64, 3, 1, 64, torch.bfloat16), (1, 8, 2, 128, 256, 13, 2, 128, torch.bfloat16)])
def test_gpu_sums_from_skipped_lists_match_keep_map(b, h, hk, tq, tk, width, repeat, d, dtype):
    _check_skipped_sums(b, h, hk, tq, tk, width, repeat, d, dtype, "cuda")


@gpu
@pytest.mark.parametrize("c,m,k,d,transposed,dtype", SUMS_CASES + [(16, 64, 64, 64, False, torch.bfloat16),
                                                                   (2, 128, 64, 128, True, torch.bfloat16)])
def test_gpu_block_sums_kernel_matches_matmuls(c, m, k, d, transposed, dtype):
    _check_block_sums(c, m, k, d, transposed, dtype, "cuda")


@gpu
@pytest.mark.parametrize("b,h,tq,tk,width,repeat,dtype", KEEP_CASES + [(2, 3, 4, 9, 8, 2, torch.bfloat16),
                                                                       (2, 8, 1024, 1024, 51, 2, torch.bfloat16)])
def test_gpu_keep_rows_kernel_equals_keep_map(b, h, tq, tk, width, repeat, dtype):
    """The fill and the scatter of one program land in order (the barrier between them) on the GPU too."""
    for _ in range(3):
        _check_keep_rows(b, h, tq, tk, width, repeat, dtype, "cuda")


GPU_CASES = [  # (H, Hk, N, D, block_q, block_k, topk_ratio, negligible_ratio, feature map, dtype)
    (8, 8, 16384, 64, 64, 64, 0.05, 0.0, "softmax", torch.bfloat16),
    (8, 2, 16000, 128, 128, 64, 0.05, 0.1, "elu", torch.bfloat16),
    (4, 1, 16384, 64, 64, 128, 0.1, 0.0, "relu", torch.bfloat16),
    (4, 4, 8192, 64, 64, 64, 0.1, 0.05, "softmax", torch.float32),
    (4, 2, 4133, 128, 64, 64, 0.1, 0.0, "elu", torch.float32),
    (4, 2, 5000, 96, 64, 64, 0.1, 0.0, "softmax", torch.bfloat16),
]


@gpu
@pytest.mark.parametrize("h,hk,n,d,bq,bk,ratio,negligible,fmap,dtype", GPU_CASES)
def test_gpu_matches_pytorch_path(h, hk, n, d, bq, bk, ratio, negligible, fmap, dtype, strategy):
    """bf16 / fp32 kernels, both strategies, against the ops' PyTorch path on fp64 copies (the same skipped
    table): o, the saved query-block states and dq, dk, dv."""
    torch.manual_seed(0)
    q, k, v = _inputs(1, h, hk, n, n, d, dtype, "cuda")
    skipped = skipped_blocks(_selection(q, k, bq, bk, ratio, negligible))
    got = _op_run(q, k, v, skipped, bq, bk, fmap)
    want = _op_run(q.double(), k.double(), v.double(), skipped, bq, bk, fmap)
    assert got[0].dtype == dtype and got[3].dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for name, a, w in zip(OP_NAMES, got, want):
        assert ts.rel_err(a, w) < tol, name


@gpu
@pytest.mark.parametrize("h,hk,n,d,bq,bk,negligible,fmap", [
    (4, 4, 16384, 64, 64, 64, 0.1, "softmax"), (4, 2, 16000, 128, 128, 64, 0.0, "elu"),
    (2, 1, 16384, 64, 64, 64, 0.0, "relu")])
@pytest.mark.parametrize("compiled", [False, True])
def test_gpu_bf16_matches_torch_backend(h, hk, n, d, bq, bk, negligible, fmap, compiled):
    torch.manual_seed(0)
    q, k, v = _inputs(1, h, hk, n, n, d, torch.bfloat16, "cuda")
    selection = _selection(q, k, bq, bk, 0.05, negligible)

    def branch(q, k, v):
        return TRITON.masked_linear_attention(q, k, v, selection, feature_map=fmap, eps=1e-5)

    fn = torch.compile(branch, fullgraph=True) if compiled else branch
    got = _run(lambda q, k, v, s, feature_map, eps: fn(q, k, v), q, k, v, selection, fmap)
    want = _run(linear_naive.masked_linear_attention, q.float(), k.float(), v.float(), selection, fmap)
    assert got[0].dtype == torch.bfloat16
    for name, a, w in zip(["o", "dq", "dk", "dv"], got, want):
        assert ts.rel_err(a, w) < 1e-2, name


@gpu
def test_gpu_gradients_are_reproducible(strategy):
    """No atomics: two backward passes give bitwise equal dq, dk, dv."""
    torch.manual_seed(0)
    q, k, v = _inputs(2, 8, 2, 8192, 8192, 64, torch.bfloat16, "cuda")
    skipped = skipped_blocks(_selection(q, k, 64, 64, 0.1, 0.05))
    first, second = (_op_run(q, k, v, skipped, 64, 64, "softmax") for _ in range(2))
    for name, a, w in zip(OP_NAMES, first, second):
        assert torch.equal(a, w), name


@gpu
def test_gpu_opcheck(strategy):
    q, k, v = _inputs(1, 4, 2, 1000, 1000, 64, torch.bfloat16, "cuda")
    selection = _selection(q, k, 64, 32, 0.1, 0.1)
    args = (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), skipped_blocks(selection), 64, 32, "softmax",
            1e-5)
    torch.library.opcheck(linear_op.masked_linear.op, args)
    out, rows_h, rows_z = linear_op.masked_linear(*args)
    bwd_args = (torch.randn_like(out), q.detach(), k.detach(), v.detach(), skipped_blocks(selection), rows_h, rows_z,
                64, 32, "softmax", 1e-5)
    torch.library.opcheck(linear_op.masked_linear_bwd.op, bwd_args)
    torch.library.opcheck(linear_op.masked_linear_bwd.op, bwd_args + (None, None, None, out.detach()))


@gpu
@pytest.mark.parametrize("n,d", [(37, 8), (65536, 64), (1000, 96)])
def test_gpu_center_tokens_bf16(n, d):
    """The kernel in bf16 equals PyTorch's fp32 difference rounded once (strided x); opcheck."""
    x = (3 + torch.randn(2, n, 4, d, device="cuda")).to(torch.bfloat16).transpose(1, 2)
    mean = x.float().mean(2, keepdim=True)
    assert torch.equal(center_tokens(x, mean), (x.float() - mean).to(torch.bfloat16))
    if n < 1000:
        torch.library.opcheck(center_tokens.op, (x, mean))


@gpu
@pytest.mark.parametrize("b,h,n,d,bq,rows", LERP_CASES + [(2, 8, 65536, 64, 128, 1)])
def test_gpu_lerp_mix_bwd_bf16(b, h, n, d, bq, rows):
    """The kernel in bf16 on the GPU: d o_s and d O_l rounded once (``_assert_rounded_once``), alpha's logits' gradient
    to fp32 rounding (the PyTorch path rounds each block's dot to bf16)."""
    args = _lerp_inputs(b, h, n, d, bq, rows, torch.bfloat16, "cuda")
    got = linear_op.lerp_mix_bwd(*args, bq)
    want = linear_op.lerp_mix_bwd(*[x.cpu() for x in args], bq)
    _assert_rounded_once(got[:2], args[0], args[3], bq)
    assert ts.rel_err(got[2].cpu(), want[2]) < 1e-2
    if n < 1000:
        torch.library.opcheck(linear_op.lerp_mix_bwd.op, (*args, bq))


@gpu
@pytest.mark.parametrize("kind", MIXES)
@pytest.mark.parametrize("compiled", [False, True])
def test_gpu_mixed_output_bf16(kind, compiled):
    """bf16, realistic size: the fused combine against the branch combined in PyTorch (same kernels for O_l)."""
    torch.manual_seed(0)
    q, k, v = _inputs(2, 8, 4, 16384, 16384, 64, torch.bfloat16, "cuda")
    o_s = torch.randn_like(q)
    selection = _selection(q, k, 64, 64, 0.05, 0.0)
    params = _mix_params(kind, 8, selection.num_q_blocks, 64, "cuda")
    fused = torch.compile(_fused, fullgraph=True) if compiled else _fused
    got = _mix_run(fused, q, k, v, selection, o_s, params, "softmax")
    want = _mix_run(_unfused, q, k, v, selection, o_s, params, "softmax")
    for name in want:
        assert ts.rel_err(got[name], want[name]) < 1e-2, name


@gpu
@pytest.mark.parametrize("kind", ["proj", "alpha_per_head"])
@pytest.mark.parametrize("d,block_q", [(64, 64), (64, 128), (128, 64), (128, 128)])
def test_gpu_linear_branch_in_fp8_sparse_epilogue_matches_two_ops(monkeypatch, kind, d, block_q):
    """With ``quant`` on sm_90 the one op runs the FP8 forward with the linear branch in its epilogue (D=128: the
    Gluon ``mix_ws_fp8``; D=64: SLA2's lerp in the Triton ``mix_fp8``, SLA's projection apart): output, LSE and
    gradients (the QAT ones, the linear kernels adding theirs) against the FP8 op followed by
    ``mixed_linear_output`` (bf16, ragged N, GQA)."""
    pytest.importorskip("torchao")
    from flexsparse.config import QuantConfig
    from flexsparse.triton.linear import mix_fp8, mix_ws_fp8
    ts.skip_unless_sm90()
    calls = []
    for module, name in ((mix_ws_fp8, "ws_sparse_linear_forward_fp8"), (mix_fp8, "sparse_linear_forward_fp8")):
        fused = getattr(module, name)
        spy = (lambda *a, fused=fused, name=name, **kw: calls.append(name) or fused(*a, **kw))
        monkeypatch.setattr(module, name, spy)
    q, k, v = _inputs(2, 4, 2, 4000, 4000, d, torch.bfloat16, "cuda")
    selection = _selection(q, k, block_q, 64, 0.05, 0.0)
    params = _mix_params(kind, 4, selection.num_q_blocks, d, "cuda")
    got = _both_run(partial(_one_op, quant=QuantConfig()), q, k, v, selection, params, "softmax")
    assert calls == (["ws_sparse_linear_forward_fp8"] if d == 128 else [] if kind == "proj" else
                     ["sparse_linear_forward_fp8"])
    want = _both_run(partial(_two_ops, quant=QuantConfig()), q, k, v, selection, params, "softmax")
    assert ts.rel_err(got["lse"], want["lse"]) < 1e-5
    for name in want:
        assert ts.rel_err(got[name], want[name]) < 1e-2, name


@gpu
def test_gpu_linear_branch_in_sparse_epilogue_for_strided_inputs(monkeypatch):
    """q, k, v in a transposed (B, N, H, D) layout, as models hand them over: the op makes them contiguous before
    it checks the Gluon kernels' conditions, so the fused epilogue runs and gives the contiguous inputs' output."""
    from flexsparse.triton.linear import mix_ws as sparse_linear_ws
    ts.skip_unless_sm90()
    calls = []
    fused = sparse_linear_ws.ws_sparse_linear_forward
    monkeypatch.setattr(sparse_linear_ws, "ws_sparse_linear_forward", lambda *a: calls.append(1) or fused(*a))
    q, k, v = _inputs(2, 4, 4, 4096, 4096, 64, torch.bfloat16, "cuda")
    strided = [x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v)]
    assert not strided[0].is_contiguous()
    selection = _selection(q, k, 64, 64, 0.05, 0.0)
    params = _mix_params("alpha_per_head", 4, selection.num_q_blocks, 64, "cuda")
    with torch.no_grad():
        want = _one_op(q, k, v, selection, "softmax", **params)
        got = _one_op(*strided, selection, "softmax", **params)
    assert len(calls) == 2 and all(torch.equal(a, b) for a, b in zip(got, want))


@gpu
@pytest.mark.parametrize("kind", MIXES)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("quant", [False, True])
def test_gpu_sparse_epilogue_rounds_fp32_parameters(kind, d, quant):
    """bf16: the one op (the Gluon epilogue on sm_90, with ``quant`` the FP8 one at D=128) mixes the fp32 bias
    rounded to bf16 in the kernel, and alpha of fp32 logits as of the same logits in bf16: bitwise the output and LSE
    of the parameters cast beforehand."""
    quant_config = None
    if quant:
        pytest.importorskip("torchao")
        from flexsparse.config import QuantConfig
        quant_config = QuantConfig()
    q, k, v = _inputs(1, 4, 2, 4000, 4000, d, torch.bfloat16, "cuda")
    selection = _selection(q, k, 64, 64, 0.05, 0.0)
    params = _mix_params(kind, 4, selection.num_q_blocks, d, "cuda")
    cast = {name: t if name == "weight" else t.bfloat16() for name, t in params.items()}
    with torch.no_grad():
        got = _one_op(q, k, v, selection, "softmax", quant=quant_config, **params)
        want = _one_op(q, k, v, selection, "softmax", quant=quant_config, **cast)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@gpu
@pytest.mark.parametrize("h,hk,n,d,bq,negligible,fmap,kind", [
    (4, 2, 4096, 64, 64, 0.0, "softmax", "proj"), (2, 2, 4000, 128, 64, 0.1, "elu", "alpha_shared"),
    (4, 1, 7777, 128, 128, 0.0, "relu", "alpha_per_head"), (8, 8, 16384, 64, 64, 0.0, "softmax", "alpha_per_head"),
    (2, 2, 32760, 128, 64, 0.0, "softmax", "proj")])
def test_gpu_linear_branch_in_sparse_epilogue(h, hk, n, d, bq, negligible, fmap, kind, monkeypatch):
    """sm_90, bf16: ``sparse_linear_output`` mixes the linear branch in the Gluon sparse forward's epilogue
    (``linear.mix_ws``; GQA, ragged N, 128-row query blocks, D 64 / 128, both mixes, three feature maps) and
    equals the sparse op followed by the output kernel's mix: output, LSE (bitwise: the same loop), the gradients
    of q, k, v and the mixing parameters; without gradients it stores neither O_s nor O_l and gives the same
    output; the fused kernel ran both times; opcheck of its op."""
    from flexsparse.triton.linear import mix_ws as sparse_linear_ws
    ts.skip_unless_sm90()
    stores = []
    fused = sparse_linear_ws.ws_sparse_linear_forward
    monkeypatch.setattr(sparse_linear_ws, "ws_sparse_linear_forward", lambda *a: stores.append(a[-1]) or fused(*a))
    q, k, v = _inputs(1, h, hk, n, n, d, torch.bfloat16, "cuda")
    selection = _selection(q, k, bq, 64, 0.05, negligible)
    params = _mix_params(kind, h, selection.num_q_blocks, d, "cuda")
    got = _both_run(_one_op, q, k, v, selection, params, fmap)
    want = _both_run(_two_ops, q, k, v, selection, params, fmap)
    assert stores == [True] and torch.equal(got["lse"], want["lse"])
    for name in want:
        assert want[name].abs().max() > 0, name
        assert ts.rel_err(got[name], want[name]) < 5e-3, name
    with torch.no_grad():
        out, lse = _one_op(q, k, v, selection, fmap, **params)
    assert stores == [True, False] and torch.equal(out, got["out"]) and torch.equal(lse, got["lse"])
    if n < 5000:
        skipped = skipped_blocks(selection)
        tq = selection.num_q_blocks
        states = (torch.randn(1, h, tq, d, d, device="cuda").bfloat16(), torch.rand(1, h, tq, d, device="cuda"))
        mix = ((params["weight"].T.bfloat16().contiguous(), params["bias"].bfloat16(), None) if kind == "proj"
               else (None, None, params["alpha_logit"].bfloat16()))
        assert skipped.shape[-1] > 0
        torch.library.opcheck(sparse_linear_ws.sparse_linear_ws, (q, k, v, selection.indices.contiguous(), *states,
                                                                  *mix, bq, 64, 0.3, fmap, 1e-5, True))
