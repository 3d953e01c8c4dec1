"""The ``triton`` backend of LLSA.

CPU (CI): the kernels run through the Triton interpreter in fp32 on tiny shapes (several L, odd N,
GQA) against the PyTorch pooling and selection (``flexsparse.triton.pooling.naive``, ``selection.naive``), the CSC
of ``flexsparse.masks``, the ``torch`` backend (outputs, LSE and
all gradients, pooled levels as separate leaves) and the dense reference. They run in a child pytest
started with ``TRITON_INTERPRET=1`` (``test_interpreter_suite``, see ``triton_support``).
GPU (``pytest -m gpu``): bf16 at realistic sizes, eager and ``torch.compile(fullgraph=True)``, opcheck.
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys

import pytest
import torch

import triton_support as ts

pytest.importorskip("triton")

import flexsparse  # noqa: E402
from flexsparse.backends import BACKENDS, runs_on  # noqa: E402
from flexsparse.masks import csr_to_csc, num_blocks  # noqa: E402
from flexsparse.masks.levels import CSC_OFF, SEL_OFF, level_table, pack  # noqa: E402
from flexsparse.triton._runtime.sizes import pow2  # noqa: E402
from flexsparse.triton.llsa import fwd as llsa_fwd  # noqa: E402
from flexsparse.triton.llsa.op import llsa_attn  # noqa: E402
from flexsparse.triton.pooling.naive import pool_pyramid  # noqa: E402
from flexsparse.triton.pooling.op import llsa_pool, llsa_pool_qkv  # noqa: E402
from flexsparse.triton.selection.naive import children_topk, hierarchical_topk  # noqa: E402
from flexsparse.triton.selection.op import llsa_select  # noqa: E402
from helpers import selections_by_search  # noqa: E402

cpu_only, cpu_parent, gpu = ts.cpu_only, ts.cpu_parent, ts.gpu
TRITON, TORCH = BACKENDS["triton"], BACKENDS["torch"]


test_interpreter_suite, test_interpreter_suite_exhaustive = ts.interpreter_suites(__file__)
DEFAULT_TIER_CASES = 1   # interpreter tests: the first case of each in the default tier (conftest)


# (n, block, topk, heads, kv_heads, head_dim): several L, odd and tiny N, GQA.
CASES = [
    (1, 4, (1,), 1, 1, 16),
    (17, 16, (1,), 1, 1, 16),
    (100, 8, (4, 2), 2, 2, 32),
    (259, 16, (2, 2), 2, 1, 16),
    (300, 4, (3, 2, 2), 2, 1, 16),
    (1024, 8, (4, 2), 2, 1, 16),    # even: no ragged token, whole key chunks per level (kernels without masks)
    (256, 16, (4,), 2, 1, 16),      # even at the default block
    (272, 16, (3,), 2, 1, 16),      # batched fine steps with a partial last one; K_1 b = 48 keys in chunks of 16
    (512, 16, (2, 2), 2, 1, 24),    # a head dim that is no power of two (masked in the batched kernels)
    (2048, 32, (2, 2), 1, 1, 16),
]


def _qkv(n, heads, kv_heads, d, grid=False, dtype=torch.float32, device="cpu", pooled=None):
    """Fresh q ``(1, H, n, d)``, k, v ``(1, Hk, n, d)``: normal, or ``grid`` values. ``pooled = (block, levels)``:
    grid tokens of q and k under the ragged token of the deepest level with two tokens or more repeat one row, so
    that every ragged pooled mean that competes in a selection (over e.g. 12 tokens) stays exact and the scores
    with it too; else a true tie there can break either way by rounding (seed 3773167730 of
    ``test_select_wide_children_rows_take_fewer_parents_or_torch``, n=1100: tf32x3 and fp32 matmul split a tie at
    the ragged level-2 token). A single top-level token competes with nothing: its tokens stay random."""
    make = ts.grid_values if grid else torch.randn
    q = make(1, heads, n, d)
    k = make(1, kv_heads, n, d) + (0.5 if grid else 0.3 * torch.randn(1, kv_heads, 1, d))
    v = make(1, kv_heads, n, d)
    if grid and pooled:
        block, levels = pooled
        span = max([block**level for level in range(1, levels + 1) if num_blocks(n, block**level) >= 2], default=1)
        tail = n % span
        for x in (q, k):
            x[:, :, n - tail:] = x[:, :, n - tail:n - tail + 1].clone()
    return [x.to(dtype=dtype, device=device) for x in (q, k, v)]


def _leaf_run(fn, q, k, v, selection, levels, scale, pooled_dtype=None, terms=("o", "lse")):
    """o, lse and the gradients of q, k, v and of every pooled level (separate fp32 leaves, rounded
    through ``pooled_dtype`` first: the kernels read bf16 pooled keys, and at the dense top level
    that rounding alone moves the pooled gradients by ~2% against fp32 means) of a random loss of the outputs
    ``terms``."""

    def pooled(x):
        return [(p.to(pooled_dtype).float() if pooled_dtype else p).detach().requires_grad_()
                for p in pool_pyramid(x, selection.block, levels)]

    q = q.detach().requires_grad_()
    k_levels = [k.detach().requires_grad_()] + pooled(k)
    v_levels = [v.detach().requires_grad_()] + pooled(v)
    o, lse = fn(q, k_levels, v_levels, selection, scale)
    gen = torch.Generator().manual_seed(0)
    w_o = torch.randn(o.shape, generator=gen).to(o)
    w_lse = torch.randn(lse.shape, generator=gen).to(lse)
    loss = {"o": (o.float() * w_o.float()).sum(), "lse": (lse * w_lse).sum()}
    sum(loss[term] for term in terms).backward()
    return [o, lse, q.grad] + [x.grad for x in k_levels] + [x.grad for x in v_levels]


# ----------------------------------------------------------------------------------------------- CPU


@cpu_only
@pytest.mark.parametrize("n,block,topk,heads,kv_heads,d", CASES)
def test_pool_matches_masks(n, block, topk, heads, kv_heads, d):
    x = torch.randn(2, kv_heads, n, d)
    got = llsa_pool(x, block, len(topk))
    torch.testing.assert_close(got, torch.cat(pool_pyramid(x, block, len(topk)), dim=2), rtol=1e-6, atol=1e-6)


@cpu_only
@pytest.mark.exhaustive
def test_pool_passes_from_sums_split_to_fill_the_device(monkeypatch):
    """The passes from sums (levels 3 and 4 here) cut their tokens into more programs where a device would run too
    few (``pool.pass_step``, on by default on CUDA only): the same pyramid bit for bit, the step really smaller."""
    from flexsparse.triton.pooling import pool
    x = torch.randn(2, 3, 5000, 32)
    whole = llsa_pool(x, 4, 4)
    monkeypatch.setitem(pool.PASS_PROGRAMS, "cpu", 64)
    assert pool.sums_step(32, x.device) == 32 and pool.pass_step(32, x.device, 79, 6) == 4
    assert pool.pass_step(32, x.device, 20, 6) == 1  # levels 3 and 4 of this pyramid
    assert torch.equal(llsa_pool(x, 4, 4), whole)


@cpu_only
@pytest.mark.parametrize("n,block,topk,heads,kv_heads,d", [CASES[2], CASES[4], CASES[8], (2048, 32, (2,), 4, 2, 64),
                                                           (4200, 64, (1, 1), 1, 1, 160)])
def test_pool_qkv_is_three_pyramids_and_their_rounding(n, block, topk, heads, kv_heads, d):
    """``llsa_pool_qkv`` (one launch over q, k and v, GQA): the fp32 pyramids of ``llsa_pool`` and their rounding to
    the inputs' dtype, bit for bit, from views with their own strides; at L = 1, 2, 3, and at L = 2 with levels 1
    and 2 in two passes (b x D over 8192 elements, the last case)."""
    q = torch.randn(2, n, heads, d, dtype=torch.float16).transpose(1, 2)
    k = torch.randn(2, kv_heads, 2, n, d, dtype=torch.float16)[:, :, 1]
    v = torch.randn(2, n, kv_heads, d, dtype=torch.float16).transpose(1, 2)
    q_pyr, k_scores, k_pyr, v_pyr = llsa_pool_qkv(q, k, v, block, len(topk))
    want = [llsa_pool(x.contiguous(), block, len(topk)) for x in (q, k, v)]
    assert q_pyr.dtype == k_scores.dtype == torch.float32 and k_pyr.dtype == v_pyr.dtype == torch.float16
    assert torch.equal(q_pyr, want[0]) and torch.equal(k_scores, want[1])
    assert torch.equal(k_pyr, want[1].half()) and torch.equal(v_pyr, want[2].half())


@cpu_only
@pytest.mark.parametrize("n,block,topk,heads,kv_heads,d", CASES)
def test_select_matches_masks(n, block, topk, heads, kv_heads, d):
    q, k, _ = _qkv(n, heads, kv_heads, d, grid=True, pooled=(block, len(topk)))
    q_levels, k_levels = pool_pyramid(q, block, len(topk)), pool_pyramid(k, block, len(topk))
    sel = llsa_select(torch.cat(q_levels, 2), torch.cat(k_levels, 2), n, block, list(topk))
    expected = hierarchical_topk(q_levels, k_levels, topk, block, n)
    got = level_table(n, block, topk).unpack(sel)
    for level, (a, b) in enumerate(zip(got.indices, expected.indices), start=1):
        assert torch.equal(a, b), f"S_{level} differs"


@cpu_parent
def test_launches_fit_sm90_shared_memory():
    """Every launch of LLSA's forward and backward compiled for sm_90 (``benchmarks/sm90_fit.py``, no GPU needed) fits
    its 227 KB of shared memory, in fp32: the ragged path at b=8 (whose bf16 tiles needed 283 KB) and a 611-token top
    level (260 KB in the dense selection kernel), two launch failures the GPU fuzz test found."""
    cmd = [sys.executable, os.path.join(ts.ROOT, "benchmarks", "sm90_fit.py"), "--dtypes", "fp32", "--dims", "64",
           "--llsa", "2", "7"]
    env = dict(os.environ, PYTHONPATH=ts.ROOT)
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ts.ROOT, env=env, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def test_select_refuses_rows_it_cannot_fill():
    """K over the top level's tokens (or over a ragged parent set's children) is an error, not unwritten slots."""
    q_pyr, k_pyr = torch.randn(1, 1, 4 + 63, 8), torch.randn(1, 1, 4 + 63, 8)  # N=1000, b=16: T_1 = 63, T_2 = 4
    with pytest.raises(ValueError, match="K_2=8 exceeds the 4 level-2 tokens"):
        llsa_select(q_pyr, k_pyr, 1000, 16, [8, 8])
    # two level-2 tokens hold as few as 16 + 15 level-1 tokens (the last parent has 63 - 3 * 16 = 15 children)
    with pytest.raises(ValueError, match="K_1=32 exceeds the candidates under 2 level-2 tokens \\(as few as 31"):
        llsa_select(q_pyr, k_pyr, 1000, 16, [32, 2])


@cpu_only
@pytest.mark.parametrize("n,block,topk", [(1100, 4, (3,)), (10240, 32, (2, 9))])
def test_select_wide_rows_cut_ties_by_bisection(n, block, topk):
    """Rows of more than ``select.SCAN_LIMIT`` candidates (a dense top level of 275 tokens; 9 x 32 children) cut the
    ties at the threshold by bisection over the columns: the same selection on grid values (many ties)."""
    from flexsparse.triton.selection import hierarchy as select
    q, k, _ = _qkv(n, 2, 1, 16, grid=True)
    q_levels, k_levels = pool_pyramid(q, block, len(topk)), pool_pyramid(k, block, len(topk))
    widest = max([q_levels[-1].shape[2]] + [kk * block for kk in topk[1:]])
    assert widest > select.SCAN_LIMIT
    sel = llsa_select(torch.cat(q_levels, 2), torch.cat(k_levels, 2), n, block, list(topk))
    expected = hierarchical_topk(q_levels, k_levels, topk, block, n)
    for a, b in zip(level_table(n, block, topk).unpack(sel).indices, expected.indices):
        assert torch.equal(a, b)


@cpu_only
@pytest.mark.parametrize("grid", [True, False])
@pytest.mark.parametrize("n,block,topk,heads,kv_heads,d", [(300, 4, (3, 2, 2), 2, 1, 16), (1100, 4, (1, 5), 4, 2, 8),
                                                           (512, 16, (8, 2), 2, 2, 24), (1024, 8, (4, 16), 2, 1, 16),
                                                           (250, 16, (16,), 2, 1, 16), (1100, 4, (5,), 2, 1, 16)])
def test_select_searches_agree(n, block, topk, heads, kv_heads, d, grid):
    """The searches of the selection kernels (``select.search``: packed, its rows in parts or whole; bisection) pick
    the same keys in the same order, ties included (grid values: many), for K that are no power of two, K = 1,
    K = every token of a ragged level (a full bitonic sort), wide rows (the 275-token top level) and GQA."""
    q, k, _ = _qkv(n, heads, kv_heads, d, grid=grid)
    q_pyr, k_pyr = (torch.cat(pool_pyramid(x, block, len(topk)), 2) for x in (q, k))
    split, whole, int64, bisection = selections_by_search(q_pyr, k_pyr, n, block, topk)
    assert torch.equal(split, bisection) and torch.equal(whole, bisection) and torch.equal(int64, bisection)


@cpu_only
@pytest.mark.exhaustive
def test_select_long_top_level_through_block_topk():
    """A top level longer than the dense select kernel's limit goes through ``block_topk``: the same selection."""
    from flexsparse.triton.selection import hierarchy as select
    n, block, topk = 300, 4, (3, 2)
    q, k, _ = _qkv(n, 2, 1, 16, grid=True, pooled=(block, 2))
    q_levels, k_levels = pool_pyramid(q, block, 2), pool_pyramid(k, block, 2)
    expected = hierarchical_topk(q_levels, k_levels, topk, block, n)
    for limit in (16, select.DENSE_TOP_ELEMENTS):  # T_2 = 19 (32 x 16 padded elements)
        sel = select.hierarchical_topk(torch.cat(q_levels, 2), torch.cat(k_levels, 2), level_table(n, block, topk),
                                       dense_limit=limit)
        for a, b in zip(level_table(n, block, topk).unpack(sel).indices, expected.indices):
            assert torch.equal(a, b)


