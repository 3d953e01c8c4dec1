"""Single-level block top-K in Triton (``flexsparse.triton.selection.block_topk``, op ``flexsparse::block_topk``).

CPU (CI): the kernels run through the Triton interpreter and must equal ``selection.naive.sorted_block_topk``
exactly:
grid-valued inputs (exact scores with many ties), random inputs, top and bottom sets, GQA, K = 1, K = Tk, odd
sizes, fp16 inputs, row chunks of the score scratch, and the streaming path. The selection kernel alone is
compared with a stable sort on the same fp32 scores for every K (random, tied and special values: +-0, +-inf,
NaN, subnormals). They run in a child pytest started with ``TRITON_INTERPRET=1`` (``test_interpreter_suite``,
see ``triton_support``).
GPU (``pytest -m gpu``): realistic sizes (Tk up to 16384 in registers, longer rows streaming), the selection
kernel bit for bit against ``torch.sort`` on random scores, the triton backend's ``block_topk``,
``torch.compile(fullgraph=True)``, opcheck.
"""
from __future__ import annotations

import pytest
import torch

import triton_support as ts

pytest.importorskip("triton")

from flexsparse.backends import BACKENDS  # noqa: E402
from flexsparse.triton.selection import op as selection_op  # noqa: E402
from flexsparse.triton.selection.naive import block_topk, sorted_block_topk  # noqa: E402

cpu_only, cpu_parent, gpu = ts.cpu_only, ts.cpu_parent, ts.gpu
TRITON = BACKENDS["triton"]   # its block_topk: the kernels (op ``flexsparse::block_topk``) with the counts checked


test_interpreter_suite, test_interpreter_suite_exhaustive = ts.interpreter_suites(__file__)
DEFAULT_TIER_CASES = 1   # interpreter tests: the first case of each in the default tier (conftest)


# (B, H, Hk, Tq, Tk, D, topk, bottomk, row_limit, scratch): ragged sizes, GQA, K = 1, K = Tk, bottom sets, row
# chunks of the score scratch, the streaming path.
CASES = [
    (1, 2, 1, 5, 7, 16, 3, 2, None, None),
    (2, 2, 2, 19, 40, 8, 5, 0, None, None),
    (1, 4, 2, 9, 13, 4, 13, 0, None, None),           # K = Tk
    (1, 2, 2, 6, 33, 8, 1, 0, None, None),            # K = 1, odd Tk
    (1, 2, 2, 6, 33, 8, 1, 32, None, None),           # K = 1, top + bottom = Tk
    (2, 4, 1, 11, 70, 20, 9, 6, None, None),          # GQA 4 -> 1, D not a power of two
    (1, 2, 1, 23, 37, 8, 4, 3, None, 2 * 37 * 5),     # 5 rows per scratch chunk: 5 chunks, the last ragged
    (1, 1, 1, 3, 1, 8, 1, 0, None, None),             # one key
    (1, 2, 1, 12, 45, 8, 7, 9, 16, None),             # streaming: 3 chunks of 16 keys
    (1, 1, 1, 17, 13, 4, 6, 7, 8, None),              # streaming, top + bottom = Tk
]


def _pooled(b, h, hk, tq, tk, d):
    return ts.grid_values(b, h, tq, d), ts.grid_values(b, hk, tk, d)


def _check(qp, kp, topk, bottomk, **kwargs):
    from flexsparse.triton.selection.block_topk import block_topk as topk_kernel
    top, bottom = topk_kernel(qp, kp, topk, bottomk, **kwargs)
    want_top, want_bottom = sorted_block_topk(qp, kp, topk, bottomk=bottomk)
    assert torch.equal(top, want_top)
    if bottomk:
        assert torch.equal(bottom, want_bottom)
    else:
        assert bottom.shape == (*qp.shape[:3], 0)


