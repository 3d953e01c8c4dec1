"""Single-level block top-K in Triton (routers of ``sla``, ``sla2`` and ``topk``).

Scores are raw dots of pooled q ``(B, H, Tq, D)`` against pooled k ``(B, Hk, Tk, D)`` (GQA) in fp32 FMAs
(no TF32). A row's order is (largest score, then smallest key id); the top set is the first ``topk`` of
that order and the optional bottom set the last ``bottomk``, so they never overlap. Output rows are
ascending. The result equals ``flexsparse.masks.block_topk`` (exactly wherever the scores are exact).

Rows of up to ``ROW_LIMIT`` keys stay in registers: the ``topk``-th largest score of each row is found
exactly by bisection over the ordered int32 bit patterns of the fp32 scores (32 counting passes, whatever
K), then the row is compacted in id order (prefix sums), ties at the threshold taken by id. Longer rows
stream through in chunks with the K-pass merge of ``select.merge_topk``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import launcher
from .layout import cdiv, pow2
from .select import merge_topk

ROW_LIMIT = 4096
_ROW_SCORES = 8192  # scores per program of the in-register kernel (32 per thread at 8 warps)
_STREAM_ROWS, _STREAM_CHUNK = 16, 128


@triton.jit
def _scores(q_base, kt_base, rows, row_ok, cols, col_ok, TK, D: tl.constexpr):
    """fp32 dots ``(len(rows), len(cols))`` of q rows ``(Tq, D)`` and key columns of ``k^T`` ``(D, Tk)``."""
    s = tl.zeros([rows.shape[0], cols.shape[0]], tl.float32)
    for d in range(D):
        qd = tl.load(q_base + rows * D + d, mask=row_ok, other=0.0)
        kd = tl.load(kt_base + d * TK + cols, mask=col_ok, other=0.0)
        s += qd[:, None] * kd[None, :]
    return s


@triton.jit
def _ordered(x):
    """int32 keys with the order of the fp32 values ``x`` (``-0.0`` as ``+0.0``)."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(x == 0, 0, bits ^ ((bits >> 31) & 0x7FFFFFFF))


@triton.jit
def _first_k(key, valid, count, LAST_TIES: tl.constexpr):
    """Mask of the ``count`` largest ``key`` of each row among ``valid``; ties at the threshold go to the
    smallest columns (the largest with ``LAST_TIES``). key, valid: ``(R, C)``; ``1 <= count <= valid``."""
    lo = tl.min(tl.where(valid, key, 2147483647), axis=1).to(tl.int64)
    hi = tl.max(tl.where(valid, key, -2147483648), axis=1).to(tl.int64)
    for _ in range(32):  # invariant: at least count keys >= lo, fewer than count keys > hi
        mid = lo + (hi - lo + 1) // 2
        enough = tl.sum((valid & (key >= mid.to(tl.int32)[:, None])).to(tl.int32), axis=1) >= count
        lo = tl.where(enough, mid, lo)
        hi = tl.where(enough, hi, mid - 1)
    threshold = lo.to(tl.int32)[:, None]
    above = valid & (key > threshold)
    ties = valid & (key == threshold)
    need = count - tl.sum(above.to(tl.int32), axis=1)
    seen = tl.cumsum(ties.to(tl.int32), axis=1)
    if LAST_TIES:
        rank = tl.sum(ties.to(tl.int32), axis=1)[:, None] - seen
    else:
        rank = seen - 1
    return above | (ties & (rank < need[:, None]))


@triton.jit
def _store_columns(out, taken, cols, row_ok, count):
    """Columns of ``taken`` ``(R, C)`` into ``out`` rows of ``count`` ids, ascending."""
    slot = tl.cumsum(taken.to(tl.int32), axis=1) - 1
    rows = tl.arange(0, taken.shape[0])
    tl.store(out + rows[:, None] * count + slot, cols[None, :] + tl.zeros_like(slot),
             mask=taken & row_ok[:, None])


