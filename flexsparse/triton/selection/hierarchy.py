"""Hierarchical top-K selection of LLSA in Triton.

One kernel per level. Top level (``_select_top_kernel``): each program scores 16 pooled query tokens against every
token of the level (fp32 dots: tf32x3 up to ``PACKED_TOP_KEYS`` tokens, else IEEE; levels of more than
``DENSE_TOP_TOKENS`` tokens, or whose fp32 keys take more than ``DENSE_TOP_ELEMENTS`` elements, take the
single-level ``block_topk``). Each finer level (``_select_children_kernel``): a program per parent token scores its
``b`` children against the children of the parent's selection only (``K_{l+1} * b`` candidates per query token,
O(N)), with three-pass TF32 tensor-core dots (``tf32x3``, fp32 accuracy; an IEEE fp32 FMA dot took 150 of this
kernel's 250 us at N=65536 on an H100). Rows are selected all at once (``store_top``), by one of two searches
(``search``): up to ``PACKED_TOP_KEYS`` / ``PACKED_CHILD_KEYS`` candidates a bitonic top-K (``tl.topk``) of the
scores' order-preserving int32 keys packed with their token ids into int64 (``packed_top``), the candidates cut
into parts of a warp each (``parts``: ``TOP_PARTS``, ``CHILD_PARTS``) whose best are merged by one more top-K; wider
rows by bisection (``bisect.first_k_rows``). Children rows searched packed first take a top-K of int32 keys (the
score key's high bits and the column, ``bucket_top``) and keep it where it provably equals the int64 search's (no
near-tie at the K-th key: almost every program on real scores), else run the int64 search (``store_children_top``).
The packed search stores each row's tokens at fixed addresses; bisection packs the taken columns by rank, a store
whose address ``torch.compile``'s write analysis sees as depending on the pyramids, so it takes them as written
(``tests/test_triton_writes.py``); compiled graphs copy them only where something reads them after the launch,
which LLSA's calls do not. Ties go to the smallest key id (candidates are laid out in id order: the parent's
selection is ascending); rows are stored ascending. The result
equals ``naive.hierarchical_topk`` on the same pyramids (exactly where the products are exact, as on the
tests' grid values). Tuning overrides (kind ``select`` of ``tiles``, ``SELECT_TILES``): ``parents``
(``CHILD_PARENTS``), ``top_split`` (``TOP_PARTS``), ``child_split`` (``CHILD_PARTS``), ``top_warps``,
``top_precision``, ``bucket`` (the children's int32 pass, default on).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.bisect import INT_MAX, INT_MIN, first_k_rows, ordered_key, store_taken
from .block_topk import block_topk
from .naive import children_topk
from .._runtime.registry import launcher
from ..common.jit import KV_OFF, SEL_OFF, T, TOPK, program_heads
from ...masks import levels as level_columns
from .._runtime.sizes import cdiv, pow2
from ...masks.levels import Levels
from .._runtime.tiles import with_overrides

SEARCH_BISECT, SEARCH_PACKED = 0, 1  # store_top's searches (module docstring)
SELECT_TILES = ("parents", "top_split", "child_split", "top_warps", "top_precision", "bucket")  # tile overrides
PACKED = tl.constexpr(SEARCH_PACKED)  # the same, in the kernels


@triton.jit
def level_bases(QP, KP, META, b, h, qp_b, qp_h, kp_b, kp_h, GROUP, LEVEL):
    """Query head ``(b, h)``'s and its KV head's pyramids, the tokens of ``LEVEL`` and their first pyramid row;
    read-only (``common.jit.program_heads``)."""
    return (QP + b.to(tl.int64) * qp_b + h.to(tl.int64) * qp_h,
            KP + b.to(tl.int64) * kp_b + (h // GROUP).to(tl.int64) * kp_h, tl.load(META + LEVEL * 6 + T),
            tl.load(META + LEVEL * 6 + KV_OFF))


@triton.jit
def packed_top(key, tok, KP: tl.constexpr):
    """The ``KP`` largest of each row of ``key (..., C)`` packed with their tokens (``tok``, same shape, unique per
    row) into int64, descending: ties go to the smallest token. A bitonic top-K (``tl.topk``)."""
    return tl.topk((key.to(tl.int64) << 32) | (INT_MAX - tok.to(tl.int64)), KP)


@triton.jit
def packed_tokens(best, KSEL: tl.constexpr, KP: tl.constexpr):
    """The tokens of ``packed_top``'s ``best (..., KP)``, the first ``KSEL`` ascending, ``INT_MAX`` after them."""
    tokens = INT_MAX - (best & INT_MAX).to(tl.int32)
    return tl.sort(tl.where(tl.arange(0, KP) < KSEL, tokens, INT_MAX))