@cpu_only
@pytest.mark.exhaustive
@pytest.mark.parametrize("score_bytes", ["two parents", "one parent", "none"])
def test_select_wide_children_rows_take_fewer_parents_or_torch(score_bytes, monkeypatch):
    """With two parents per program asked for (the ``select`` tile override ``parents``), children rows too wide for
    two (``select.child_parents``) run one per program, or, too wide for one, through
    ``selection.naive.children_topk``: the same selection at every level (L = 3, GQA; two parents: a partial last
    program repeats its last parent)."""
    from flexsparse.triton.selection import hierarchy as select
    n, block, topk = 1100, 4, (3, 5, 2)
    one = 4 * 16 * pow2(block * 5, 16)  # one parent's fp32 scores at the widest children rows
    limit = {"two parents": 2 * one, "one parent": one, "none": one - 1}[score_bytes]
    monkeypatch.setattr(select, "CHILD_SCORE_BYTES", limit)
    monkeypatch.setattr(select, "CHILD_PARENTS", 2)
    q, k, _ = _qkv(n, 4, 2, 16, grid=True, pooled=(block, 3))
    q_levels, k_levels = pool_pyramid(q, block, 3), pool_pyramid(k, block, 3)
    sel = llsa_select(torch.cat(q_levels, 2), torch.cat(k_levels, 2), n, block, list(topk))
    expected = hierarchical_topk(q_levels, k_levels, topk, block, n)
    for a, b in zip(level_table(n, block, topk).unpack(sel).indices, expected.indices):
        assert torch.equal(a, b)


