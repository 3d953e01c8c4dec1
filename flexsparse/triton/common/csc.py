"""CSR -> CSC transpose of selection tables, for key-major backward passes.

A packed table ``(B, H, S)`` int32 holds one or more segments, each a row-major ``(rows, K)`` table
whose entries are key ids in ``[0, keys)``. The CSC of a segment lists, per key, the rows that
selected it. Small tables (``small``: keys x entries x B x H up to ``_SMALL_WORK``, the eager sizes where
host time rules): one kernel, one program per key that scans the whole segment twice (the key's start and
count, then its members in order), lists ascending, no atomics. Larger tables, fast path: a counting pass
(integer atomics), a prefix sum and a scatter (atomic slots: the order inside a list varies run to run);
deterministic path: a stable sort, lists ascending. The one kernel replaces the three to eleven ops of the
others (at B1 H1 N4096 an eager backward's bookkeeping costs more host time than its kernels' GPU time).

Layout: ``offsets (B, H, sum (keys + 1))`` int32 (each segment's at its ``csc_off``, starting at 0),
``rows (B, H, S)`` int32 (each segment's at its ``sel_off``, like the table itself).

Users: LLSA (one segment per level, ``selection_csc``) and the single-level block table of
``topk`` / ``sla`` / ``sla2`` (``block_csc``).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ...masks import csr_to_csc
from .._runtime.registry import launcher
from .._runtime.sizes import cdiv, static
from ...masks.levels import CSC_OFF, Levels, SEL_OFF

_BE = 1024
_SMALL_WORK = 1 << 24     # key x entry comparisons of one small-table launch (~0.13 GB of L2 reads)
_SMALL_BE = 512


class Segment(NamedTuple):
    """One ``(rows, topk)`` table inside a packed selection: its entries at ``sel_off``, key ids in
    ``[0, keys)``, its CSC offsets at ``csc_off``."""

    rows: int
    topk: int
    keys: int
    sel_off: int
    csc_off: int


@triton.jit
def _count_kernel(SEL, COUNTS, S_TOTAL, C_TOTAL, sel_off, csc_off, entries, BE: tl.constexpr):
    e = tl.program_id(0) * BE + tl.arange(0, BE)
    bh = tl.program_id(1).to(tl.int64)
    ok = e < entries
    key = tl.load(SEL + bh * S_TOTAL + sel_off + e, mask=ok, other=0)
    tl.atomic_add(COUNTS + bh * C_TOTAL + csc_off + 1 + key, 1, mask=ok)


@triton.jit
def _scatter_kernel(SEL, CURSOR, ROWS, S_TOTAL, C_TOTAL, sel_off, csc_off, entries, topk, BE: tl.constexpr):
    e = tl.program_id(0) * BE + tl.arange(0, BE)
    bh = tl.program_id(1).to(tl.int64)
    ok = e < entries
    key = tl.load(SEL + bh * S_TOTAL + sel_off + e, mask=ok, other=0)
    slot = tl.atomic_add(CURSOR + bh * C_TOTAL + csc_off + key, 1, mask=ok)
    tl.store(ROWS + bh * S_TOTAL + sel_off + slot, e // topk, mask=ok)


@triton.jit
def _small_csc_kernel(SEL, OFFSETS, ROWS, S_TOTAL, C_TOTAL, sel_off, csc_off, entries, topk, BE: tl.constexpr):
    key = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    sel = SEL + bh * S_TOTAL + sel_off
    before = tl.zeros([], dtype=tl.int32)
    count = tl.zeros([], dtype=tl.int32)
    for start in range(0, entries, BE):
        e = start + tl.arange(0, BE)
        ids = tl.load(sel + e, mask=e < entries, other=-1)       # -1: no key, not below any counted key
        before += tl.sum(((ids < key) & (ids >= 0)).to(tl.int32), 0)
        count += tl.sum((ids == key).to(tl.int32), 0)
    offsets = OFFSETS + bh * C_TOTAL + csc_off
    tl.store(offsets + key + 1, before + count)
    tl.store(offsets, 0, mask=key == 0)
    rows = ROWS + bh * S_TOTAL + sel_off + before
    seen = tl.zeros([], dtype=tl.int32)
    for start in range(0, entries, BE):
        e = start + tl.arange(0, BE)
        hit = tl.load(sel + e, mask=e < entries, other=-1) == key
        rank = seen + tl.cumsum(hit.to(tl.int32), 0) - 1
        tl.store(rows + rank, e // topk, mask=hit)
        seen += tl.sum(hit.to(tl.int32), 0)


def small(segments: list["Segment"], bsz_heads) -> bool:
    """Whether the one-kernel path transposes these segments (static sizes only, ``sizes.static``)."""
    if not static(bsz_heads, *(x for seg in segments for x in (seg.rows, seg.keys, seg.topk))):
        return False
    return sum(seg.keys * seg.rows * seg.topk for seg in segments) * bsz_heads <= _SMALL_WORK


def segments_csc(sel: torch.Tensor, segments: list[Segment], csc_size: int,
                 deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(offsets (B, H, csc_size), rows (B, H, S))`` int32: the CSC of every segment of the packed
    table ``sel (B, H, S)`` int32 (contiguous). ``deterministic``: lists ascending (stable sort)."""
    bsz, heads, total = sel.shape
    rows = torch.empty_like(sel)
    if small(segments, bsz * heads) and sum(seg.keys + 1 for seg in segments) == csc_size:
        offsets = torch.empty(bsz, heads, csc_size, dtype=sel.dtype, device=sel.device)
        for seg in segments:
            launcher(_small_csc_kernel)[(seg.keys, bsz * heads)](
                sel, offsets, rows, total, csc_size, seg.sel_off, seg.csc_off, seg.rows * seg.topk, seg.topk,
                BE=_SMALL_BE)
        return offsets, rows
    offsets = sel.new_zeros(bsz, heads, csc_size)
    if deterministic:
        for seg in segments:
            part = sel[:, :, seg.sel_off:seg.sel_off + seg.rows * seg.topk].reshape(bsz, heads, seg.rows, seg.topk)
            csc = csr_to_csc(part, seg.keys)
            offsets[:, :, seg.csc_off:seg.csc_off + seg.keys + 1] = csc.offsets
            rows[:, :, seg.sel_off:seg.sel_off + seg.rows * seg.topk] = csc.rows
        return offsets, rows
    for seg in segments:
        entries = seg.rows * seg.topk
        launcher(_count_kernel)[(cdiv(entries, _BE), bsz * heads)](
            sel, offsets, total, csc_size, seg.sel_off, seg.csc_off, entries, BE=_BE)
    for seg in segments:
        span = slice(seg.csc_off, seg.csc_off + seg.keys + 1)
        offsets[:, :, span] = offsets[:, :, span].cumsum(-1, dtype=torch.int32)
    cursor = offsets.clone()
    for seg in segments:
        entries = seg.rows * seg.topk
        launcher(_scatter_kernel)[(cdiv(entries, _BE), bsz * heads)](
            sel, cursor, rows, total, csc_size, seg.sel_off, seg.csc_off, entries, seg.topk, BE=_BE)
    return offsets, rows


def selection_csc(sel: torch.Tensor, levels: Levels, deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """LLSA: ``(offsets, rows)`` of every level's ``S_{l+1}`` from a packed selection ``(B, H, S)`` int32
    (layout: ``flexsparse.masks.levels``; key ids of ``S_{l+1}`` are level-(l+1) tokens)."""
    segments = []
    for level in range(levels.levels):
        tokens = levels.tokens(level + 1)
        segments.append(Segment(tokens, levels.topk[level], tokens, levels.rows[level][SEL_OFF],
                                levels.rows[level][CSC_OFF]))
    return segments_csc(sel, segments, levels.csc_size, deterministic)


def block_csc(indices: torch.Tensor, num_keys: int, deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Single-level block table ``indices (B, H, Tq, K)`` int32 (contiguous) over ``num_keys`` key blocks:
    ``offsets (B, H, num_keys + 1)``; key j's query blocks are ``rows[b, h, offsets[j]:offsets[j + 1]]``
    of ``rows (B, H, Tq * K)``."""
    bsz, heads, tq, topk = indices.shape
    return segments_csc(indices.reshape(bsz, heads, tq * topk), [Segment(tq, topk, num_keys, 0, 0)], num_keys + 1,
                        deterministic)