@cpu_only
@pytest.mark.parametrize("b,h,hk,tq,tk,d,topk,bottomk,row_limit,scratch", CASES)
def test_kernel_equals_sorted_topk(b, h, hk, tq, tk, d, topk, bottomk, row_limit, scratch, monkeypatch):
    from flexsparse.triton.selection.block_topk import ROW_LIMIT, SCRATCH
    if scratch:   # row chunks of the scratch: the two-kernel path, which these short rows skip by default
        _two_kernel_path(monkeypatch)
    qp, kp = _pooled(b, h, hk, tq, tk, d)
    _check(qp, kp, topk, bottomk, row_limit=row_limit or ROW_LIMIT, scratch=scratch or SCRATCH)


def _two_kernel_path(monkeypatch):
    """Rows of every length through the score scratch and the selection kernel (no fused score-and-select)."""
    monkeypatch.setenv("FLEXSPARSE_TRITON_TILES", '{"block_topk": {"FUSED_TILE": 0}}')


@cpu_only
def test_both_paths_equal_sorted_topk(monkeypatch):
    """Short rows score and select in one kernel, or (FUSED_TILE = 0) through the scratch and the selection kernel:
    the same sets as the sort, on ragged GQA inputs with a bottom set and on random inputs."""
    gen = torch.Generator().manual_seed(2)
    random = torch.randn(1, 2, 40, 8, generator=gen), torch.randn(1, 2, 19, 8, generator=gen)
    for fused in (True, False):
        if not fused:
            _two_kernel_path(monkeypatch)
        _check(*_pooled(2, 4, 2, 21, 37, 24), 6, 5)
        _check(*random, 4, 3)


@cpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_random_inputs_equal_sorted_topk(dtype):
    """Continuous random scores (no ties): the same sets as the sort of PyTorch's fp32 scores."""
    gen = torch.Generator().manual_seed(1)
    qp = torch.randn(2, 2, 21, 16, generator=gen).to(dtype)
    kp = torch.randn(2, 1, 77, 16, generator=gen).to(dtype)
    _check(qp, kp, 8, 5)
    _check(qp, kp, 1, 76)