@cpu_only
@pytest.mark.parametrize("deterministic", [False, True])
def test_csc_is_transpose(deterministic, monkeypatch):
    """Both paths: the one small-table kernel per level (lists ascending either way) and the count-scan-scatter or
    sort."""
    from flexsparse.triton.common import csc
    n, block, topk = 300, 4, (3, 2, 2)
    q, k, _ = _qkv(n, 2, 1, 16)
    selection = hierarchical_topk(pool_pyramid(q, block, 3), pool_pyramid(k, block, 3), topk, block, n)
    levels = level_table(n, block, topk)
    for one_kernel, work in ((True, csc._SMALL_WORK), (False, 0)):
        monkeypatch.setattr(csc, "_SMALL_WORK", work)
        offsets, rows = csc.selection_csc(pack(selection), levels, deterministic)
        for level, s in enumerate(selection.indices):
            keys = s.shape[2]
            start, first = levels.rows[level][CSC_OFF], levels.rows[level][SEL_OFF]
            off = offsets[..., start:start + keys + 1].long()
            got = rows[..., first:first + s.shape[2] * s.shape[3]]
            dense = torch.zeros(*s.shape[:3], keys, dtype=torch.bool).scatter_(-1, s.long(), True)
            for h in range(s.shape[1]):
                for key in range(keys):
                    members = got[0, h, off[0, h, key]:off[0, h, key + 1]].long()
                    assert torch.equal(members.sort().values, dense[0, h, :, key].nonzero().flatten())
            if deterministic or one_kernel:
                assert torch.equal(got, csr_to_csc(s, keys).rows)
                assert torch.equal(off, csr_to_csc(s, keys).offsets.long())


