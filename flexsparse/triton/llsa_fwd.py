"""LLSA forward: one online softmax over the fine level, the enriched coarse levels and the top level.

Two kernels share the softmax state through O and LSE:

1. ``_coarse_fwd_kernel``, query tiles of ``BM`` rows (many query blocks): levels 1..L-1 (the
   children of ``S_{l+1}`` of the rows' ancestor, shared by every query block under it, so big
   tiles waste nothing once ``b^{l+1} >= BM``) and every level-L token, each level-l token with
   logit bias ``ln(count)``. It stores the normalised partial output and its LSE (log2 units).
2. ``_fine_fwd_kernel``, one query block per program: starts from that partial state (running max
   = partial LSE, running sum 1, accumulator = partial output), adds the ``K_1 * b`` fine keys of
   ``S_1`` and stores the final output and natural-log LSE. Its matrix products have ``b`` rows
   (``mma.sync`` on Hopper). A transposed form (keys x queries, wgmma with N = b) needs a transposed
   shared-memory A operand, which triton 3.6 miscompiles (out-of-bounds wgmma reads on an H200).

Everything runs in the log2 domain (``SCALE2 = scale * log2(e)``); padding logits are -inf.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import (KV_OFF, LN2, LOG2E, SEL_OFF, SPAN, T, TOPK, coarse_level_keys, launcher, load_rows, log2_count,
                     mm, softmax_step, sparse_keys)
from .layout import Levels, cdiv, pow2
from .tiles import overrides


@triton.jit
def _coarse_fwd_kernel(Q, KC, VC, SEL, META, O, LSE, q_b, q_h, q_n, c_b, c_h, o_b, o_h, o_n,
                       H, GROUP, N, LEVELS, S_TOTAL,
                       D: tl.constexpr, BD: tl.constexpr, BLOCK: tl.constexpr, SCALE2: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, IEEE: tl.constexpr):
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh - b * H
    hk = h // GROUP
    kc = KC + b.to(tl.int64) * c_b + hk.to(tl.int64) * c_h
    vc = VC + b.to(tl.int64) * c_b + hk.to(tl.int64) * c_h
    sel = SEL + bh.to(tl.int64) * S_TOTAL
    start = pid * BM
    rows = start + tl.arange(0, BM)
    row_ok = rows < N
    dim = tl.arange(0, BD)
    q = load_rows(Q + b.to(tl.int64) * q_b + h.to(tl.int64) * q_h, rows, q_n, dim, row_ok, D)
    m = tl.full([BM], float("-inf"), tl.float32)
    l = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, BD], tl.float32)
    for level in range(1, LEVELS):
        tokens, off, topk, span, n_keys, first_row, row_group = coarse_level_keys(META, level, sel, start, rows, N,
                                                                                 BM, BLOCK)
        for c in range(0, n_keys, BN):
            g, tok, ok = sparse_keys(first_row, c + tl.arange(0, BN), n_keys, topk, BLOCK)
            ok = ok & (tok < tokens)
            k = load_rows(kc, off + tok, D, dim, ok, D).to(q.dtype)
            v = load_rows(vc, off + tok, D, dim, ok, D).to(q.dtype)
            s = mm(q, tl.trans(k), IEEE) * SCALE2 + log2_count(tok, span, N)[None, :]
            s = tl.where(ok[None, :] & (row_group[:, None] == g[None, :]), s, float("-inf"))
            m, l, acc = softmax_step(s, v, m, l, acc, IEEE)
    tokens = tl.load(META + LEVELS * 6 + T)
    off = tl.load(META + LEVELS * 6 + KV_OFF)
    span = tl.load(META + LEVELS * 6 + SPAN)
    for c in range(0, tokens, BN):
        tok = c + tl.arange(0, BN)
        ok = tok < tokens
        k = load_rows(kc, off + tok, D, dim, ok, D).to(q.dtype)
        v = load_rows(vc, off + tok, D, dim, ok, D).to(q.dtype)
        s = mm(q, tl.trans(k), IEEE) * SCALE2 + log2_count(tok, span, N)[None, :]
        s = tl.where(ok[None, :], s, float("-inf"))
        m, l, acc = softmax_step(s, v, m, l, acc, IEEE)
    o = O + b.to(tl.int64) * o_b + h.to(tl.int64) * o_h
    ptr = o + rows.to(tl.int64)[:, None] * o_n + dim[None, :]
    tl.store(ptr, (acc / l[:, None]).to(O.dtype.element_ty), mask=row_ok[:, None] & (dim[None, :] < D))
    tl.store(LSE + bh.to(tl.int64) * N + rows, m + tl.log2(l), mask=row_ok)


@triton.jit
def _fine_fwd_kernel(Q, K, V, SEL, META, O, LSE, q_b, q_h, q_n, k_b, k_h, k_n, o_b, o_h, o_n,
                     H, GROUP, N, S_TOTAL,
                     D: tl.constexpr, BD: tl.constexpr, BLOCK: tl.constexpr, SCALE2: tl.constexpr,
                     FQ: tl.constexpr, FN: tl.constexpr, SUB: tl.constexpr, SINGLE: tl.constexpr,
                     IEEE: tl.constexpr):
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh - b * H
    hk = h // GROUP
    kb = K + b.to(tl.int64) * k_b + hk.to(tl.int64) * k_h
    vb = V + b.to(tl.int64) * k_b + hk.to(tl.int64) * k_h
    qb = Q + b.to(tl.int64) * q_b + h.to(tl.int64) * q_h
    o = O + b.to(tl.int64) * o_b + h.to(tl.int64) * o_h
    lse = LSE + bh.to(tl.int64) * N
    sel = SEL + bh.to(tl.int64) * S_TOTAL + tl.load(META + SEL_OFF)
    topk = tl.load(META + TOPK)
    dim = tl.arange(0, BD)
    for sub in range(SUB):  # with SINGLE the innermost loop: the next rows' gathers overlap this math
        start = (pid * SUB + sub) * FQ
        rows = start + tl.arange(0, FQ)
        row_ok = rows < N
        q = load_rows(qb, rows, q_n, dim, row_ok, D)
        acc = load_rows(o, rows, o_n, dim, row_ok, D).to(tl.float32)
        m = tl.load(lse + rows, mask=row_ok, other=0.0)
        l = tl.full([FQ], 1.0, tl.float32)
        qb0 = start // BLOCK
        n_keys = ((tl.minimum(start + FQ, N) - 1) // BLOCK - qb0 + 1) * topk * BLOCK
        row_block = rows // BLOCK - qb0
        if SINGLE:
            g, tok, ok = sparse_keys(sel + qb0 * topk, tl.arange(0, FN), n_keys, topk, BLOCK)
            ok = ok & (tok < N)
            s = mm(q, tl.trans(load_rows(kb, tok, k_n, dim, ok, D)), IEEE) * SCALE2
            s = tl.where(ok[None, :] & (row_block[:, None] == g[None, :]), s, float("-inf"))
            m, l, acc = softmax_step(s, load_rows(vb, tok, k_n, dim, ok, D), m, l, acc, IEEE)
        else:
            for c in range(0, n_keys, FN):
                g, tok, ok = sparse_keys(sel + qb0 * topk, c + tl.arange(0, FN), n_keys, topk, BLOCK)
                ok = ok & (tok < N)
                s = mm(q, tl.trans(load_rows(kb, tok, k_n, dim, ok, D)), IEEE) * SCALE2
                s = tl.where(ok[None, :] & (row_block[:, None] == g[None, :]), s, float("-inf"))
                m, l, acc = softmax_step(s, load_rows(vb, tok, k_n, dim, ok, D), m, l, acc, IEEE)
        ptr = o + rows.to(tl.int64)[:, None] * o_n + dim[None, :]
        tl.store(ptr, (acc / l[:, None]).to(O.dtype.element_ty), mask=row_ok[:, None] & (dim[None, :] < D))
        tl.store(lse + rows, (m + tl.log2(l)) * LN2, mask=row_ok)


def fine_keys(block: int, topk: int, fq: int) -> int:
    """Most fine keys a ``fq``-row query tile can see: ``K_1 * b`` per query block it touches."""
    blocks = fq // block if fq % block == 0 else fq // block + 2
    return blocks * topk * block


def forward_tiles(device: torch.device, d: int, block: int) -> dict:
    """Tile sizes of the two forward kernels (see module docstring), with ``tiles.overrides("fwd")``."""
    fq = pow2(block, 16)
    if device.type == "cpu":
        base = dict(BM=max(32, fq), BN=32, FQ=fq, FN=64, SUB=2, warps=4, stages=1, fine_warps=4, fine_stages=1)
    else:
        base = dict(BM=max(128, fq), BN=64 if d <= 64 else 32, FQ=fq, FN=256, SUB=8, warps=8, stages=2,
                    fine_warps=4, fine_stages=2 if d > 64 else 3)
    return {**base, **overrides("fwd")}


def llsa_forward(q, k, v, kc, vc, sel, levels: Levels, scale: float, tiles: dict | None = None):
    """O ``(B, H, N, D)`` in q's dtype and natural-log LSE ``(B, H, N)`` fp32.

    q: ``(B, H, N, D)``; k, v: ``(B, Hk, N, D)`` (same strides); kc, vc: pooled levels 1..L
    ``(B, Hk, T_1 + ... + T_L, D)`` contiguous; sel: packed selection ``(B, H, S)`` int32.
    """
    bsz, heads, n, d = q.shape
    tiles = tiles or forward_tiles(q.device, d, levels.block)
    o = torch.empty_like(q)
    lse = q.new_empty(bsz, heads, n, dtype=torch.float32)
    meta = levels.meta(q)
    common = dict(D=d, BD=pow2(d, 16), BLOCK=levels.block, SCALE2=float(scale * LOG2E.value),
                  IEEE=q.dtype == torch.float32)
    group = heads // k.shape[1]
    launcher(_coarse_fwd_kernel)[(cdiv(n, tiles["BM"]), bsz * heads)](
        q, kc, vc, sel, meta, o, lse, q.stride(0), q.stride(1), q.stride(2), kc.stride(0), kc.stride(1),
        o.stride(0), o.stride(1), o.stride(2), heads, group, n, levels.levels, levels.selection_size,
        BM=tiles["BM"], BN=tiles["BN"], num_warps=tiles["warps"], num_stages=tiles["stages"], **common)
    keys = fine_keys(levels.block, levels.topk[0], tiles["FQ"])
    fn = min(tiles["FN"], pow2(keys, 16))
    launcher(_fine_fwd_kernel)[(cdiv(cdiv(n, tiles["FQ"]), tiles["SUB"]), bsz * heads)](
        q, k, v, sel, meta, o, lse, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        o.stride(0), o.stride(1), o.stride(2), heads, group, n, levels.selection_size,
        FQ=tiles["FQ"], FN=fn, SUB=tiles["SUB"], SINGLE=keys <= fn, num_warps=tiles["fine_warps"],
        num_stages=tiles["fine_stages"], **common)
    return o, lse