@triton.jit
def _row_topk_kernel(QP, KT, TOP, BOTTOM, H, GROUP, TQ, TK, KTOP, KBOT,
                     D: tl.constexpr, BQ: tl.constexpr, BT: tl.constexpr, HAS_BOTTOM: tl.constexpr):
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    kv = (bh // H) * (H // GROUP) + (bh % H) // GROUP
    rows = pid * BQ + tl.arange(0, BQ)
    row_ok = rows < TQ
    cols = tl.arange(0, BT)
    col_ok = cols < TK
    s = _scores(QP + bh.to(tl.int64) * TQ * D, KT + kv.to(tl.int64) * D * TK, rows, row_ok, cols, col_ok, TK, D)
    key = _ordered(s)
    valid = col_ok[None, :] & (rows >= 0)[:, None]
    first_row = bh.to(tl.int64) * TQ + pid * BQ
    _store_columns(TOP + first_row * KTOP, _first_k(key, valid, KTOP, False), cols, row_ok, KTOP)
    if HAS_BOTTOM:
        _store_columns(BOTTOM + first_row * KBOT, _first_k(~key, valid, KBOT, True), cols, row_ok, KBOT)


@triton.jit
def _stream_topk_kernel(QP, KT, TOP, BOTTOM, H, GROUP, TQ, TK,
                        D: tl.constexpr, BQ: tl.constexpr, BC: tl.constexpr, KTOP: tl.constexpr,
                        KBOT: tl.constexpr, KP2: tl.constexpr, KBP2: tl.constexpr):
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    kv = (bh // H) * (H // GROUP) + (bh % H) // GROUP
    rows = pid * BQ + tl.arange(0, BQ)
    row_ok = rows < TQ
    q_base = QP + bh.to(tl.int64) * TQ * D
    kt_base = KT + kv.to(tl.int64) * D * TK
    top_v = tl.full([BQ, KP2], float("-inf"), tl.float32)
    top_i = tl.full([BQ, KP2], 2147483647, tl.int32)
    bot_v = tl.full([BQ, KBP2], float("-inf"), tl.float32)
    bot_i = tl.full([BQ, KBP2], 2147483647, tl.int32)
    for c in range(0, TK, BC):
        cols = c + tl.arange(0, BC)
        col_ok = cols < TK
        s = _scores(q_base, kt_base, rows, row_ok, cols, col_ok, TK, D)
        empty = tl.zeros([BQ, BC], tl.int32) + 2147483647
        top_v, top_i = merge_topk(top_v, top_i, tl.where(col_ok[None, :], s, float("-inf")),
                                  tl.where(col_ok[None, :], cols[None, :], empty), KTOP, KP2)
        if KBOT > 0:  # the bottom set is the top set of (-score, -id)
            bot_v, bot_i = merge_topk(bot_v, bot_i, tl.where(col_ok[None, :], -s, float("-inf")),
                                      tl.where(col_ok[None, :], TK - 1 - cols[None, :], empty), KBOT, KBP2)
    first_row = bh.to(tl.int64) * TQ + pid * BQ
    slot = tl.arange(0, KP2)
    tl.store(TOP + (first_row + tl.arange(0, BQ))[:, None] * KTOP + slot[None, :], tl.sort(top_i, dim=1),
             mask=row_ok[:, None] & (slot[None, :] < KTOP))
    if KBOT > 0:
        slot = tl.arange(0, KBP2)
        ids = tl.sort(tl.where(slot[None, :] < KBOT, TK - 1 - bot_i, 2147483647), dim=1)
        tl.store(BOTTOM + (first_row + tl.arange(0, BQ))[:, None] * KBOT + slot[None, :], ids,
                 mask=row_ok[:, None] & (slot[None, :] < KBOT))


def row_tiles(tk: int) -> tuple[int, int, int]:
    """``(BT, BQ, num_warps)`` of the in-register kernel for rows of ``tk`` keys (``BQ`` rows of ``BT`` columns)."""
    bt = pow2(tk, 16)
    bq = max(1, min(16, _ROW_SCORES // bt))
    return bt, bq, 8 if bq * bt >= _ROW_SCORES else 4


def block_topk(q_pooled: torch.Tensor, k_pooled: torch.Tensor, topk: int, bottomk: int,
               row_limit: int = ROW_LIMIT) -> tuple[torch.Tensor, torch.Tensor]:
    """``(top (B, H, Tq, topk), bottom (B, H, Tq, bottomk))`` int32 ascending, from pooled q ``(B, H, Tq, D)``
    and k ``(B, Hk, Tk, D)`` (any float dtype; scored in fp32). ``1 <= topk``, ``topk + bottomk <= Tk``.
    Rows longer than ``row_limit`` keys take the streaming kernel."""
    bsz, heads, tq, d = q_pooled.shape
    kv_heads, tk = k_pooled.shape[1], k_pooled.shape[2]
    qp = q_pooled.to(torch.float32).contiguous()
    kt = k_pooled.to(torch.float32).transpose(-1, -2).contiguous()
    top = qp.new_empty(bsz, heads, tq, topk, dtype=torch.int32)
    bottom = qp.new_empty(bsz, heads, tq, bottomk, dtype=torch.int32)
    bottom_arg = bottom if bottomk else top  # never written then (no null pointer for the kernel)
    group = heads // kv_heads
    if pow2(tk, 16) <= row_limit:
        bt, bq, warps = row_tiles(tk)
        launcher(_row_topk_kernel)[(cdiv(tq, bq), bsz * heads)](
            qp, kt, top, bottom_arg, heads, group, tq, tk, topk, bottomk,
            D=d, BQ=bq, BT=bt, HAS_BOTTOM=bottomk > 0, num_warps=warps)
    else:
        launcher(_stream_topk_kernel)[(cdiv(tq, _STREAM_ROWS), bsz * heads)](
            qp, kt, top, bottom_arg, heads, group, tq, tk, D=d, BQ=_STREAM_ROWS, BC=_STREAM_CHUNK, KTOP=topk,
            KBOT=bottomk, KP2=pow2(topk, 2), KBP2=pow2(bottomk, 2))
    return top, bottom