HOISTED = (4096, 16, (2, 2), 2, 1, 16)  # even, L = 2, batched: the fused forward hoists its key rows (llsa_fwd)
PARTIAL_TILE = (336, 16, (2, 2), 2, 1, 16)  # batched, L = 2, 21 query blocks: the fused forward's last tile is partial
ENTRY = {"fuse_dq": False, "entry_memory": 1e9}                    # every coarse level's dK/dV ancestor-major
KEY_MAJOR = {"fuse_dq": False, "entry_memory": 0.0}                 # ... key-major
FUSED = {"fuse_dq": True, "dkv_slots": 2, "entry_memory": 0.0}      # ... and dQ in one kernel, lists in rounds
NOT_HOISTED = {"fuse_dq": False, "entry_memory": 1e9, "hoist_runs": 0, "fine_hoist": False}  # the loops' index loads


@cpu_only
@pytest.mark.parametrize("n,block,topk,heads,kv_heads,d,tiles",
                         [case + (ENTRY,) for case in CASES + [HOISTED, PARTIAL_TILE]]
                         + [case + (KEY_MAJOR,) for case in CASES[2:6]]
                         + [case + (FUSED,) for case in CASES[6:] + [HOISTED, PARTIAL_TILE]]
                         + [HOISTED + (NOT_HOISTED,)])
