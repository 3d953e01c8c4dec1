"""LLSA coarse dK/dV, ancestor-major: the gradients of a coarse level's keys from the queries that attend them.

At a coarse level l (1 <= l < L) the queries under one level-(l+1) token r (``b^{l+1}`` consecutive fine rows)
all attend the same keys: the ``b`` level-l children of each of r's ``K_{l+1}`` selected tokens (``S_{l+1}[r]``).
The key-major kernel (``bwd._sparse_dkv_kernel``) walks, per selected token, the CSC list of the rows that
selected it, so every query row is read ``K_{l+1}`` times and the matrix products are only ``b`` keys wide.
Here instead:

1. ``_entry_dkv_kernel``: one program per (token r, chunk of ``TK`` of its ``K_{l+1} b`` keys, split of its rows,
   query head) runs the top level's dense key-major step (``common.jit.dkv_rows``) over r's rows: each row is read
   once per chunk, the products are ``TK`` keys wide. It stores the chunk's partial dK (scaled) and dV, fp32, in slot
   ``j b + c`` (child c of the j-th selected token) of r's row of a partial table ``(B H, T_{l+1}, splits, slots,
   D)``.
2. ``_entry_sum_kernel``: one program per (level-(l+1) token p, batch x KV head) sums, for p's ``b`` children,
   the partials of every row that selected p (its CSC list of ``S_{l+1}``, in list order, over the query heads of
   the KV head and the splits) and stores them as the level's rows of dK^(l), dV^(l).

Bytes: each row is read once per key chunk (twice at K_{l+1} b = 128, TK = 64) instead of ``K_{l+1}`` times; the
partials, ``2 H T_{l+1} K_{l+1} b D`` fp32 values per batch entry (``entry_scratch``), are written and read once.
Sums are in CSC list order, so deterministic with a deterministic CSC, as the key-major kernel's.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._runtime.registry import launcher
from ..common.jit import (CSC_OFF, KV_OFF, LOG2E, SEL_OFF, SPAN, T, TOPK, dkv_rows, load_rows, log2_count,
                          program_heads, store_rows)
from .._runtime.sizes import cdiv, pow2
from ...masks import level_span
from ...masks.levels import Levels


@triton.jit
def _entry_dkv_kernel(Q, KC, VC, DO, LSE, DELTA, SEL, META, PART_K, PART_V, q_b, q_h, q_n, do_b, do_h, do_n, c_b, c_h,
                      H, GROUP, N, LEVEL, S_TOTAL, ROWS, CHUNKS,
                      D: tl.constexpr, BD: tl.constexpr, BLOCK: tl.constexpr, TK: tl.constexpr, QR: tl.constexpr,
                      SCALE2: tl.constexpr, SCALE: tl.constexpr, IEEE: tl.constexpr):
    """Partial dK, dV of key chunk ``program_id(2) % CHUNKS`` of level-(LEVEL+1) token ``program_id(0)`` from
    its rows ``[split ROWS, (split + 1) ROWS)``, split ``program_id(2) // CHUNKS``, of query head ``program_id(1)``."""
    r = tl.program_id(0)
    chunk = tl.program_id(2) % CHUNKS
    split = tl.program_id(2) // CHUNKS
    bh, b, h = program_heads(H)
    bh = bh.to(tl.int64)
    tokens = tl.load(META + LEVEL * 6 + T)
    off = tl.load(META + LEVEL * 6 + KV_OFF)
    span = tl.load(META + LEVEL * 6 + SPAN)
    topk = tl.load(META + LEVEL * 6 + TOPK)
    sel_off = tl.load(META + LEVEL * 6 + SEL_OFF)
    slot = chunk * TK + tl.arange(0, TK)
    listed = slot < topk * BLOCK
    parent = tl.load(SEL + bh * S_TOTAL + sel_off + r * topk + slot // BLOCK, mask=listed, other=0)
    tok = parent * BLOCK + slot % BLOCK
    k_ok = listed & (tok < tokens)
    dim = tl.arange(0, BD)
    kv = b.to(tl.int64) * c_b + (h // GROUP).to(tl.int64) * c_h
    k = load_rows(KC + kv, off + tok, D, dim, k_ok, D).to(Q.dtype.element_ty)
    v = load_rows(VC + kv, off + tok, D, dim, k_ok, D).to(Q.dtype.element_ty)
    bias = tl.where(k_ok, log2_count(tok, span, N), float("-inf"))
    dk = tl.zeros([TK, BD], tl.float32)
    dv = tl.zeros([TK, BD], tl.float32)
    first = r * span * BLOCK
    lo = first + split * ROWS
    hi = tl.minimum(tl.minimum(lo + ROWS, first + span * BLOCK), N)
    q_head = b.to(tl.int64) * q_b + h.to(tl.int64) * q_h
    do_head = b.to(tl.int64) * do_b + h.to(tl.int64) * do_h
    dk, dv = dkv_rows(Q + q_head, DO + do_head, LSE + bh * N, DELTA + bh * N, lo, hi, q_n, do_n, dim, k, v, bias, dk,
                      dv, D, QR, SCALE2, IEEE)
    row = ((bh * tl.num_programs(0) + r) * (tl.num_programs(2) // CHUNKS) + split) * (CHUNKS * TK)
    store_rows(PART_K + row * D, dk * SCALE, slot, D, dim, listed, D)
    store_rows(PART_V + row * D, dv, slot, D, dim, listed, D)


@triton.jit
def _entry_sum_kernel(SEL, OFFSETS, ROWS, META, PART_K, PART_V, DKC, DVC, c_b, c_h, H, HK, GROUP, LEVEL,
                      S_TOTAL, C_TOTAL, ENTRIES, SPLITS, SLOTS,
                      D: tl.constexpr, BD: tl.constexpr, BLOCK: tl.constexpr, BK: tl.constexpr,
                      KP2: tl.constexpr):
    """dK^(LEVEL), dV^(LEVEL) of the children of level-(LEVEL+1) token ``program_id(0)`` (batch x KV head
    ``program_id(1)``): the partials of the rows that selected it, in CSC list order."""
    p = tl.program_id(0)
    _, b, hk = program_heads(HK)
    tokens = tl.load(META + LEVEL * 6 + T)
    off = tl.load(META + LEVEL * 6 + KV_OFF)
    topk = tl.load(META + LEVEL * 6 + TOPK)
    sel_off = tl.load(META + LEVEL * 6 + SEL_OFF)
    csc_off = tl.load(META + LEVEL * 6 + CSC_OFF)
    child = tl.arange(0, BK)
    tok = p * BLOCK + child
    k_ok = (child < BLOCK) & (tok < tokens)
    dim = tl.arange(0, BD)
    j = tl.arange(0, KP2)
    dk = tl.zeros([BK, BD], tl.float32)
    dv = tl.zeros([BK, BD], tl.float32)
    for g in range(GROUP):
        bh = (b * H + hk * GROUP + g).to(tl.int64)
        lo = tl.load(OFFSETS + bh * C_TOTAL + csc_off + p)
        hi = tl.load(OFFSETS + bh * C_TOTAL + csc_off + p + 1)
        for e in range(lo, hi):
            r = tl.load(ROWS + bh * S_TOTAL + sel_off + e)
            ids = tl.load(SEL + bh * S_TOTAL + sel_off + r * topk + j, mask=j < topk, other=-1)
            slot = tl.max(tl.where(ids == p, j, -1), axis=0) * BLOCK
            for split in range(SPLITS):
                row = ((bh * ENTRIES + r) * SPLITS + split) * SLOTS + slot
                dk += load_rows(PART_K + row * D, child, D, dim, k_ok, D)
                dv += load_rows(PART_V + row * D, child, D, dim, k_ok, D)
    kv = b.to(tl.int64) * c_b + hk.to(tl.int64) * c_h
    store_rows(DKC + kv, dk, off + tok, D, dim, k_ok, D)
    store_rows(DVC + kv, dv, off + tok, D, dim, k_ok, D)


def _chunks(levels: Levels, level: int, tiles: dict) -> tuple[int, int]:
    """Keys per chunk and chunks of one level-(level+1) token's ``K_{level+1} b`` keys."""
    keys = levels.topk[level] * levels.block
    tk = min(tiles["entry_TK"], pow2(keys, 16))
    return tk, cdiv(keys, tk)


def _splits(levels: Levels, level: int, tiles: dict) -> tuple[int, int]:
    """Rows per split (a multiple of ``entry_QR``, at most ``entry_rows`` unless that is below one step) and splits
    of one level-(level+1) token's ``b^{level+1}`` rows (N where that reaches past the sequence: ``level_span``)."""
    group_rows = level_span(levels.n, levels.block, level + 1)
    rows = cdiv(cdiv(group_rows, cdiv(group_rows, tiles["entry_rows"])), tiles["entry_QR"]) * tiles["entry_QR"]
    return rows, cdiv(group_rows, rows)


def entry_scratch(levels: Levels, level: int, heads: int, tiles: dict) -> int:
    """Bytes of ``entry_dkv``'s two fp32 partial tables per batch entry and head-dim element: the backward takes
    this kernel where they are at most ``entry_memory`` times those of k and v (``backward_tiles``)."""
    tk, chunks = _chunks(levels, level, tiles)
    return 2 * heads * levels.tokens(level + 1) * _splits(levels, level, tiles)[1] * chunks * tk * 4


def entry_dkv(q, kc, vc, do, lse, delta, sel, offsets, rows, dkc, dvc, levels: Levels, level: int, scale: float,
              tiles: dict) -> None:
    """Writes the level-``level`` rows (1 <= level < L) of ``dkc``, ``dvc`` ``(B, Hk, T_1 + ... + T_L, D)`` fp32:
    the gradients of that level's pooled keys and values. q, do ``(B, H, N, D)`` (rows contiguous, any other
    strides); kc, vc the pooled pyramids; lse, delta ``(B, H, N)`` fp32; sel the packed selection, offsets / rows
    its CSC (``csc.selection_csc``).
    Tiles: ``entry_TK`` keys per chunk, ``entry_QR`` rows per step, ``entry_rows`` rows per split at most,
    ``entry_warps``, ``entry_stages``."""
    bsz, heads, n, d = q.shape
    kv_heads = kc.shape[1]
    block, topk = levels.block, levels.topk[level]
    entries = levels.tokens(level + 1)
    tk, chunks = _chunks(levels, level, tiles)
    split_rows, splits = _splits(levels, level, tiles)
    acc = dkc.dtype
    part_k = q.new_empty(bsz * heads, entries, splits, chunks * tk, d, dtype=acc)
    part_v = torch.empty_like(part_k)
    common = dict(D=d, BD=pow2(d, 16), BLOCK=block)
    meta = levels.meta(q)
    launcher(_entry_dkv_kernel)[(entries, bsz * heads, chunks * splits)](
        q, kc, vc, do, lse, delta, sel, meta, part_k, part_v, *q.stride()[:3], *do.stride()[:3],
        kc.stride(0), kc.stride(1), heads, heads // kv_heads, n, level, levels.selection_size, split_rows, chunks,
        TK=tk, QR=tiles["entry_QR"], SCALE2=float(scale * LOG2E.value), SCALE=float(scale),
        IEEE=q.dtype == torch.float32, num_warps=tiles["entry_warps"], num_stages=tiles["entry_stages"], **common)
    launcher(_entry_sum_kernel)[(entries, bsz * kv_heads)](
        sel, offsets, rows, meta, part_k, part_v, dkc, dvc, dkc.stride(0), dkc.stride(1), heads, kv_heads,
        heads // kv_heads, level, levels.selection_size, levels.csc_size, entries, splits, chunks * tk,
        BK=pow2(block, 16), KP2=pow2(topk, 2), num_warps=1, **common)
