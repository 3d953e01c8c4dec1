"""Hierarchical top-K selection of LLSA in Triton.

One kernel per level. Top level: each program scores 16 pooled query tokens against every token of the level
(IEEE fp32 dots; levels of more than ``DENSE_ROW_LIMIT`` tokens take the single-level ``block_topk``). Each
finer level: one program per parent token scores its ``b`` children against the children of the parent's
selection only (``K_{l+1} * b`` candidates per query token, O(N)), with three-pass TF32 tensor-core dots
(``tf32x3``, fp32 accuracy; an IEEE fp32 FMA dot took 150 of this kernel's 250 us at N=65536 on an H100). Rows
are selected all at once by bisection (``bisect.first_k_rows``); ties go to the smallest key id (candidates are
laid out in id order: the parent's selection is ascending); rows are stored ascending. The result equals
``flexsparse.masks.hierarchical_topk`` on the same pyramids (exactly where the products are exact, as on the
tests' grid values).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .bisect import INT_MIN, first_k_rows, ordered_key, store_taken
from .block_topk import block_topk
from .common import KV_OFF, SEL_OFF, T, TOPK, launcher
from . import layout
from .layout import Levels, cdiv, pow2


@triton.jit
def _select_kernel(QP, KP, SEL, META, qp_b, qp_h, kp_b, kp_h, H, GROUP, S_TOTAL, LEVEL,
                   D: tl.constexpr, BD: tl.constexpr, BLOCK: tl.constexpr, BQ: tl.constexpr,
                   BC: tl.constexpr, KSEL: tl.constexpr, DENSE: tl.constexpr, SCAN: tl.constexpr):
    """``S_LEVEL`` rows: with ``DENSE`` (the top level) query tokens ``pid * BQ ...`` against every token of the
    level (IEEE fp32 dots); else the ``BLOCK`` query tokens under parent ``program_id(0)`` (level LEVEL+1)
    against the children of ``S_{LEVEL+1}[parent]`` (tf32x3 dots). The top ``KSEL`` of each row, ascending;
    ``SCAN``: ties cut by a prefix sum (``bisect.first_k_rows``'s ``TIES_BY_SCAN``)."""
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh - b * H
    hk = h // GROUP
    tokens = tl.load(META + LEVEL * 6 + T)
    off = tl.load(META + LEVEL * 6 + KV_OFF)
    sel = SEL + bh.to(tl.int64) * S_TOTAL
    j = tl.arange(0, BQ)
    e = tl.arange(0, BC)
    if DENSE:
        rows = pid * BQ + j
        row_ok = rows < tokens
        cand = e
        c_ok = e < tokens
    else:
        rows = pid * BLOCK + j
        row_ok = (j < BLOCK) & (rows < tokens)
        parent_k = tl.load(META + LEVEL * 6 + TOPK)
        parents = sel + tl.load(META + LEVEL * 6 + SEL_OFF) + pid * parent_k
        e_ok = e < parent_k * BLOCK
        cand = tl.load(parents + e // BLOCK, mask=e_ok, other=0) * BLOCK + e % BLOCK
        c_ok = e_ok & (cand < tokens)
    dim = tl.arange(0, BD)
    q_base = QP + b.to(tl.int64) * qp_b + h.to(tl.int64) * qp_h
    k_base = KP + b.to(tl.int64) * kp_b + hk.to(tl.int64) * kp_h
    q = tl.load(q_base + (off + rows).to(tl.int64)[:, None] * D + dim[None, :],
                mask=row_ok[:, None] & (dim[None, :] < D), other=0.0)
    k = tl.load(k_base + (off + cand).to(tl.int64)[:, None] * D + dim[None, :],
                mask=c_ok[:, None] & (dim[None, :] < D), other=0.0)
    if DENSE:
        scores = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        scores = tl.dot(q, tl.trans(k), input_precision="tf32x3")
    key = tl.where(c_ok[None, :], ordered_key(scores), INT_MIN)
    taken = first_k_rows(key, KSEL, 0, False, SCAN) & row_ok[:, None]
    out_rows = sel + tl.load(META + (LEVEL - 1) * 6 + SEL_OFF) + rows.to(tl.int64) * KSEL
    store_taken(out_rows, taken, cand)


DENSE_ROW_LIMIT = 1024  # top levels with more tokens go through block_topk (rows of up to 16K keys)
SCAN_LIMIT = 256  # rows of at most this many candidates cut ties by a prefix sum (0.167 vs 0.188 ms at 128, H100);
# wider ones by bisection (a prefix sum at 512 columns made block top-K ~35x slower: docs/triton_llsa.md)


def hierarchical_topk(q_pyr: torch.Tensor, k_pyr: torch.Tensor, levels: Levels,
                      row_limit: int = DENSE_ROW_LIMIT) -> torch.Tensor:
    """Packed selection ``(B, H, sum_l T_l * K_l)`` int32 from pooled pyramids.

    q_pyr: ``(B, H, T_1 + ... + T_L, D)``, k_pyr: ``(B, Hk, ..., D)``, both fp32 and contiguous. A top level
    of more than ``row_limit`` tokens goes through ``block_topk``.
    """
    bsz, heads, _, d = q_pyr.shape
    sel = q_pyr.new_empty(bsz, heads, levels.selection_size, dtype=torch.int32)
    meta = levels.meta(q_pyr)
    top, block = levels.levels, levels.block
    launch = dict(D=d, BD=pow2(d, 16), BLOCK=block, BQ=16)
    args = (q_pyr, k_pyr, sel, meta, q_pyr.stride(0), q_pyr.stride(1), k_pyr.stride(0), k_pyr.stride(1),
            heads, heads // k_pyr.shape[1], levels.selection_size)
    if levels.tokens(top) <= row_limit:
        bc = pow2(levels.tokens(top), 16)
        launcher(_select_kernel)[(cdiv(levels.tokens(top), 16), bsz * heads)](
            *args, top, BC=bc, KSEL=levels.topk[-1], DENSE=True, SCAN=bc <= SCAN_LIMIT,
            num_warps=4 if bc * d <= 256 * 64 else 8, **launch)
    else:
        q_top, k_top = levels.split_pyramid(q_pyr)[-1], levels.split_pyramid(k_pyr)[-1]
        start, count = levels.rows[top - 1][layout.SEL_OFF], levels.tokens(top) * levels.topk[-1]
        sel[:, :, start:start + count] = block_topk(q_top, k_top, levels.topk[-1], 0)[0].flatten(2)
    for level in range(top - 1, 0, -1):
        bc = pow2(levels.topk[level] * block, 16)
        launcher(_select_kernel)[(levels.tokens(level + 1), bsz * heads)](
            *args, level, BC=bc, KSEL=levels.topk[level - 1], DENSE=False, SCAN=bc <= SCAN_LIMIT,
            num_warps=4 if bc * d <= 128 * 64 else 8,
            **{**launch, "BQ": pow2(block, 16)})
    return sel