def test_attention_matches_torch_backend(n, block, topk, heads, kv_heads, d, tiles, monkeypatch):
    """Identical selection: outputs, LSE and gradients of q, k, v and of every pooled level. The coarse levels'
    dK/dV ancestor-major (with rows split over programs: the CPU tiles' ``entry_rows``) or key-major; dQ in one
    kernel (``fuse_dq``, where the fine level runs batched) or in two; with ``fuse_dq`` the batched fine dK/dV also
    reads its lists 2 ids at a time (several rounds per list). The forward hoists its key rows where the backward
    does (``hoist_runs``)."""
    hoist_runs = tiles.get("hoist_runs", llsa_fwd.HOIST_RUNS)
    monkeypatch.setenv("FLEXSPARSE_TRITON_TILES", json.dumps({"bwd": tiles, "fwd": {"hoist_runs": hoist_runs}}))
    q, k, v = _qkv(n, heads, kv_heads, d)
    levels = len(topk)
    selection = hierarchical_topk(pool_pyramid(q, block, levels), pool_pyramid(k, block, levels), topk, block, n)
    got = _leaf_run(TRITON.llsa_softmax, q, k, v, selection, levels, d**-0.5)
    want = _leaf_run(TORCH.llsa_softmax, q, k, v, selection, levels, d**-0.5)
    names = ["o", "lse", "dq"] + [f"dk{l}" for l in range(levels + 1)] + [f"dv{l}" for l in range(levels + 1)]
    for name, a, b in zip(names, got, want):
        assert (ts.lse_err if name == "lse" else ts.rel_err)(a, b) < 1e-5, name


@cpu_only
@pytest.mark.parametrize("tiles", [ENTRY, FUSED])
@pytest.mark.parametrize("terms", [("o",), ("lse",)])
def test_gradients_of_one_output(terms, tiles, monkeypatch):
    """A loss of the output alone (the op gets no LSE gradient: none is zero-filled) or of the LSE alone (a zero
    output gradient): the torch backend's gradients, with dQ in two kernels or in one."""
    monkeypatch.setenv("FLEXSPARSE_TRITON_TILES", json.dumps({"bwd": tiles}))
    n, block, topk, heads, kv_heads, d = PARTIAL_TILE
    q, k, v = _qkv(n, heads, kv_heads, d)
    levels = len(topk)
    selection = hierarchical_topk(pool_pyramid(q, block, levels), pool_pyramid(k, block, levels), topk, block, n)
    got = _leaf_run(TRITON.llsa_softmax, q, k, v, selection, levels, d**-0.5, terms=terms)
    want = _leaf_run(TORCH.llsa_softmax, q, k, v, selection, levels, d**-0.5, terms=terms)
    for index, (a, b) in enumerate(zip(got, want)):
        if b is None:                                   # the LSE does not depend on v
            assert a is None or not a.any(), index
        else:
            assert (ts.lse_err if index == 1 else ts.rel_err)(a, b) < 1e-5, index


@cpu_only
@pytest.mark.parametrize("n,block,topk,heads,kv_heads,d", [CASES[3], CASES[5]])
def test_half_inputs_with_fp32_pooled_levels(n, block, topk, heads, kv_heads, d):
    """fp16 q, k, v with fp32 pooled leaves (``Backend.llsa_softmax``'s contract): the kernels cast the pooled keys."""
    q, k, v = _qkv(n, heads, kv_heads, d, dtype=torch.float16)
    levels = len(topk)
    selection = hierarchical_topk(pool_pyramid(q, block, levels), pool_pyramid(k, block, levels), topk, block, n)
    got = _leaf_run(TRITON.llsa_softmax, q, k, v, selection, levels, d**-0.5)
    want = _leaf_run(TORCH.llsa_softmax, q.float(), k.float(), v.float(), selection, levels, d**-0.5)
    for a, b in zip(got, want):
        assert ts.rel_err(a, b) < 2e-2