def _sorted_ids(scores, topk, bottomk):
    """Top / bottom ids of a stable descending sort, ascending int32."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    top = order[..., :topk].sort(-1).values.to(torch.int32)
    return top, order[..., scores.shape[-1] - bottomk:].sort(-1).values.to(torch.int32)


def _select(scores, topk, bottomk, row0=0, tq=None, warps=None):
    from flexsparse.triton.selection.block_topk import select_scores
    bh, rows, tk = scores.shape
    tq = tq or rows
    top = torch.full((1, bh, tq, topk), -1, dtype=torch.int32, device=scores.device)
    bottom = torch.full((1, bh, tq, bottomk), -1, dtype=torch.int32, device=scores.device)
    select_scores(scores.contiguous(), top, bottom, row0, warps)
    return top[0], bottom[0]


def _special_scores(rows, tk, gen):
    """Rows of random fp32 scores, some rows drawn from a few special values (+-0, +-inf, NaN of both signs,
    subnormals, huge, repeats) so that the threshold falls on ties, on signed zeros, infinities and NaN."""
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), -float("nan"), 1e-40, -1e-40,
                            3e38, -3e38, 1.0, -1.0, 2.5])
    s = torch.randn(rows, tk, generator=gen)
    pick = special[torch.randint(0, len(special), (rows, tk), generator=gen)]
    return torch.where(torch.arange(rows)[:, None] % 2 == 1, pick, s)


@cpu_only
@pytest.mark.parametrize("tk", [1, 2, 5, 16, 31, 33, 64])
def test_selection_equals_stable_sort_for_every_k(tk):
    """The selection kernel on given fp32 scores, every (topk, bottomk) split of the row, against a stable
    sort: bit-identical sets (random rows and rows of special values)."""
    gen = torch.Generator().manual_seed(tk)
    scores = _special_scores(4, tk, gen).view(2, 2, tk)
    for topk in range(1, tk + 1):
        for bottomk in sorted({0, 1, tk - topk}):
            if topk + bottomk > tk:
                continue
            top, bottom = _select(scores, topk, bottomk)
            want_top, want_bottom = _sorted_ids(scores, topk, bottomk)
            assert torch.equal(top, want_top), (topk, bottomk)
            assert torch.equal(bottom, want_bottom), (topk, bottomk)


@cpu_only
def test_selection_writes_its_row_chunk_only():
    gen = torch.Generator().manual_seed(0)
    scores = _special_scores(6, 40, gen).view(2, 3, 40)
    top, bottom = _select(scores, 6, 3, row0=2, tq=7, warps=2)
    want_top, want_bottom = _sorted_ids(scores, 6, 3)
    assert torch.equal(top[:, 2:5], want_top) and torch.equal(bottom[:, 2:5], want_bottom)
    assert (top[:, :2] == -1).all() and (top[:, 5:] == -1).all() and (bottom[:, 5:] == -1).all()


@cpu_only
def test_ties_go_to_the_smallest_ids_and_bottom_to_the_largest():
    """Every score equal: top = the first K ids, bottom = the last Kb ids."""
    qp, kp = torch.ones(1, 1, 3, 4), torch.ones(1, 1, 10, 4)
    top, bottom = selection_op.block_topk(qp, kp, 3, 4)
    assert torch.equal(top, torch.arange(3, dtype=torch.int32).expand(1, 1, 3, 3))
    assert torch.equal(bottom, torch.arange(6, 10, dtype=torch.int32).expand(1, 1, 3, 4))


@cpu_parent
def test_cpu_keeps_the_sorted_path_and_checks_counts():
    qp, kp = _pooled(1, 2, 1, 6, 9, 8)
    with ts.interpreter_env(False):
        top, bottom = selection_op.block_topk(qp, kp, 2, 0)
    assert torch.equal(top, block_topk(qp, kp, 2)[0]) and bottom.shape == (1, 2, 6, 0)
    for select in (block_topk, TRITON.block_topk):     # the torch and the triton backends' entry points
        with pytest.raises(ValueError, match="bottomk"):
            select(qp, kp, 5, bottomk=5)
        with pytest.raises(ValueError, match="topk"):
            select(qp, kp, 0)


@cpu_parent
def test_opcheck_cpu_fallback():
    qp, kp = _pooled(1, 2, 1, 6, 9, 8)
    with ts.interpreter_env(False):
        torch.library.opcheck(selection_op.block_topk.op, (qp, kp, 3, 2))


# ------------------------------------------------------------------------- the routers' pooled inputs

# (B, H, Hk, Nq, Nk, D, block_q, block_k, dtype): ragged tails, GQA, Nq != Nk, block_q != block_k, D not a power of
# two, fewer tokens than a block, many blocks per program.
POOL_CASES = [
    (2, 4, 2, 100, 90, 16, 16, 32, torch.float32),
    (1, 2, 1, 130, 70, 20, 64, 16, torch.float16),
    (1, 1, 1, 5, 3, 8, 16, 16, torch.float32),
    (1, 2, 2, 2048, 1000, 32, 16, 64, torch.float32),
]


def _pair_inputs(b, h, hk, nq, nk, d, dtype, device="cpu"):
    """q and k with fresh random values (``make_qkv``); q a view into wider rows (strided rows)."""
    q, k, _ = ts.make_qkv(b, h, hk, nq, nk, d + 3, dtype, device)
    return q[..., 3:], k[..., 3:].contiguous()


def _assert_grads_close(got, want, dtype: torch.dtype, rtol, atol):
    """The kernels' input gradients ``got`` (``dtype``) against the fp32 reference's ``want``, None where it is."""
    for a, b in zip(got, want):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.dtype == dtype
            torch.testing.assert_close(a, b.to(dtype), rtol=rtol, atol=atol)


def _check_pair(q, k, block_q, block_k, rtol=None, atol=None, used=(0, 1, 2)):
    """Outputs against the PyTorch pooling, and the gradients of q and k through the outputs ``used`` (fresh random
    upstream gradients) against the PyTorch pooling's at fp32 copies of q and k (one rounding to q's dtype)."""
    from flexsparse.triton.pooling import naive
    from flexsparse.triton.pooling.op import block_means_pair
    q, k = (x.detach().requires_grad_() for x in (q, k))
    wide = [x.detach().float().requires_grad_() for x in (q, k)]
    got = block_means_pair(q, k, block_q, block_k)
    want = naive.mean_pool(wide[0], block_q), naive.mean_pool(wide[1], block_k), naive.block_sums(wide[1], block_k)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol)
    grads = [torch.randn_like(want[i]) for i in used]
    got_grads = torch.autograd.grad([got[i] for i in used], (q, k), grads, allow_unused=True)
    want_grads = torch.autograd.grad([want[i] for i in used], wide, grads, allow_unused=True)
    _assert_grads_close(got_grads, want_grads, q.dtype, rtol, atol)


@cpu_only
@pytest.mark.parametrize("b,h,hk,nq,nk,d,block_q,block_k,dtype", POOL_CASES)
def test_pair_means_equal_pooling(b, h, hk, nq, nk, d, block_q, block_k, dtype):
    """``flexsparse::block_means_pair`` (one kernel for q and k; q a strided view) against ``naive.mean_pool`` and
    ``naive.block_sums`` (fp32 sums in another order), with gradients through all outputs, k's means only (VSA's
    coarse branch reads q's and k's) and q's only."""
    q, k = _pair_inputs(b, h, hk, nq, nk, d, dtype)
    for used in ((0, 1, 2), (0, 1), (1,), (0,)):
        _check_pair(q, k, block_q, block_k, used=used)


