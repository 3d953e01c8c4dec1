"""Hierarchical top-K selection of LLSA in Triton.

Top level: dense raw-dot scores of pooled q against all pooled k tokens. Each finer level: the
children of the parent's selection only (``K_{l+1} * b`` candidates per query token, O(N)).
Scores are fp32 (no TF32); ties go to the smallest key id; rows are stored ascending. The result
equals ``flexsparse.masks.hierarchical_topk`` on the same pyramids.

Candidates stream through in chunks; a running top-K of each row is merged with every chunk by K
passes of "largest value, then smallest id".
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import KV_OFF, SEL_OFF, T, TOPK, launcher, mm
from .layout import Levels, cdiv, pow2

@triton.jit
def _take_best(v, i):
    """Largest value of each row and, among equal values, the smallest id (empty slots: id 2^31 - 1)."""
    best = tl.max(v, axis=1)
    return best, tl.min(tl.where(v == best[:, None], i, 2147483647), axis=1)


@triton.jit
def merge_topk(best_v, best_i, cv, ci, KSEL: tl.constexpr, KP2: tl.constexpr):
    """One streaming step of a per-row top-K: the ``KSEL`` best of a running top-K ``(best_v, best_i)``
    ``(R, KP2)`` and a chunk of candidates ``(cv, ci)`` ``(R, C)``, ordered by largest value, then smallest
    id (K passes). Empty slots and masked candidates hold ``(-inf, 2^31 - 1)``. Returns the new running
    top-K ``(R, KP2)``, best first."""
    slot = tl.arange(0, KP2)
    new_v = tl.zeros_like(best_v) + float("-inf")
    new_i = tl.zeros_like(best_i) + 2147483647
    for r in range(KSEL):
        v1, i1 = _take_best(best_v, best_i)
        v2, i2 = _take_best(cv, ci)
        first = (v1 > v2) | ((v1 == v2) & (i1 < i2))
        new_v = tl.where(slot[None, :] == r, tl.where(first, v1, v2)[:, None], new_v)
        new_i = tl.where(slot[None, :] == r, tl.where(first, i1, i2)[:, None], new_i)
        gone = first[:, None] & (best_i == i1[:, None])
        best_v = tl.where(gone, float("-inf"), best_v)
        best_i = tl.where(gone, 2147483647, best_i)
        gone = (~first)[:, None] & (ci == i2[:, None])
        cv = tl.where(gone, float("-inf"), cv)
        ci = tl.where(gone, 2147483647, ci)
    return new_v, new_i


@triton.jit
def _select_kernel(QP, KP, SEL, META, qp_b, qp_h, kp_b, kp_h, H, GROUP, S_TOTAL, LEVEL,
                   D: tl.constexpr, BD: tl.constexpr, BLOCK: tl.constexpr, BQ: tl.constexpr,
                   BC: tl.constexpr, KSEL: tl.constexpr, KP2: tl.constexpr, DENSE: tl.constexpr):
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh - b * H
    hk = h // GROUP
    tokens = tl.load(META + LEVEL * 6 + T)
    off = tl.load(META + LEVEL * 6 + KV_OFF)
    out_off = tl.load(META + (LEVEL - 1) * 6 + SEL_OFF)
    sel = SEL + bh.to(tl.int64) * S_TOTAL
    j = tl.arange(0, BQ)
    if DENSE:
        rows = pid * BQ + j
        row_ok = rows < tokens
        n_cand = tokens
    else:
        rows = pid * BLOCK + j
        row_ok = (j < BLOCK) & (rows < tokens)
        parent_k = tl.load(META + LEVEL * 6 + TOPK)
        parents = sel + tl.load(META + LEVEL * 6 + SEL_OFF) + pid * parent_k
        n_cand = parent_k * BLOCK
    dim = tl.arange(0, BD)
    q_base = QP + b.to(tl.int64) * qp_b + h.to(tl.int64) * qp_h
    k_base = KP + b.to(tl.int64) * kp_b + hk.to(tl.int64) * kp_h
    q = tl.load(q_base + (off + rows).to(tl.int64)[:, None] * D + dim[None, :],
                mask=row_ok[:, None] & (dim[None, :] < D), other=0.0)
    slot = tl.arange(0, KP2)
    best_v = tl.full([BQ, KP2], float("-inf"), tl.float32)
    best_i = tl.full([BQ, KP2], 2147483647, tl.int32)
    for c in range(0, n_cand, BC):
        e = c + tl.arange(0, BC)
        e_ok = e < n_cand
        if DENSE:
            cand = e
        else:
            cand = tl.load(parents + e // BLOCK, mask=e_ok, other=0) * BLOCK + e % BLOCK
        c_ok = e_ok & (cand < tokens)
        k = tl.load(k_base + (off + cand).to(tl.int64)[:, None] * D + dim[None, :],
                    mask=c_ok[:, None] & (dim[None, :] < D), other=0.0)
        cv = tl.where(c_ok[None, :], mm(q, tl.trans(k), True), float("-inf"))
        ci = tl.where(c_ok, cand, 2147483647)[None, :] + tl.zeros([BQ, BC], tl.int32)
        best_v, best_i = merge_topk(best_v, best_i, cv, ci, KSEL, KP2)
    ids = tl.sort(best_i, dim=1)
    out = sel + out_off + rows[:, None] * KSEL + slot[None, :]
    tl.store(out, ids, mask=row_ok[:, None] & (slot[None, :] < KSEL))


def hierarchical_topk(q_pyr: torch.Tensor, k_pyr: torch.Tensor, levels: Levels) -> torch.Tensor:
    """Packed selection ``(B, H, sum_l T_l * K_l)`` int32 from pooled pyramids.

    q_pyr: ``(B, H, T_1 + ... + T_L, D)``, k_pyr: ``(B, Hk, ..., D)``, both fp32 and contiguous.
    """
    bsz, heads, _, d = q_pyr.shape
    sel = q_pyr.new_empty(bsz, heads, levels.selection_size, dtype=torch.int32)
    meta = levels.meta(q_pyr)
    bd, block = pow2(d, 16), levels.block
    for level in range(levels.levels, 0, -1):
        dense = level == levels.levels
        topk = levels.topk[level - 1]
        if dense:
            bq, bc = 16, min(128, pow2(levels.tokens(level), 16))
            programs = cdiv(levels.tokens(level), bq)
        else:
            bq, bc = pow2(block, 16), min(128, pow2(levels.topk[level] * block, 16))
            programs = levels.tokens(level + 1)
        launcher(_select_kernel)[(programs, bsz * heads)](
            q_pyr, k_pyr, sel, meta, q_pyr.stride(0), q_pyr.stride(1), k_pyr.stride(0), k_pyr.stride(1),
            heads, heads // k_pyr.shape[1], levels.selection_size, level,
            D=d, BD=bd, BLOCK=block, BQ=bq, BC=bc, KSEL=topk, KP2=pow2(topk, 2), DENSE=dense)
    return sel