@cpu_only
@pytest.mark.parametrize("n,block,topk,heads,kv_heads,d", [CASES[2], CASES[3], CASES[8]])
def test_method_matches_reference(n, block, topk, heads, kv_heads, d):
    """The whole method (pool, select, attend, gradients through the pooling) against the dense spec; CASES[8]
    runs the fine level batched (the pooled gradients added by the batched dK/dV kernel)."""
    q, k, v = _qkv(n, heads, kv_heads, d, grid=True, pooled=(block, len(topk)))
    cfg = {"method": "llsa", "block_size": block, "topk": list(topk)}
    results = {}
    for backend in ("triton", "reference"):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        o, lse = flexsparse.attention(*leaves, cfg, backend=backend, return_lse=True)
        gen = torch.Generator().manual_seed(1)
        loss = (o * torch.randn(o.shape, generator=gen)).sum() + (lse * torch.randn(lse.shape, generator=gen)).sum()
        loss.backward()
        results[backend] = [o, lse] + [x.grad for x in leaves]
    for name, a, b in zip(["o", "lse", "dq", "dk", "dv"], results["triton"], results["reference"]):
        assert ts.rel_err(a, b) < 1e-5, name


@cpu_only
@pytest.mark.parametrize("n,block", [(100, 8), (512, 16)])  # ragged and batched fine level
@pytest.mark.parametrize("tiles", [ENTRY, KEY_MAJOR], ids=["ancestor-major", "key-major"])
def test_deterministic_gradients_do_not_depend_on_program_order(n, block, tiles, monkeypatch):
    """Every level's CSC built with atomic slots (``_SMALL_WORK`` 0, 8 entries per scatter program) lists its
    query blocks as the scatter's programs ran. Deterministic mode sorts them: q, k and v's gradients come out the
    same bits with the programs run last to first. Without it some change (the comparison sees the order)."""
    from flexsparse.triton.common import csc
    monkeypatch.setattr(csc, "_SMALL_WORK", 0)
    monkeypatch.setattr(csc, "_BE", 8)
    monkeypatch.setenv("FLEXSPARSE_TRITON_TILES", json.dumps({"bwd": tiles}))
    q, k, v = _qkv(n, 2, 1, 16)
    for deterministic in (True, False):
        cfg = {"method": "llsa", "block_size": block, "topk": [4, 2], "deterministic": deterministic}
        grads = []
        for order in (contextlib.nullcontext, ts.programs_reversed):
            leaves = [x.clone().requires_grad_() for x in (q, k, v)]
            with order():
                flexsparse.attention(*leaves, cfg, backend="triton").square().sum().backward()
            grads.append([x.grad for x in leaves])
        same = [torch.equal(a, b) for a, b in zip(*grads)]
        assert all(same) if deterministic else not all(same), (deterministic, same)


@cpu_parent
def test_runs_on_cpu_only_with_interpreter():
    with ts.interpreter_env(False):
        assert not runs_on("triton", torch.device("cpu"), needs_grad=True)
    with ts.interpreter_env(True):
        assert runs_on("triton", torch.device("cpu"), needs_grad=True)


@cpu_parent
def test_cpu_fallback_without_interpreter():
    """Without the interpreter, the ops run their CPU kernels (the torch backend's computations); ``flexsparse``
    refuses ``backend="triton"`` there, so the test reaches them through ``ts.triton_ops_on_cpu``."""
    q, k, v = _qkv(100, 2, 1, 16, grid=True)
    cfg = {"method": "llsa", "block_size": 8, "topk": [4, 2]}
    with ts.interpreter_env(False), ts.triton_ops_on_cpu():
        results = []
        for backend in ("triton", "torch"):
            leaves = [x.clone().requires_grad_() for x in (q, k, v)]
            o = flexsparse.attention(*leaves, cfg, backend=backend)
            o.square().sum().backward()
            results.append([o] + [x.grad for x in leaves])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b)