@triton.jit
def store_tokens(out_rows, tokens, row_ok, KSEL: tl.constexpr, KP: tl.constexpr):
    """Store the first ``KSEL`` of ``tokens (..., KP)`` at ``out_rows (...)`` where ``row_ok``."""
    slot = tl.arange(0, KP)
    tl.store(tl.expand_dims(out_rows, -1) + slot, tokens, mask=tl.expand_dims(row_ok, -1) & (slot < KSEL))


@triton.jit
def merge_parts(best, KP: tl.constexpr, SPLIT: tl.constexpr):
    """Each row's ``KP`` largest of ``best (W * SPLIT, R, KP)``, the per-part top-K of ``SPLIT`` parts per row group
    (group-major): ``(W, R, KP)``, descending."""
    if SPLIT > 1:
        groups: tl.constexpr = best.shape[0] // SPLIT
        best = tl.reshape(tl.permute(tl.reshape(best, [groups, SPLIT, best.shape[1], KP]), [0, 2, 1, 3]),
                          [groups, best.shape[1], SPLIT * KP])
        best = tl.topk(best, KP)
    return best


@triton.jit
def bucket_top(key, col, row_ok, KSEL: tl.constexpr, KP: tl.constexpr, SPLIT: tl.constexpr, LOW: tl.constexpr):
    """The int32 pass of ``store_children_top``: each row's ``KP`` largest of ``(key & ~m) | (m - col)`` (``m =
    2^LOW - 1``: the key's bucket ``key >> LOW`` above the column, unique per row) as columns ``(W, R, KP)``, and
    whether the pick is exact in every valid row (a scalar): where the ``KSEL``-th pick's bucket lies whole in the
    pick (exactly ``KSEL`` keys in it or above) and is not padding's (``INT_MIN``), the pick is the ``KSEL`` largest
    keys whatever the tie-break. Its compare-and-swaps move one 32-bit value, the int64 search's two halves."""
    m: tl.constexpr = (1 << LOW) - 1
    best = merge_parts(tl.topk((key & ~m) | (m - tl.expand_dims(col, -2)), KP), KP, SPLIT)
    last = tl.min(tl.where(tl.arange(0, KP) < KSEL, best, INT_MAX), axis=-1)
    groups: tl.constexpr = key.shape[0] // SPLIT
    bucket = tl.reshape(tl.broadcast_to(tl.expand_dims(last >> LOW, 1), [groups, SPLIT, key.shape[1]]),
                        [key.shape[0], key.shape[1]])
    taken = tl.sum(((key >> LOW) >= tl.expand_dims(bucket, -1)).to(tl.int32), axis=2)
    taken = tl.sum(tl.reshape(taken, [groups, SPLIT, key.shape[1]]), axis=1)
    exact = tl.where(row_ok, (taken == KSEL) & ((last >> LOW) != (INT_MIN >> LOW)), True)
    return m - (best & m), tl.min(exact.to(tl.int32))


@triton.jit
def store_packed(out_rows, key, cand, row_ok, KSEL: tl.constexpr, KP: tl.constexpr, SPLIT: tl.constexpr):
    """``store_top``'s int64 search: each part's ``KP`` best (score key, token) packed (``packed_top``), the parts
    merged, the first ``KSEL`` tokens stored ascending."""
    best = merge_parts(packed_top(key, tl.expand_dims(cand, -2) + tl.zeros_like(key), KP), KP, SPLIT)
    store_tokens(out_rows, packed_tokens(best, KSEL, KP), row_ok, KSEL, KP)


@triton.jit
def store_top(out_rows, key, cand, row_ok, KSEL: tl.constexpr, KP: tl.constexpr, SCAN: tl.constexpr,
              SEARCH: tl.constexpr, SPLIT: tl.constexpr):
    """The ``KSEL`` tokens of the largest keys of each row stored ascending at ``out_rows (W, R)`` where ``row_ok``:
    ``key (W * SPLIT, R, C)`` holds row group w's columns in ``SPLIT`` parts (group-major), ``cand (W * SPLIT, C)``
    each column's token. ``SEARCH`` (module docstring; ``KP = pow2(KSEL)``): packed, each part keeps its rows'
    ``KP`` best and one more top-K merges a group's parts; or, with ``SPLIT = 1``, bisection (``SCAN``:
    ``first_k_rows``' ``TIES_BY_SCAN``)."""
    if SEARCH == PACKED:
        store_packed(out_rows, key, cand, row_ok, KSEL, KP, SPLIT)
    else:
        store_taken(out_rows, first_k_rows(key, KSEL, 0, False, SCAN) & tl.expand_dims(row_ok, -1), cand)