@cpu_only
def test_pair_means_above_the_size_limit_take_the_pytorch_path(monkeypatch):
    from flexsparse.triton.pooling import naive, pair
    from flexsparse.triton.pooling.op import block_means_pair
    q, k = _pair_inputs(1, 2, 1, 100, 90, 16, torch.float32)
    monkeypatch.setattr(pair, "PAIR_ELEMENTS", q.numel() + k.numel() - 1)
    launches = []
    monkeypatch.setattr(pair, "pair_means", lambda *args: launches.append(args))
    q_means, _, k_sums = block_means_pair(q, k, 16, 32)
    assert not launches
    assert torch.equal(q_means, naive.mean_pool(q, 16)) and torch.equal(k_sums, naive.block_sums(k, 32))


@cpu_parent
def test_pair_means_gradient_of_one_input():
    """Where only q (or only k) records a gradient, only it gets one."""
    from flexsparse.triton.pooling import naive
    from flexsparse.triton.pooling.op import block_means_pair
    q, k = _pair_inputs(1, 2, 1, 100, 90, 16, torch.float32)
    for grad_q in (True, False):
        q_leaf, k_leaf = q.detach().requires_grad_(grad_q), k.detach().requires_grad_(not grad_q)
        q_means, k_means, k_sums = block_means_pair(q_leaf, k_leaf, 16, 32)
        (q_means.sum() + k_means.sum() + k_sums.sum()).backward()
        leaf, other = (q_leaf, k_leaf) if grad_q else (k_leaf, q_leaf)
        assert other.grad is None
        want_q = naive.block_means_backward(torch.ones_like(q_means), 100, 16, q.dtype)
        want_k = (naive.block_means_backward(torch.ones_like(k_means), 90, 32, k.dtype)
                  + naive.block_sums_backward(torch.ones_like(k_sums), 90, 32, k.dtype))
        torch.testing.assert_close(leaf.grad, want_q if grad_q else want_k)


@cpu_parent
def test_pair_means_cpu_fallback_and_opcheck():
    from flexsparse.triton.pooling.op import block_means_pair
    q, k = _pair_inputs(2, 4, 2, 100, 90, 16, torch.float32)
    with ts.interpreter_env(False):
        for used in ((0, 1, 2), (1, 2), (2,)):
            _check_pair(q, k, 16, 32, rtol=0, atol=0, used=used)
        torch.library.opcheck(block_means_pair.op, (q, k, 16, 32))
        torch.library.opcheck(block_means_pair.op, (q.requires_grad_(), k.requires_grad_(), 16, 32))


# (B, H, Hk, Tq, Tk, D, projections' dtype): ragged tiles, GQA, D not a power of two, a bf16-cast module, one row
PROJECTION_CASES = [(1, 2, 1, 37, 45, 64, torch.float32), (2, 4, 2, 9, 70, 24, torch.float32),
                    (1, 1, 1, 1, 1, 16, torch.bfloat16)]


