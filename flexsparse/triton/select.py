"""Hierarchical top-K selection of LLSA in Triton.

One kernel per level. Top level (``_select_top_kernel``): each program scores 16 pooled query tokens against every
token of the level (fp32 dots over all of its keys at once: tf32x3 up to ``PACKED_TOP_KEYS`` tokens, else
IEEE; levels of more than ``DENSE_TOP_TOKENS`` tokens, or whose fp32 keys take more than ``DENSE_TOP_ELEMENTS``
elements, take the single-level ``block_topk``). Each finer level (``_select_children_kernel``): a warp per parent
token scores its ``b`` children against the children of the parent's selection only (``K_{l+1} * b`` candidates
per query token, O(N)), with three-pass TF32 tensor-core dots (``tf32x3``, fp32 accuracy; an IEEE fp32 FMA dot took
150 of this kernel's 250 us at N=65536 on an H100). Rows are selected all at once (``store_top``), by one of three
searches, whichever ran faster for the kernel's shape (``search``): a bitonic top-K of the scores packed with their
key ids (``top_tokens``, ``SEARCH_PACKED``), the K-th largest score by a bitonic top-K of the scores alone and then
``first_k_rows``' cut at it (``top_mask``, ``SEARCH_THRESHOLD``), or bisection (``bisect.first_k_rows``,
``SEARCH_BISECT``). The packed search stores each row's tokens at fixed addresses; the other two pack the taken
columns by rank, a store whose address ``torch.compile``'s write analysis sees as depending on the pyramids, so
it takes them as written (``tests/test_triton_writes.py``); compiled graphs copy them only where something reads
them after the launch, which LLSA's calls do not. Ties go to the smallest
key id (candidates are laid out in id order: the parent's selection is ascending); rows are stored ascending. The
result equals ``flexsparse.masks.hierarchical_topk`` on the same pyramids (exactly where the products are exact, as
on the tests' grid values). Tuning overrides (``tiles.overrides("select")``): ``parents`` (``CHILD_PARENTS``),
``top_warps`` (``top_warps``), ``top_precision``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..masks import children_topk
from .bisect import INT_MAX, INT_MIN, first_k_rows, ordered_key, store_taken, take_from
from .block_topk import block_topk
from .common import KV_OFF, SEL_OFF, T, TOPK, launcher, program_heads
from . import layout
from .layout import Levels, cdiv, pow2
from .tiles import overrides

SEARCH_BISECT, SEARCH_PACKED, SEARCH_THRESHOLD = 0, 1, 2  # store_top's searches (module docstring)
PACKED, THRESHOLD = tl.constexpr(SEARCH_PACKED), tl.constexpr(SEARCH_THRESHOLD)  # the same, in the kernels


@triton.jit
def level_bases(QP, KP, META, b, h, qp_b, qp_h, kp_b, kp_h, GROUP, LEVEL):
    """Query head ``(b, h)``'s and its KV head's pyramids, the tokens of ``LEVEL`` and their first pyramid row;
    read-only (``common.program_heads``)."""
    return (QP + b.to(tl.int64) * qp_b + h.to(tl.int64) * qp_h,
            KP + b.to(tl.int64) * kp_b + (h // GROUP).to(tl.int64) * kp_h, tl.load(META + LEVEL * 6 + T),
            tl.load(META + LEVEL * 6 + KV_OFF))


@triton.jit
def top_tokens(key, tok, KSEL: tl.constexpr, KP: tl.constexpr):
    """The tokens of the ``KSEL`` largest keys of each row of ``key (..., C)`` (ties to the smallest token of
    ``tok``, same shape, unique per row), ascending: ``(..., KP)`` int32, ``KP = pow2(KSEL)``, slots past ``KSEL``
    hold ``INT_MAX``. A bitonic top-K (``tl.topk``) of the keys packed with their tokens into int64."""
    packed = (key.to(tl.int64) << 32) | (INT_MAX - tok.to(tl.int64))
    best = tl.topk(packed, KP)
    tokens = INT_MAX - (best & INT_MAX).to(tl.int32)
    return tl.sort(tl.where(tl.arange(0, KP) < KSEL, tokens, INT_MAX))


@triton.jit
def top_mask(key, KSEL: tl.constexpr, KP: tl.constexpr):
    """``bisect.first_k_rows``' mask of the ``KSEL`` largest keys of each row of ``key (..., C)`` (ties to the
    smallest column), its threshold found by a bitonic top-K of the int32 keys alone (``KP = pow2(KSEL)``)."""
    best = tl.topk(key, KP)  # descending
    threshold = tl.min(tl.where(tl.arange(0, KP) < KSEL, best, INT_MAX), axis=-1)
    return take_from(key, threshold, KSEL, 0, False, True)


@triton.jit
def store_tokens(out_rows, tokens, row_ok, KSEL: tl.constexpr, KP: tl.constexpr):
    """Store the first ``KSEL`` of ``tokens (..., KP)`` at ``out_rows (...)`` where ``row_ok``."""
    slot = tl.arange(0, KP)
    tl.store(tl.expand_dims(out_rows, -1) + slot, tokens, mask=tl.expand_dims(row_ok, -1) & (slot < KSEL))


@triton.jit
def store_top(out_rows, key, cand, row_ok, KSEL: tl.constexpr, KP: tl.constexpr, SCAN: tl.constexpr,
              SEARCH: tl.constexpr):
    """The ``KSEL`` tokens of the largest keys of each row of ``key (..., R, C)`` (``cand (..., C)``: the token of
    each column, shared by the rows) stored ascending at ``out_rows (..., R)`` where ``row_ok``, found by ``SEARCH``
    (module docstring; ``KP = pow2(KSEL)``, ``SCAN``: ``first_k_rows``' ``TIES_BY_SCAN``)."""
    if SEARCH == PACKED:
        tok = tl.expand_dims(cand, -2) + tl.zeros_like(key)
        store_tokens(out_rows, top_tokens(key, tok, KSEL, KP), row_ok, KSEL, KP)
    else:
        if SEARCH == THRESHOLD:
            taken = top_mask(key, KSEL, KP)
        else:
            taken = first_k_rows(key, KSEL, 0, False, SCAN)
        store_taken(out_rows, taken & tl.expand_dims(row_ok, -1), cand)


@triton.jit
def _select_top_kernel(QP, KP, SEL, META, qp_b, qp_h, kp_b, kp_h, H, GROUP, S_TOTAL, LEVEL,
                       D: tl.constexpr, BD: tl.constexpr, BQ: tl.constexpr, BC: tl.constexpr, KSEL: tl.constexpr,
                       SCAN: tl.constexpr, SEARCH: tl.constexpr, KSEL2: tl.constexpr, PRECISION: tl.constexpr):
    """``S_LEVEL`` rows of the top level: query tokens ``pid * BQ ...`` against every token of the level (fp32
    dots: ``PRECISION`` "ieee" or "tf32x3"). The top ``KSEL`` of each row, ascending (``store_top``)."""
    pid = tl.program_id(0)
    bh, b, h = program_heads(H)
    q_base, k_base, tokens, off = level_bases(QP, KP, META, b, h, qp_b, qp_h, kp_b, kp_h, GROUP, LEVEL)
    sel = SEL + bh.to(tl.int64) * S_TOTAL
    rows = pid * BQ + tl.arange(0, BQ)
    row_ok = rows < tokens
    cand = tl.arange(0, BC)
    c_ok = cand < tokens
    dim = tl.arange(0, BD)
    q = tl.load(q_base + (off + rows).to(tl.int64)[:, None] * D + dim[None, :],
                mask=row_ok[:, None] & (dim[None, :] < D), other=0.0)
    k = tl.load(k_base + (off + cand).to(tl.int64)[:, None] * D + dim[None, :],
                mask=c_ok[:, None] & (dim[None, :] < D), other=0.0)
    key = tl.where(c_ok[None, :], ordered_key(tl.dot(q, tl.trans(k), input_precision=PRECISION)), INT_MIN)
    out = sel + tl.load(META + (LEVEL - 1) * 6 + SEL_OFF) + rows.to(tl.int64) * KSEL
    store_top(out, key, cand, row_ok, KSEL, KSEL2, SCAN, SEARCH)


@triton.jit
def _select_children_kernel(QP, KP, SEL, META, qp_b, qp_h, kp_b, kp_h, H, GROUP, S_TOTAL, LEVEL, PARENTS,
                            D: tl.constexpr, BD: tl.constexpr, BLOCK: tl.constexpr, BQ: tl.constexpr,
                            BC: tl.constexpr, KSEL: tl.constexpr, W: tl.constexpr, DC: tl.constexpr,
                            SCAN: tl.constexpr, SEARCH: tl.constexpr, KSEL2: tl.constexpr):
    """``S_LEVEL`` rows below the top: ``W`` parents (level LEVEL+1) per program, one per warp (batched 3-d
    products and searches: each warp's row reductions stay in the warp), the ``BLOCK`` query tokens under each
    against the children of ``S_{LEVEL+1}[parent]`` (tf32x3 dots). A partial last program repeats the last parent
    (the same rows, stored twice with the same values)."""
    pid = tl.program_id(0)
    bh, b, h = program_heads(H)
    q_base, k_base, tokens, off = level_bases(QP, KP, META, b, h, qp_b, qp_h, kp_b, kp_h, GROUP, LEVEL)
    sel = SEL + bh.to(tl.int64) * S_TOTAL
    parent = tl.minimum(pid * W + tl.arange(0, W), PARENTS - 1)
    j = tl.arange(0, BQ)
    e = tl.arange(0, BC)
    rows = parent[:, None] * BLOCK + j[None, :]
    row_ok = (j[None, :] < BLOCK) & (rows < tokens)
    parent_k = tl.load(META + LEVEL * 6 + TOPK)
    e_ok = e[None, :] < parent_k * BLOCK
    ids = tl.load(sel + tl.load(META + LEVEL * 6 + SEL_OFF) + parent[:, None] * parent_k + (e // BLOCK)[None, :],
                  mask=e_ok, other=0)
    cand = ids * BLOCK + (e % BLOCK)[None, :]
    c_ok = e_ok & (cand < tokens)
    q_rows = q_base + (off + rows).to(tl.int64)[:, :, None] * D
    k_rows = k_base + (off + cand).to(tl.int64)[:, :, None] * D
    scores = tl.zeros([W, BQ, BC], tl.float32)
    for c in range(0, BD, DC):  # head-dim chunks: a warp's whole (BC, D) fp32 candidate tile would spill
        dim = c + tl.arange(0, DC)[None, None, :]
        q = tl.load(q_rows + dim, mask=row_ok[:, :, None] & (dim < D), other=0.0)
        k = tl.load(k_rows + dim, mask=c_ok[:, :, None] & (dim < D), other=0.0)
        scores = tl.dot(q, tl.trans(k), scores, input_precision="tf32x3")
    key = tl.where(c_ok[:, None, :], ordered_key(scores), INT_MIN)
    out = sel + tl.load(META + (LEVEL - 1) * 6 + SEL_OFF) + rows.to(tl.int64) * KSEL
    store_top(out, key, cand, row_ok, KSEL, KSEL2, SCAN, SEARCH)


DENSE_TOP_TOKENS = 1024  # top levels with more tokens, or with more (padded tokens x head dims) than
DENSE_TOP_ELEMENTS = 256 * 128  # go through block_topk (rows of up to 16K keys): the dense kernel holds the level's
# fp32 keys in shared memory, 128 KB here (1024 x 64 needed 260 KB, over sm_90's 227 KB, and failed to launch:
# benchmarks/sm90_fit.py)
CHILD_PARENTS = 1  # parents per program below the top level, a warp each (H100, session 34, B2 H8 b16 K8, us:
# N65536 D64 85-86 against 96-98 with 2; N262144 L3 161-162 against 185-186; D128 with top_mask 119-122 against
# 125-127. Session 17, H200, bisection: 2 parents 102 against 111 with 1 and 110 with 4)
HEAD_CHUNK = 16  # head dims per step of the children's scores (32 and 64 spilled: 134 and 215 us against 97)
# The searches that ran faster (us per launch at B2 H8 b16 K8): bitonic for top levels of <= 256 tokens (H200,
# session 32: D64 34.7 -> 30.2 on 8 warps, D128 77.8 -> 66.2, D32 28.7 -> 19.2; 64 tokens 10.0 -> 5.9; but 512
# tokens 136 -> 160, spilled), there with tf32x3 dots instead of IEEE (H100, session 34: D64 31.0 -> 28.2 on 4 warps,
# D128 66-67 -> 46-47 on 8); for children rows of <= 128 candidates packed at D <= 64 (session 32: D64 100 -> 90-97,
# D32 81 -> 65, but D128 129 -> 138), top_mask above D=64 (H100, session 34, one parent per program: D128 bisection
# 136 -> 119-122; D64 85-86 with either bitonic search)
CHILD_SCORE_BYTES = 128 * 1024  # a program's fp32 scores (parents x rows x candidates) pass through shared memory:
# 2 parents x 32 rows x 1024 candidates needed 270 KB at D=128 and failed to launch (H100, session 33; limit 227 KB)
PACKED_TOP_KEYS, BITONIC_CHILD_KEYS, PACKED_CHILD_DIMS = 256, 128, 64
SCAN_LIMIT = 256  # rows of at most this many candidates cut ties by a prefix sum (0.167 vs 0.188 ms at 128, H100);
# wider ones by bisection (a prefix sum at 512 columns made block top-K ~35x slower: docs/triton_llsa.md)


def search(top: bool, candidates: int, head_dims: int) -> int:
    """The search (``SEARCH_*``) of a selection kernel's rows of ``candidates`` keys (a power of two) at ``head_dims``
    (padded): the fastest measured (``PACKED_TOP_KEYS``), packed where it was as fast (the store compile sees). All
    give the same selection."""
    if top:
        return SEARCH_PACKED if candidates <= PACKED_TOP_KEYS else SEARCH_BISECT
    if candidates > BITONIC_CHILD_KEYS:
        return SEARCH_BISECT
    return SEARCH_PACKED if head_dims <= PACKED_CHILD_DIMS else SEARCH_THRESHOLD


def child_parents(rows: int, candidates: int, most: int) -> int:
    """Parents per program (a warp each) of the children's selection, rows of ``candidates`` (padded) keys:
    ``most``, fewer where their fp32 scores exceed ``CHILD_SCORE_BYTES``; 0 where one parent's do (such a
    level goes through ``masks.children_topk``)."""
    for parents in range(most, 0, -1):
        if parents * rows * candidates * 4 <= CHILD_SCORE_BYTES:
            return parents
    return 0


def top_warps(bitonic: bool, candidates: int, head_dims: int) -> int:
    """Warps of a top-level program (16 query rows x ``candidates`` keys of ``head_dims``): with the bitonic search
    (and tf32x3 dots) 4 up to 256 x 64 (28 us against 37 on 8), 8 above (256 x 128: 46 against 60)."""
    size = candidates * head_dims
    return (8 if size > 256 * 64 else 4) if bitonic else (4 if size <= 256 * 64 else 8)


def hierarchical_topk(q_pyr: torch.Tensor, k_pyr: torch.Tensor, levels: Levels,
                      dense_limit: int = DENSE_TOP_ELEMENTS) -> torch.Tensor:
    """Packed selection ``(B, H, sum_l T_l * K_l)`` int32 from pooled pyramids.

    q_pyr: ``(B, H, T_1 + ... + T_L, D)``, k_pyr: ``(B, Hk, ..., D)``, both fp32 and contiguous. A top level of
    more than ``DENSE_TOP_TOKENS`` tokens, or whose keys (tokens and head dims, each padded to a power of two) are
    more than ``dense_limit`` elements, goes through ``block_topk``.
    """
    bsz, heads, _, d = q_pyr.shape
    sel = q_pyr.new_empty(bsz, heads, levels.selection_size, dtype=torch.int32)
    meta = levels.meta(q_pyr)
    top, block = levels.levels, levels.block
    args = (q_pyr, k_pyr, sel, meta, q_pyr.stride(0), q_pyr.stride(1), k_pyr.stride(0), k_pyr.stride(1),
            heads, heads // k_pyr.shape[1], levels.selection_size)
    bc, bd, tiles = pow2(levels.tokens(top), 16), pow2(d, 16), overrides("select")
    if bc <= DENSE_TOP_TOKENS and bc * bd <= dense_limit:
        how = search(True, bc, bd)
        launcher(_select_top_kernel)[(cdiv(levels.tokens(top), 16), bsz * heads)](
            *args, top, D=d, BD=bd, BQ=16, BC=bc, KSEL=levels.topk[-1], SCAN=bc <= SCAN_LIMIT, SEARCH=how,
            KSEL2=pow2(levels.topk[-1]),
            PRECISION=tiles.get("top_precision", "tf32x3" if bc <= PACKED_TOP_KEYS else "ieee"),
            num_warps=tiles.get("top_warps", top_warps(how != SEARCH_BISECT, bc, bd)))
    else:
        q_top, k_top = levels.split_pyramid(q_pyr)[-1], levels.split_pyramid(k_pyr)[-1]
        start, count = levels.rows[top - 1][layout.SEL_OFF], levels.tokens(top) * levels.topk[-1]
        sel[:, :, start:start + count] = block_topk(q_top, k_top, levels.topk[-1], 0)[0].flatten(2)
    bq = pow2(block, 16)
    for level in range(top - 1, 0, -1):
        bc = pow2(levels.topk[level] * block, 16)
        parents, per_program = levels.tokens(level + 1), child_parents(bq, bc, tiles.get("parents", CHILD_PARENTS))
        if not per_program:
            wide_children(q_pyr, k_pyr, sel, levels, level)
            continue
        launcher(_select_children_kernel)[(cdiv(parents, per_program), bsz * heads)](
            *args, level, parents, D=d, BD=bd, BLOCK=block, BQ=bq, BC=bc, KSEL=levels.topk[level - 1],
            W=per_program, DC=HEAD_CHUNK, SCAN=bc <= SCAN_LIMIT, SEARCH=search(False, bc, bd),
            KSEL2=pow2(levels.topk[level - 1]), num_warps=per_program)
    return sel


def wide_children(q_pyr: torch.Tensor, k_pyr: torch.Tensor, sel: torch.Tensor, levels: Levels, level: int) -> None:
    """``S_level`` written into the packed ``sel`` by ``masks.children_topk`` (fp32, memory-bounded chunks), for rows
    of candidates too wide for ``_select_children_kernel`` (``child_parents``)."""
    packed = levels.unpack(sel)
    packed.indices[level - 1].copy_(children_topk(levels.split_pyramid(q_pyr)[level - 1],
                                                  levels.split_pyramid(k_pyr)[level - 1], packed.indices[level],
                                                  levels.topk[level - 1], levels.block))