@cpu_parent
def test_opcheck_cpu_fallback():
    n, block, topk = 100, 8, [4, 2]
    q, k, v = _qkv(n, 2, 1, 16)
    with ts.interpreter_env(False):
        k_pyr, v_pyr = llsa_pool(k, block, 2), llsa_pool(v, block, 2)
        sel = llsa_select(llsa_pool(q, block, 2), k_pyr, n, block, topk)
        torch.library.opcheck(llsa_pool.op, (k, block, 2))
        torch.library.opcheck(llsa_pool_qkv.op, (q, k, v, block, 2))
        torch.library.opcheck(llsa_select.op, (llsa_pool(q, block, 2), k_pyr, n, block, topk))
        for fuse in (False, True):
            args = (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), k_pyr.requires_grad_(not fuse),
                    v_pyr.requires_grad_(not fuse), sel, block, topk, 0.25, fuse, False)
            # aot_dispatch_dynamic of the fallback takes about a minute on 2 cores: once is enough here
            utils = ("test_schema", "test_autograd_registration", "test_faketensor") if fuse else None
            torch.library.opcheck(llsa_attn.op, args, **({"test_utils": utils} if utils else {}))


# ----------------------------------------------------------------------------------------------- GPU


def _gpu_inputs(n, heads, kv_heads, d, dtype=torch.bfloat16):
    torch.manual_seed(0)
    q, k, v = _qkv(n, heads, kv_heads, d)
    return [x.to("cuda", dtype) for x in (q, k, v)]