def _check_router_projections(b, h, hk, tq, tk, d, proj_dtype, device="cpu"):
    """``flexsparse::router_projections`` (one kernel for both) against fp64 matmuls of the same values, within fp32
    rounding of D-term sums."""
    q_bar, k_bar = torch.randn(b, h, tq, d, device=device), torch.randn(b, hk, tk, d, device=device)
    proj_q, proj_k = (torch.randn(d, d, device=device).div(d**0.5).to(proj_dtype) for _ in range(2))
    got = selection_op.router_projections(q_bar, k_bar, proj_q, proj_k)
    for x, p, out in zip((q_bar, k_bar), (proj_q, proj_k), got):
        assert out.dtype == torch.float32 and out.shape == x.shape
        assert ts.rel_err(out, x.double() @ p.double().T) < 1e-6


@cpu_only
@pytest.mark.parametrize("b,h,hk,tq,tk,d,proj_dtype", PROJECTION_CASES)
def test_router_projections_kernel_matches_matmuls(b, h, hk, tq, tk, d, proj_dtype):
    _check_router_projections(b, h, hk, tq, tk, d, proj_dtype)


@cpu_parent
def test_router_projections_cpu_fallback_and_opcheck():
    b, h, hk, tq, tk, d, proj_dtype = PROJECTION_CASES[1]
    with ts.interpreter_env(False):
        _check_router_projections(b, h, hk, tq, tk, d, proj_dtype)
        torch.library.opcheck(selection_op.router_projections.op,
                              (torch.randn(1, 2, 5, 8), torch.randn(1, 1, 7, 8), torch.eye(8), torch.eye(8)))


# ----------------------------------------------------------------------------------------------- GPU


@gpu
@pytest.mark.parametrize("b,h,hk,tq,tk,d,proj_dtype", PROJECTION_CASES + [(2, 8, 8, 64, 64, 128, torch.float32),
                                                                         (2, 16, 4, 512, 256, 64, torch.float32)])
def test_gpu_router_projections_kernel_matches_matmuls(b, h, hk, tq, tk, d, proj_dtype):
    _check_router_projections(b, h, hk, tq, tk, d, proj_dtype, "cuda")


@gpu
@pytest.mark.parametrize("b,h,hk,nq,nk,d,block_q,block_k,dtype", [
    (2, 8, 8, 4096, 4096, 64, 64, 64, torch.bfloat16), (1, 8, 2, 16381, 16381, 128, 128, 64, torch.bfloat16),
    (2, 4, 4, 1000, 3001, 64, 64, 16, torch.float16), (1, 2, 1, 777, 777, 32, 64, 64, torch.float32)])
def test_gpu_pair_means_equal_pooling(b, h, hk, nq, nk, d, block_q, block_k, dtype):
    _check_pair(*_pair_inputs(b, h, hk, nq, nk, d, dtype, "cuda"), block_q, block_k)




@gpu
@pytest.mark.parametrize("h,hk,tq,tk,d,topk,bottomk", [
    (8, 8, 1024, 1024, 64, 51, 102), (8, 2, 1024, 1024, 128, 32, 0), (4, 4, 512, 512, 64, 32, 51),
    (4, 2, 300, 777, 64, 38, 77), (2, 1, 64, 5000, 64, 8, 16), (2, 2, 40, 16384, 64, 819, 1),
    (2, 2, 256, 257, 64, 1, 256), (2, 1, 33, 17000, 64, 8, 16),    # this one streams (Tk > 16384)
    (8, 8, 64, 64, 64, 3, 0), (8, 2, 256, 256, 128, 12, 25), (4, 4, 300, 200, 64, 10, 20), (2, 1, 5, 1, 64, 1, 0)])
