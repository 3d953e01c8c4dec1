"""Single-level block top-K in Triton (``flexsparse.triton.block_topk``, op ``flexsparse::block_topk``).

CPU (CI): the kernels run through the Triton interpreter on grid-valued inputs (exact scores with many
ties) and must equal ``masks.sorted_block_topk`` exactly: top and bottom sets, GQA, K = Tk, ragged sizes,
both the in-register path and the streaming path. They run in a child pytest started with
``TRITON_INTERPRET=1`` (``test_interpreter_suite``, see ``triton_support``).
GPU (``pytest -m gpu``): realistic sizes, ``masks.block_topk`` dispatch, ``torch.compile(fullgraph=True)``, opcheck.
"""
from __future__ import annotations

import pytest
import torch

import triton_support as ts

pytest.importorskip("triton")

from flexsparse.masks import block_topk, sorted_block_topk  # noqa: E402
from flexsparse.triton import sla_ops  # noqa: E402

cpu_only, cpu_parent, gpu = ts.cpu_only, ts.cpu_parent, ts.gpu


@cpu_parent
def test_interpreter_suite():
    ts.check_interpreter_suite(__file__)


# (B, H, Hk, Tq, Tk, D, topk, bottomk, row_limit): ragged sizes, GQA, K = Tk, bottom sets, the streaming path.
CASES = [
    (1, 2, 1, 5, 7, 16, 3, 2, None),
    (2, 2, 2, 19, 40, 8, 5, 0, None),
    (1, 4, 2, 9, 13, 4, 13, 0, None),            # K = Tk
    (1, 2, 1, 12, 45, 8, 7, 9, 16),              # streaming: 3 chunks of 16 keys
    (1, 1, 1, 17, 13, 4, 6, 7, 8),               # streaming, top + bottom = Tk
]


def _pooled(b, h, hk, tq, tk, d):
    return ts.grid_values(b, h, tq, d), ts.grid_values(b, hk, tk, d)


@cpu_only
@pytest.mark.parametrize("b,h,hk,tq,tk,d,topk,bottomk,row_limit", CASES)
def test_kernel_equals_sorted_topk(b, h, hk, tq, tk, d, topk, bottomk, row_limit):
    from flexsparse.triton.block_topk import ROW_LIMIT, block_topk as topk_kernel
    qp, kp = _pooled(b, h, hk, tq, tk, d)
    top, bottom = topk_kernel(qp, kp, topk, bottomk, row_limit or ROW_LIMIT)
    want_top, want_bottom = sorted_block_topk(qp, kp, topk, bottomk=bottomk)
    assert torch.equal(top, want_top)
    if bottomk:
        assert torch.equal(bottom, want_bottom)
    else:
        assert bottom.shape == (b, h, tq, 0)


@cpu_only
def test_ties_go_to_the_smallest_ids_and_bottom_to_the_largest():
    """Every score equal: top = the first K ids, bottom = the last Kb ids."""
    qp, kp = torch.ones(1, 1, 3, 4), torch.ones(1, 1, 10, 4)
    top, bottom = sla_ops.block_topk(qp, kp, 3, 4)
    assert torch.equal(top, torch.arange(3, dtype=torch.int32).expand(1, 1, 3, 3))
    assert torch.equal(bottom, torch.arange(6, 10, dtype=torch.int32).expand(1, 1, 3, 4))


@cpu_parent
def test_cpu_keeps_the_sorted_path_and_checks_counts():
    qp, kp = _pooled(1, 2, 1, 6, 9, 8)
    with ts.interpreter_env(False):
        top, bottom = sla_ops.block_topk(qp, kp, 2, 0)
    assert torch.equal(top, block_topk(qp, kp, 2)[0]) and bottom.shape == (1, 2, 6, 0)
    with pytest.raises(ValueError, match="bottomk"):
        block_topk(qp, kp, 5, bottomk=5)
    with pytest.raises(ValueError, match="topk"):
        block_topk(qp, kp, 0)


@cpu_parent
def test_opcheck_cpu_fallback():
    qp, kp = _pooled(1, 2, 1, 6, 9, 8)
    with ts.interpreter_env(False):
        torch.library.opcheck(sla_ops.block_topk, (qp, kp, 3, 2))


# ----------------------------------------------------------------------------------------------- GPU


@gpu
@pytest.mark.parametrize("h,hk,tq,tk,d,topk,bottomk", [
    (8, 8, 1024, 1024, 64, 51, 102), (8, 2, 1024, 1024, 128, 32, 0), (4, 4, 512, 512, 64, 32, 51),
    (4, 2, 300, 777, 64, 38, 77), (2, 1, 64, 5000, 64, 8, 16)])    # the last one streams (Tk > 4096)
def test_gpu_equals_sorted_topk(h, hk, tq, tk, d, topk, bottomk):
    qp, kp = (x.cuda() for x in _pooled(2, h, hk, tq, tk, d))
    top, bottom = block_topk(qp, kp, topk, bottomk=bottomk)
    want_top, want_bottom = sorted_block_topk(qp, kp, topk, bottomk=bottomk)
    assert torch.equal(top, want_top)
    assert torch.equal(bottom, want_bottom) if bottomk else bottom is None
    # random scores: summation orders differ from cuBLAS, so only near-ties may flip
    qp, kp = torch.randn_like(qp), torch.randn_like(kp)
    top, _ = block_topk(qp, kp, topk, bottomk=bottomk)
    assert (top == sorted_block_topk(qp, kp, topk)[0]).all(-1).float().mean().item() > 0.99


@gpu
def test_gpu_compiled_fullgraph_and_opcheck():
    qp, kp = (x.cuda() for x in _pooled(2, 4, 2, 256, 256, 64))
    fn = torch.compile(lambda q, k: block_topk(q, k, 13, bottomk=26), fullgraph=True)
    top, bottom = fn(qp, kp)
    want_top, want_bottom = sorted_block_topk(qp, kp, 13, bottomk=26)
    assert torch.equal(top, want_top) and torch.equal(bottom, want_bottom)
    torch.library.opcheck(sla_ops.block_topk, (qp, kp, 13, 26))
    torch.library.opcheck(sla_ops.block_topk, (qp[:, :, :100], kp[:, :, :7000], 8, 0))