@gpu
def test_gpu_level_constants_are_built_not_kept_inside_a_cuda_graph_capture():
    """A level constant asked for first inside a capture is built there and not kept (it would hold only the
    capture's record of its fill); the next eager call builds and keeps its own, which later captures read."""
    levels = level_table(4099, 16, (4, 2))                   # a table no other test asks for
    like = torch.empty(1, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = levels.log2_counts(like)
    graph.replay()
    eager = levels.log2_counts(like)
    assert captured is not eager and torch.equal(captured, eager)
    assert levels.log2_counts(like) is eager
    with torch.cuda.graph(torch.cuda.CUDAGraph()):
        assert levels.log2_counts(like) is eager


@gpu
@pytest.mark.parametrize("n,heads,kv_heads,d,topk,dtype", [
    (16384, 4, 2, 64, (8, 8), torch.bfloat16), (9000, 2, 2, 128, (8, 8), torch.bfloat16),
    (8192, 2, 2, 128, (8, 8), torch.bfloat16),
    (70000, 2, 1, 64, (8, 8, 8), torch.bfloat16), (4133, 2, 1, 32, (8, 8), torch.float16)])
def test_gpu_matches_torch_backend(n, heads, kv_heads, d, topk, dtype):
    q, k, v = _gpu_inputs(n, heads, kv_heads, d, dtype)
    block, levels = 16, len(topk)
    selection = TRITON.llsa_select(q, k, v, block, topk).selection      # the Triton kernels
    got = _leaf_run(TRITON.llsa_softmax, q, k, v, selection, levels, d**-0.5, q.dtype)
    want = _leaf_run(TORCH.llsa_softmax, q.float(), k.float(), v.float(), selection, levels, d**-0.5, q.dtype)
    names = ["o", "lse", "dq"] + [f"dk{l}" for l in range(levels + 1)] + [f"dv{l}" for l in range(levels + 1)]
    for name, a, b in zip(names, got, want):
        assert ts.rel_err(a, b) < 2e-2, name


@gpu
@pytest.mark.parametrize("n,block,topk,d", [(4133, 8, (9, 4), 64), (4000, 16, (8, 8), 128), (5000, 16, (8, 8, 2), 128),
                                            (4096, 16, (8, 8), 64)])
def test_gpu_fp32_matches_torch_backend(n, block, topk, d):
    """fp32 on the GPU (IEEE products, tiles of their own: the bf16 ones needed 283 KB of shared memory in the
    ragged fine forward at b=8, and failed to launch) against the torch backend in fp32, ragged and batched."""
    q, k, v = [x.cuda() for x in _qkv(n, 2, 1, d)]
    selection = TRITON.llsa_select(q, k, v, block, topk).selection
    got = _leaf_run(TRITON.llsa_softmax, q, k, v, selection, len(topk), d**-0.5)
    want = _leaf_run(TORCH.llsa_softmax, q, k, v, selection, len(topk), d**-0.5)
    for i, (a, b) in enumerate(zip(got, want)):
        assert ts.rel_err(a, b) < 1e-4, i


@gpu
@pytest.mark.parametrize("n,block,topk", [(65536, 16, (8, 8)), (131072, 16, (8, 20))])  # rows of 128; 512 and 320
def test_gpu_selection_matches_masks(n, block, topk):
    q, k, _ = _gpu_inputs(n, 4, 2, 64)
    q_levels, k_levels = pool_pyramid(q, block, 2), pool_pyramid(k, block, 2)
    sel = llsa_select(torch.cat(q_levels, 2), torch.cat(k_levels, 2), n, block, list(topk))
    got = level_table(n, block, topk).unpack(sel)
    want = hierarchical_topk(q_levels, k_levels, topk, block, n)
    top = (got.indices[-1] == want.indices[-1]).all(-1).float().mean().item()
    assert top > 0.99
    fine = children_topk(q_levels[0], k_levels[0], got.indices[1], topk[0], block)  # same parents
    assert (got.indices[0] == fine).all(-1).float().mean().item() > 0.99


@gpu
@pytest.mark.parametrize("d", [32, 64, 128])
def test_gpu_select_searches_agree(d):
    """The selection kernels' searches (packed in parts or over whole rows, bisection) give the same selection on
    the GPU at a realistic size."""
    n, block, topk = 65536, 16, [8, 8]
    q, k, _ = _gpu_inputs(n, 4, 2, d)
    split, whole, int64, bisection = selections_by_search(llsa_pool(q, block, 2), llsa_pool(k, block, 2), n,
                                                          block, topk)
    assert torch.equal(split, bisection) and torch.equal(whole, bisection) and torch.equal(int64, bisection)


@gpu
@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("topk", [{"topk": 8, "levels": 2}, {"topk": [8, 8, 2]}], ids=["L2", "L3"])
def test_gpu_method_compiled_and_eager(compiled, topk):
    """Eager and ``torch.compile(fullgraph=True)`` against the torch backend; at L3 level 2's dK/dV runs
    ancestor-major. The torch backend selects in PyTorch: inputs on which it selects as the Triton kernels do
    (``ts.draw_selecting_alike``)."""
    cfg = flexsparse.Config.from_dict({"method": "llsa", "block_size": 16, **topk})  # outside the graph
    torch.manual_seed(0)
    q, k, v = ts.draw_selecting_alike(lambda: [x.to("cuda", torch.bfloat16) for x in _qkv(16384, 4, 2, 64)], cfg,
                                      backends=("triton", ("torch", lambda *x: [t.float() for t in x])))

    def step(q, k, v):
        o, lse = flexsparse.attention(q, k, v, cfg, backend="triton", return_lse=True)
        return o, lse

    fn = torch.compile(step, fullgraph=True) if compiled else step
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    o, lse = fn(*leaves)
    (o.float().square().sum() + lse.sum()).backward()
    ref_leaves = [x.float().clone().requires_grad_() for x in (q, k, v)]
    ro, rlse = flexsparse.attention(*ref_leaves, cfg, backend="torch", return_lse=True)
    (ro.square().sum() + rlse.sum()).backward()
    assert ts.rel_err(o, ro) < 2e-2
    assert ts.rel_err(lse, rlse) < 2e-2
    for a, b in zip(leaves, ref_leaves):
        assert ts.rel_err(a.grad, b.grad) < 3e-2


@gpu
@pytest.mark.parametrize("topk", [8, [8, 8, 2]], ids=["L2", "L3"])      # L3: level 2 ancestor-major
def test_gpu_deterministic(topk):
    q, k, v = _gpu_inputs(16384, 4, 2, 64)
    cfg = {"method": "llsa", "block_size": 16, "topk": topk, "deterministic": True}
    grads = []
    for _ in range(2):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        flexsparse.attention(*leaves, cfg, backend="triton").float().square().sum().backward()
        grads.append([x.grad for x in leaves])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


@gpu
def test_gpu_opcheck():
    n, block, topk = 4100, 16, [8, 4]
    q, k, v = _gpu_inputs(n, 2, 1, 64)
    k_pyr, v_pyr = llsa_pool(k, block, 2), llsa_pool(v, block, 2)
    q_pyr = llsa_pool(q, block, 2)
    sel = llsa_select(q_pyr, k_pyr, n, block, topk)
    torch.library.opcheck(llsa_pool.op, (k, block, 2))
    torch.library.opcheck(llsa_pool_qkv.op, (q, k, v, block, 2))
    torch.library.opcheck(llsa_select.op, (q_pyr, k_pyr, n, block, topk))
    for fuse in (False, True):
        args = (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), k_pyr.requires_grad_(not fuse),
                v_pyr.requires_grad_(not fuse), sel, block, topk, 0.125, fuse, False)
        torch.library.opcheck(llsa_attn.op, args)