def test_gpu_equals_sorted_topk(h, hk, tq, tk, d, topk, bottomk):
    qp, kp = (x.cuda() for x in _pooled(2, h, hk, tq, tk, d))
    top, bottom = TRITON.block_topk(qp, kp, topk, bottomk)
    want_top, want_bottom = sorted_block_topk(qp, kp, topk, bottomk=bottomk)
    assert torch.equal(top, want_top)
    assert torch.equal(bottom, want_bottom) if bottomk else bottom is None
    # random scores: summation orders differ from cuBLAS, so only near-ties may flip
    qp, kp = torch.randn_like(qp), torch.randn_like(kp)
    top, _ = TRITON.block_topk(qp, kp, topk, bottomk)
    assert (top == sorted_block_topk(qp, kp, topk)[0]).all(-1).float().mean().item() > 0.99


@gpu
@pytest.mark.parametrize("tk", [64, 256, 1000, 1024, 2048, 4096, 8192, 16384])
def test_gpu_selection_bit_identical_to_sort(tk):
    """The selection kernel on given fp32 scores against ``torch.sort(stable=True)``: identical sets, K = 5%
    (+ a bottom set), K = 1 and K = Tk, random and special-valued rows, half / default / twice the warps per row."""
    from flexsparse.triton.selection.block_topk import topk_tiles
    gen = torch.Generator().manual_seed(tk)
    rows = max(8, min(1024, (1 << 22) // tk))
    scores = _special_scores(2 * rows, tk, gen).view(2, rows, tk)
    default = topk_tiles(tk)["SELECT_WARPS"]
    warp_counts = sorted({w for w in (default // 2, default, 2 * default) if 1 <= w <= 16 and tk <= 64 * 32 * w})
    for topk, bottomk in [(max(1, tk // 20), tk // 10), (1, 0), (tk, 0), (1, tk - 1)]:
        want = _sorted_ids(scores, topk, bottomk)    # the spec: the CPU's comparison sort (IEEE compares)
        for warps in warp_counts:
            got = _select(scores.cuda(), topk, bottomk, warps=warps)
            for name, g, w in zip(("top", "bottom"), got, want):
                g = g.cpu()
                assert torch.equal(g, w), f"K={topk} Kb={bottomk} warps={warps} {name}: {_difference(g, w, scores)}"


def _difference(got, want, scores):
    """The first row where two id sets differ: the ids and scores taken and missed."""
    row = tuple((got != want).any(-1).nonzero()[0].tolist())
    taken, missed = set(got[row].tolist()), set(want[row].tolist())
    extra, lost = sorted(taken - missed)[:4], sorted(missed - taken)[:4]
    return f"row {row} took {extra} = {scores[row][extra].tolist()} instead of {lost} = {scores[row][lost].tolist()}"


@gpu
def test_gpu_chunks_bf16_and_determinism():
    from flexsparse.triton.selection.block_topk import block_topk as topk_kernel
    qp, kp = (x.cuda() for x in _pooled(2, 4, 2, 300, 1500, 64))
    want = sorted_block_topk(qp, kp, 75, bottomk=30)
    for scratch in (8 * 1500 * 7, 8 * 1500 * 300):     # 43 row chunks, one chunk
        top, bottom = topk_kernel(qp, kp, 75, 30, scratch=scratch)
        assert torch.equal(top, want[0]) and torch.equal(bottom, want[1])
    top, bottom = TRITON.block_topk(qp.bfloat16(), kp.bfloat16(), 75, 30)   # grid values are exact in bf16
    assert torch.equal(top, want[0]) and torch.equal(bottom, want[1])
    qp, kp = torch.randn_like(qp), torch.randn_like(kp)
    first = TRITON.block_topk(qp, kp, 75, 30)
    assert all(torch.equal(a, b) for a, b in zip(first, TRITON.block_topk(qp, kp, 75, 30)))


@gpu
def test_gpu_compiled_fullgraph_and_opcheck():
    qp, kp = (x.cuda() for x in _pooled(2, 4, 2, 256, 256, 64))
    fn = torch.compile(lambda q, k: TRITON.block_topk(q, k, 13, 26), fullgraph=True)
    top, bottom = fn(qp, kp)
    want_top, want_bottom = sorted_block_topk(qp, kp, 13, bottomk=26)
    assert torch.equal(top, want_top) and torch.equal(bottom, want_bottom)
    torch.library.opcheck(selection_op.block_topk.op, (qp, kp, 13, 26))
    torch.library.opcheck(selection_op.block_topk.op, (qp[:, :, :100], kp[:, :, :17000], 8, 0))


def _coarse_inputs(b, h, hk, nq, nk, d, dtype, device="cpu"):
    """``_pair_inputs``' q and k and a fresh v, a view into wider rows."""
    q, k = _pair_inputs(b, h, hk, nq, nk, d, dtype, device)
    return q, k, ts.make_qkv(b, h, hk, nq, nk, d + 2, dtype, device)[2][..., 2:]


def _check_coarse(q, k, v, block_q, block_k, rtol=None, atol=None, used=(0, 1, 2, 3, 4)):
    """``flexsparse::coarse_means`` against ``naive.coarse_pooling`` at fp32 copies of q, k, v: the fp32 means, the
    rounded means (the reference's rounded once to the inputs' dtype) and the gradients of q, k, v through the
    outputs ``used`` (fresh random upstream gradients)."""
    from flexsparse.triton.pooling import naive
    from flexsparse.triton.pooling.op import coarse_means
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    wide = [x.detach().float().requires_grad_() for x in (q, k, v)]
    got = coarse_means(*leaves, block_q, block_k)
    want = naive.coarse_pooling(*wide, block_q, block_k)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == (torch.float32 if i < 2 else q.dtype) and a.shape == b.shape
        torch.testing.assert_close(a, b if i < 2 else b.to(q.dtype), rtol=rtol, atol=atol)
    assert len({x.data_ptr() for x in got}) == 5                       # five tensors of their own
    grads = [torch.randn_like(want[i]).to(got[i].dtype) for i in used]
    got_grads = torch.autograd.grad([got[i] for i in used], leaves, grads, allow_unused=True)
    want_grads = torch.autograd.grad([want[i] for i in used], wide, [g.float() for g in grads], allow_unused=True)
    _assert_grads_close(got_grads, want_grads, q.dtype, rtol, atol)


@cpu_only
@pytest.mark.parametrize("b,h,hk,nq,nk,d,block_q,block_k,dtype", POOL_CASES)
def test_coarse_means_equal_pooling(b, h, hk, nq, nk, d, block_q, block_k, dtype):
    """``flexsparse::coarse_means`` (one kernel for q, k and v; q and v strided views) against
    ``naive.coarse_pooling``, with gradients through all outputs, the coarse tiles only (VSA's branch), v's only and
    q's means only."""
    q, k, v = _coarse_inputs(b, h, hk, nq, nk, d, dtype)
    for used in ((0, 1, 2, 3, 4), (2, 3, 4), (4,), (0,)):
        _check_coarse(q, k, v, block_q, block_k, used=used)


@gpu
@pytest.mark.parametrize("b,h,hk,nq,nk,d,block_q,block_k,dtype", [
    (2, 8, 8, 4096, 4096, 64, 64, 64, torch.bfloat16), (1, 8, 2, 16381, 16381, 128, 128, 64, torch.bfloat16),
    (1, 2, 1, 777, 777, 32, 64, 64, torch.float32)])
def test_gpu_coarse_means_equal_pooling(b, h, hk, nq, nk, d, block_q, block_k, dtype):
    for used in ((0, 1, 2, 3, 4), (2, 3, 4)):
        _check_coarse(*_coarse_inputs(b, h, hk, nq, nk, d, dtype, "cuda"), block_q, block_k, used=used)


@cpu_parent
def test_coarse_means_cpu_fallback_and_opcheck():
    from flexsparse.triton.pooling.op import coarse_means
    q, k = _pair_inputs(2, 4, 2, 100, 90, 16, torch.float32)
    v = torch.randn_like(k)
    with ts.interpreter_env(False):
        for used in ((0, 1, 2, 3, 4), (2, 3, 4), (1, 3)):
            _check_coarse(q, k, v, 16, 32, rtol=0, atol=0, used=used)
        torch.library.opcheck(coarse_means.op, (q, k, v, 16, 32))
        torch.library.opcheck(coarse_means.op, (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), 16, 32))
