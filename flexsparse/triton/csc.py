"""CSR -> CSC transpose of the packed LLSA selection, for key-major backward passes.

For each level l < L, ``S_{l+1}`` (query tokens x selected key tokens, both at level l+1) becomes
per key token j the list of query tokens that selected it. Fast path: a counting pass (integer
atomics), a prefix sum and a scatter (atomic slots: the order inside a list varies run to run).
Deterministic path: a stable sort, lists ascending.

Layout: ``offsets (B, H, sum_l (T_{l+1} + 1))`` int32 (level l's segment at ``CSC_OFF``, starting
at 0), ``rows (B, H, sum_l T_{l+1} K_{l+1})`` int32 (level l's segment at ``SEL_OFF``, like the
selection itself).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..masks import csr_to_csc
from .common import launcher
from .layout import CSC_OFF, SEL_OFF, Levels, cdiv

_BE = 1024


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


def selection_csc(sel: torch.Tensor, levels: Levels, deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(offsets, rows)`` of every level's CSC from a packed selection ``(B, H, S)`` int32."""
    bsz, heads, _ = sel.shape
    offsets = sel.new_zeros(bsz, heads, levels.csc_size)
    rows = torch.empty_like(sel)
    segments = []
    for level in range(levels.levels):
        keys, topk = levels.tokens(level + 1), levels.topk[level]
        sel_off, csc_off = levels.rows[level][SEL_OFF], levels.rows[level][CSC_OFF]
        segments.append((keys, topk, sel_off, csc_off))
    if deterministic:
        for keys, topk, sel_off, csc_off in segments:
            part = sel[:, :, sel_off:sel_off + keys * topk].reshape(bsz, heads, keys, topk)
            csc = csr_to_csc(part, keys)
            offsets[:, :, csc_off:csc_off + keys + 1] = csc.offsets
            rows[:, :, sel_off:sel_off + keys * topk] = csc.rows
        return offsets, rows
    for keys, topk, sel_off, csc_off in segments:
        launcher(_count_kernel)[(cdiv(keys * topk, _BE), bsz * heads)](
            sel, offsets, levels.selection_size, levels.csc_size, sel_off, csc_off, keys * topk, BE=_BE)
    for keys, topk, sel_off, csc_off in segments:
        segment = slice(csc_off, csc_off + keys + 1)
        offsets[:, :, segment] = offsets[:, :, segment].cumsum(-1, dtype=torch.int32)
    cursor = offsets.clone()
    for keys, topk, sel_off, csc_off in segments:
        launcher(_scatter_kernel)[(cdiv(keys * topk, _BE), bsz * heads)](
            sel, cursor, rows, levels.selection_size, levels.csc_size, sel_off, csc_off, keys * topk, topk, BE=_BE)
    return offsets, rows