@triton.jit
def store_children_top(out_rows, key, cand, col, row_ok, parent_ids, KSEL: tl.constexpr, KP: tl.constexpr,
                       SCAN: tl.constexpr, SEARCH: tl.constexpr, SPLIT: tl.constexpr, LOW: tl.constexpr,
                       BUCKET: tl.constexpr, BLOCK: tl.constexpr):
    """``store_top`` of children rows (``col (W * SPLIT, C)``: each column's place in its row, ``< 2^LOW``). With
    ``BUCKET`` (the packed search only) an int32 pass first (``bucket_top``), kept where it is exact, the int64
    search elsewhere; the pick's columns map to tokens ``parent_ids[w, col // BLOCK] * BLOCK + col % BLOCK``
    (``parent_ids (W, P)``: the parents' own selection)."""
    if BUCKET:
        cols, exact = bucket_top(key, col, row_ok, KSEL, KP, SPLIT, LOW)
        if exact:
            cols = tl.sort(tl.where(tl.arange(0, KP) < KSEL, cols, INT_MAX))
            hit = tl.arange(0, parent_ids.shape[1])[None, None, None, :] == tl.expand_dims(cols // BLOCK, -1)
            tokens = tl.sum(tl.where(hit, parent_ids[:, None, None, :], 0), axis=3) * BLOCK + cols % BLOCK
            store_tokens(out_rows, tokens, row_ok, KSEL, KP)
        else:
            store_packed(out_rows, key, cand, row_ok, KSEL, KP, SPLIT)
    else:
        store_top(out_rows, key, cand, row_ok, KSEL, KP, SCAN, SEARCH, SPLIT)


@triton.jit
def fp32_scores(q_rows, q_ok, k_rows, k_ok, BD: tl.constexpr, D: tl.constexpr, DC: tl.constexpr,
                PRECISION: tl.constexpr):
    """``(P, R, C)`` fp32 dots of query rows ``q_rows (P, R, 1)`` with key rows ``k_rows (P, C, 1)`` (pointers to
    their first element; ``q_ok``, ``k_ok`` the same shapes), ``DC`` head dims per step (a warp's whole (C, D) fp32
    key tile would spill), ``PRECISION`` "tf32x3" or "ieee". Masked rows score 0."""
    scores = tl.zeros([q_rows.shape[0], q_rows.shape[1], k_rows.shape[1]], tl.float32)
    for c in range(0, BD, DC):
        dim = c + tl.arange(0, DC)[None, None, :]
        q = tl.load(q_rows + dim, mask=q_ok & (dim < D), other=0.0)
        k = tl.load(k_rows + dim, mask=k_ok & (dim < D), other=0.0)
        scores = tl.dot(q, tl.trans(k), scores, input_precision=PRECISION)
    return scores


@triton.jit
def _select_top_kernel(QP, KP, SEL, META, qp_b, qp_h, kp_b, kp_h, H, GROUP, S_TOTAL, LEVEL,
                       D: tl.constexpr, BD: tl.constexpr, BQ: tl.constexpr, BC: tl.constexpr, KSEL: tl.constexpr,
                       SCAN: tl.constexpr, SEARCH: tl.constexpr, KSEL2: tl.constexpr, PRECISION: tl.constexpr,
                       SPLIT: tl.constexpr, DC: tl.constexpr):
    """``S_LEVEL`` rows of the top level: query tokens ``pid * BQ ...`` against every token of the level, in
    ``SPLIT`` parts of ``BC / SPLIT`` tokens, a warp each (``fp32_scores``). The top ``KSEL`` of each row,
    ascending (``store_top``)."""
    pid = tl.program_id(0)
    bh, b, h = program_heads(H)
    q_base, k_base, tokens, off = level_bases(QP, KP, META, b, h, qp_b, qp_h, kp_b, kp_h, GROUP, LEVEL)
    sel = SEL + bh.to(tl.int64) * S_TOTAL
    rows = pid * BQ + tl.arange(0, BQ)[None, :]
    row_ok = rows < tokens
    cand = tl.arange(0, SPLIT)[:, None] * (BC // SPLIT) + tl.arange(0, BC // SPLIT)[None, :]
    c_ok = cand < tokens
    q_rows = tl.broadcast_to(q_base + (off + rows).to(tl.int64)[:, :, None] * D, [SPLIT, BQ, 1])
    scores = fp32_scores(q_rows, tl.broadcast_to(row_ok[:, :, None], [SPLIT, BQ, 1]),
                         k_base + (off + cand).to(tl.int64)[:, :, None] * D, c_ok[:, :, None], BD, D, DC, PRECISION)
    key = tl.where(c_ok[:, None, :], ordered_key(scores), INT_MIN)
    out = sel + tl.load(META + (LEVEL - 1) * 6 + SEL_OFF) + rows.to(tl.int64) * KSEL
    store_top(out, key, cand, row_ok, KSEL, KSEL2, SCAN, SEARCH, SPLIT)


@triton.jit
def _select_children_kernel(QP, KP, SEL, META, qp_b, qp_h, kp_b, kp_h, H, GROUP, S_TOTAL, LEVEL, PARENTS,
                            D: tl.constexpr, BD: tl.constexpr, BLOCK: tl.constexpr, BQ: tl.constexpr,
                            BC: tl.constexpr, KSEL: tl.constexpr, W: tl.constexpr, SPLIT: tl.constexpr,
                            DC: tl.constexpr, SCAN: tl.constexpr, SEARCH: tl.constexpr, KSEL2: tl.constexpr,
                            LOW: tl.constexpr, BUCKET: tl.constexpr, SLOTS: tl.constexpr):
    """``S_LEVEL`` rows below the top: ``W`` parents (level LEVEL+1) per program, the ``BLOCK`` query tokens under
    each against the children of ``S_{LEVEL+1}[parent]`` in ``SPLIT`` parts, a warp each (batched 3-d products
    and searches: each warp's row reductions stay in the warp; tf32x3 dots). A partial last program repeats the
    last parent (the same rows, stored twice with the same values)."""
    pid = tl.program_id(0)
    bh, b, h = program_heads(H)
    q_base, k_base, tokens, off = level_bases(QP, KP, META, b, h, qp_b, qp_h, kp_b, kp_h, GROUP, LEVEL)
    sel = SEL + bh.to(tl.int64) * S_TOTAL
    part = tl.arange(0, W * SPLIT)
    parent = tl.minimum(pid * W + part // SPLIT, PARENTS - 1)
    j = tl.arange(0, BQ)
    e = (part % SPLIT)[:, None] * (BC // SPLIT) + tl.arange(0, BC // SPLIT)[None, :]
    parent_k = tl.load(META + LEVEL * 6 + TOPK)
    parent_sel = sel + tl.load(META + LEVEL * 6 + SEL_OFF)  # S_{LEVEL+1}: the parents' own selection
    e_ok = e < parent_k * BLOCK
    ids = tl.load(parent_sel + parent[:, None] * parent_k + e // BLOCK, mask=e_ok, other=0)
    cand = ids * BLOCK + e % BLOCK
    c_ok = e_ok & (cand < tokens)
    rows = parent[:, None] * BLOCK + j[None, :]
    scores = fp32_scores(q_base + (off + rows).to(tl.int64)[:, :, None] * D,
                         ((j[None, :] < BLOCK) & (rows < tokens))[:, :, None],
                         k_base + (off + cand).to(tl.int64)[:, :, None] * D, c_ok[:, :, None], BD, D, DC, "tf32x3")
    key = tl.where(c_ok[:, None, :], ordered_key(scores), INT_MIN)
    parents = tl.minimum(pid * W + tl.arange(0, W), PARENTS - 1)  # each parent's rows once
    slot = tl.arange(0, SLOTS)[None, :]
    parent_ids = tl.load(parent_sel + parents[:, None] * parent_k + slot, mask=slot < parent_k, other=0)
    rows = parents[:, None] * BLOCK + j[None, :]
    out = sel + tl.load(META + (LEVEL - 1) * 6 + SEL_OFF) + rows.to(tl.int64) * KSEL
    store_children_top(out, key, cand, e, (j[None, :] < BLOCK) & (rows < tokens), parent_ids, KSEL, KSEL2, SCAN,
                       SEARCH, SPLIT, LOW, BUCKET, BLOCK)


DENSE_TOP_TOKENS = 1024  # top levels with more tokens, or with more (padded tokens x head dims) than
DENSE_TOP_ELEMENTS = 256 * 128  # go through block_topk (rows of up to 16K keys). A level's whole fp32 keys in shared
# memory take 260 KB at 1024 x 64, over sm_90's 227 KB (benchmarks/sm90_fit.py); with its head-dim chunks the dense
# kernel takes 66 KB at 1024 x 32, but wider dense levels are not measured, so the bound stays
CHILD_PARENTS = 1  # parents per program below the top level (H100, B2 H8 b16 K8, us, one warp each: N65536 D64
# 85-86 against 96-98 with 2; N262144 L3 161-162 against 185-186. With a bisection search, H200: 2 parents 102
# against 111 with 1 and 110 with 4)
HEAD_CHUNK = 16  # head dims per step of the scores (children, one warp: 32 and 64 spilled, 134 and 215 us against 97)
TOP_PARTS, CHILD_PARTS = 4, 2  # candidate parts (a warp each) of packed-searched rows (H100, B2 H8 b16 K8, us per
# launch, the same selections: top level of 256 tokens D64 14.1 against 27.3 in whole rows (8 parts 16.6, 16 parts
# 23.1), D128 18.2 against 47.3 (whole rows on 4 / 8 warps); of 64 tokens 4.8-5.5 against 6.1-6.7; children rows of
# 128 candidates D64 81.8 against 86.6 (4 parts 94.2, 8 parts 137), D128 113.5 against 120.9 with a whole-row
# threshold search, at N262144 L3 160-161 either way)
# The searches that run faster (us per launch at B2 H8 b16 K8): packed (bitonic) for top levels of <= 256 tokens
# (whole rows, H200: D64 30.2 against 34.7 by bisection, D128 66.2 against 77.8, D32 19.2 against 28.7; 64 tokens 5.9
# against 10.0; but 512 tokens 160 against 136, spilled), there with tf32x3 dots instead of IEEE (H100: D64 28.2
# against 31.0); for children rows of <= 128 candidates (D64 90-97 against 100, D32 65 against 81; D128 in parts,
# above)
CHILD_SCORE_BYTES = 128 * 1024  # a program's fp32 scores (parents x rows x candidates) pass through shared memory:
# 2 parents x 32 rows x 1024 candidates need 270 KB at D=128 and fail to launch (sm_90's limit: 227 KB)
PACKED_TOP_KEYS, PACKED_CHILD_KEYS = 256, 128
SCAN_LIMIT = 256  # rows of at most this many candidates cut ties by a prefix sum (LLSA's selection with 128-candidate
# rows by bisection: 0.167 against 0.188 ms, H100); wider ones by a bisection over the columns (a prefix sum at 512
# columns made block top-K ~35x slower: docs/triton_sla_pieces.md)


def search(top: bool, candidates: int) -> int:
    """The search (``SEARCH_*``) of a selection kernel's rows of ``candidates`` keys (a power of two): packed up to
    ``PACKED_TOP_KEYS`` / ``PACKED_CHILD_KEYS`` (faster there, and its stores' addresses do not depend on the scores,
    which ``torch.compile``'s write analysis sees), bisection above. Both give the same selection."""
    return SEARCH_PACKED if candidates <= (PACKED_TOP_KEYS if top else PACKED_CHILD_KEYS) else SEARCH_BISECT


def row_search(top: bool, candidates: int, kp: int, tiles: dict) -> tuple[int, int]:
    """``(search, parts)`` of a selection kernel's rows of ``candidates`` keys keeping ``kp``: ``search``, and the
    packed search's parts (``parts`` of ``TOP_PARTS`` / ``CHILD_PARTS``, tile overrides ``top_split`` /
    ``child_split``; bisection keeps whole rows)."""
    how = search(top, candidates)
    if how != SEARCH_PACKED:
        return how, 1
    most = tiles.get("top_split", TOP_PARTS) if top else tiles.get("child_split", CHILD_PARTS)
    return how, parts(candidates, kp, most)


def parts(candidates: int, kp: int, most: int) -> int:
    """Parts (a warp each) of packed-searched rows of ``candidates`` keys (a power of two) keeping ``kp`` each:
    ``most``, halved while a part would hold fewer than ``max(16, kp)`` keys (``tl.dot``'s and the top-K's width)."""
    split = most
    while split > 1 and candidates // split < max(16, kp):
        split //= 2
    return split


def child_parents(rows: int, candidates: int, most: int) -> int:
    """Parents per program of the children's selection, rows of ``candidates`` (padded) keys: ``most``, fewer
    where their fp32 scores exceed ``CHILD_SCORE_BYTES``; 0 where one parent's do (such a level goes through
    ``naive.children_topk``)."""
    for parents in range(most, 0, -1):
        if parents * rows * candidates * 4 <= CHILD_SCORE_BYTES:
            return parents
    return 0


def top_warps(candidates: int, head_dims: int) -> int:
    """Warps of a top-level program searching by bisection (16 query rows x ``candidates`` keys of ``head_dims``):
    4 up to 256 x 64, 8 above."""
    return 4 if candidates * head_dims <= 256 * 64 else 8


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
    bc, bd, tiles = pow2(levels.tokens(top), 16), pow2(d, 16), with_overrides("select", {}, SELECT_TILES)
    if bc <= DENSE_TOP_TOKENS and bc * bd <= dense_limit:
        kp = pow2(levels.topk[-1])
        how, split = row_search(True, bc, kp, tiles)
        launcher(_select_top_kernel)[(cdiv(levels.tokens(top), 16), bsz * heads)](
            *args, top, D=d, BD=bd, BQ=16, BC=bc, KSEL=levels.topk[-1], SCAN=bc <= SCAN_LIMIT, SEARCH=how, KSEL2=kp,
            PRECISION=tiles.get("top_precision", "tf32x3" if how == SEARCH_PACKED else "ieee"), SPLIT=split,
            DC=HEAD_CHUNK, num_warps=tiles.get("top_warps", split if how == SEARCH_PACKED else top_warps(bc, bd)),
            num_stages=3 if how == SEARCH_PACKED else 1)  # pipelined chunks of 1024 keys spilled (sm90_fit.py)
    else:
        q_top, k_top = levels.split_pyramid(q_pyr)[-1], levels.split_pyramid(k_pyr)[-1]
        start, count = levels.rows[top - 1][level_columns.SEL_OFF], levels.tokens(top) * levels.topk[-1]
        sel[:, :, start:start + count] = block_topk(q_top, k_top, levels.topk[-1], 0)[0].flatten(2)
    bq = pow2(block, 16)
    for level in range(top - 1, 0, -1):
        bc = pow2(levels.topk[level] * block, 16)
        parents, per_program = levels.tokens(level + 1), child_parents(bq, bc, tiles.get("parents", CHILD_PARENTS))
        if not per_program:
            wide_children(q_pyr, k_pyr, sel, levels, level)
            continue
        kp = pow2(levels.topk[level - 1])
        how, split = row_search(False, bc, kp, tiles)
        launcher(_select_children_kernel)[(cdiv(parents, per_program), bsz * heads)](
            *args, level, parents, D=d, BD=bd, BLOCK=block, BQ=bq, BC=bc, KSEL=levels.topk[level - 1],
            W=per_program, SPLIT=split, DC=HEAD_CHUNK, SCAN=bc <= SCAN_LIMIT, SEARCH=how, KSEL2=kp,
            # BUCKET (H200, B2 H8 b16 K8, the children's kernel in us, the same selections: N65536 D64 73.5 against
            # 80.5 without, D32 54.8 against 64.7, D128 103 against 109, N262144 L3 147.2 against 162.7, but N16384
            # 25.3 against 23.2; 168 registers instead of 137. At the top level it loses: 256 tokens D32 16.5 against
            # 11.5, D128 26.2 against 18.4)
            LOW=bc.bit_length() - 1, BUCKET=how == SEARCH_PACKED and tiles.get("bucket", True),
            SLOTS=pow2(levels.topk[level]),
            num_warps=per_program * split)
    return sel


def wide_children(q_pyr: torch.Tensor, k_pyr: torch.Tensor, sel: torch.Tensor, levels: Levels, level: int) -> None:
    """``S_level`` written into the packed ``sel`` by ``naive.children_topk`` (fp32, memory-bounded chunks), for rows
    of candidates too wide for ``_select_children_kernel`` (``child_parents``)."""
    packed = levels.unpack(sel)
    packed.indices[level - 1].copy_(children_topk(levels.split_pyramid(q_pyr)[level - 1],
                                                  levels.split_pyramid(k_pyr)[level - 1], packed.indices[level],
                                                  levels.topk[level - 1], levels.block))
