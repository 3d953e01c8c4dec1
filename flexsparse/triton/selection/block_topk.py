"""Single-level block top-K in Triton (routers of ``sla``, ``sla2`` and ``topk``).

Scores are fp32 dots of pooled q ``(B, H, Tq, D)`` against pooled k ``(B, Hk, Tk, D)`` (GQA) with fp32
accuracy: three-pass TF32 tensor-core products (``tf32x3``), as LLSA's selection. A row's order is (largest
score, then smallest key id); the top set is the first ``topk`` of that order and the optional bottom set the
last ``bottomk``, so they never overlap. Output rows are ascending. Given the same fp32 scores the selection
equals a stable descending sort bit for bit (``naive.sorted_block_topk``; NaN counts as the largest value, as
in ``torch.sort``).

Small calls take one kernel, ``_scored_select_kernel``: 16 query rows per program scored against every key in
registers as in 1. below, then selected as in 2. (one launch and no scratch instead of two launches). Small: at most
``FUSED_TILE`` key elements per program (the keys and the head dim, each padded to a power of two), and
``FUSED_SCORES`` scores per call (``topk_tiles``; up to 16K tokens in 64-blocks at D = 64, where an eager call is
bound by its host time). Measured on an H200 in two runs (``do_bench``, GPU us, one kernel against two; host us per
call 31-65 against 52-99): B1 H1 Tq = Tk = 64 D64 10-33 against 27-65, B2 H8 at 64 / 128 / 256 keys 30-42 against
70-88 (Tq = 32, Tk = 64: 34-42 against 26-71), B1 H24 at 256 keys 49 against 74, D128 at 64 and 128 keys 39-40
against 69-73; over the bounds it loses or ties (B2 H16 Tk 256 D128 115-118 against 49-99, B4 H24 Tk 256 D64 98-99
against 64-107, B2 H8 Tk 512 77-78 against 79-83).

Other rows, up to ``ROW_LIMIT`` keys, take two kernels per row chunk of at most ``SCRATCH`` scores (32 MB, so that
the second kernel reads the scores from L2 rather than HBM; whole rows, at least one row per head):

1. ``_scores_kernel``: ``BM x BN`` tiles of ``q k^T`` by ``tl.dot(input_precision="tf32x3")`` over ``BK``-wide
   slices of D (each operand split into a TF32 head and a TF32 remainder, three products; the error is that of
   an fp32 FMA dot: on an H100 at Tq = Tk = 1024, D = 64 the largest deviation from fp64 was 1.5e-5 against
   2.0e-5 for IEEE fp32 FMAs, and 0.048 ms against 0.174 ms), stored to an fp32 scratch ``(B H, rows, Tk)``.
   Products of values with few mantissa bits (the tests' grid values) are exact, so every summation order
   gives the same scores there.
2. ``_select_kernel``: one program (``Tk / 1024`` warps, at least 1) per row, the row in registers (32 keys
   per lane), selected by ``common.bisect.first_k_rows``. The scores become int32 keys with the order of the floats
   (``-0.0`` as ``+0.0``, NaN on top);
   the ``topk``-th largest key is found exactly by a bisection over ``[min, max]`` (one count of
   ``key >= mid`` per pass) that stops as soon as a count is exactly ``topk``. The first 24 passes split at
   the halfway *value* (when its key lies inside the interval), later ones at the halfway key: on scores
   spread around zero halfway keys waste ~6 passes on exponents (simulated on normal rows of 1024 keys,
   K = 51: 14.4 passes by keys, 9.2 by values; 32 + 24 at most). Then the ties at the threshold are taken by id
   (first ones for top, last ones for bottom; only when some ties are left out, the cut found by a bisection over
   the columns) and a prefix sum compacts the row in id order. The bottom set is the same search read as ``~key``
   (reversed compares on the same registers). A pass costs 32 compares per lane and a warp reduction (plus one
   shared-memory round when a row spans several warps, Tk > 1024); 96-128 registers at Tk = 1024 (sm_90).

Measured (H100, B H = 16, D = 64): scores 0.048 ms at Tq = Tk = 1024 and 0.162 ms at 2048 (IEEE fp32 FMA dots:
0.174 / 0.664 ms); the selection ~0.1 ms at 1024 (K = 51).

Rows longer than ``ROW_LIMIT`` keys (more than 16 warps of 32 keys per lane) stream through in chunks with
the K-pass merge of ``merge_topk`` (slow for large K).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.bisect import INT_MIN, first_k_rows, ordered_key, store_taken
from .._runtime.registry import launcher
from .._runtime.sizes import cdiv, pow2
from .._runtime.tiles import with_overrides

ROW_LIMIT = 16384
SCRATCH = 1 << 23  # fp32 scores per launch pair (32 MB: meant to stay in L2 between the two kernels)
_KEYS_PER_WARP = 1024
_STREAM_ROWS, _STREAM_CHUNK = 16, 128


@triton.jit
def _scores_kernel(Q, K, S, H, GROUP, TQ, TK, ROW0, ROWS,
                   D: tl.constexpr, BK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """Scores of query rows ``[ROW0, ROW0 + ROWS)`` into ``S (B H, ROWS, TK)`` fp32; q ``(B, H, TQ, D)``,
    k ``(B, Hk, TK, D)`` contiguous, any float dtype, converted to fp32; D in ``BK``-wide slices, tf32x3."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    bh = tl.program_id(2)
    kv = (bh // H) * (H // GROUP) + (bh % H) // GROUP
    rows = pid_m * BM + tl.arange(0, BM)
    row_ok = rows < ROWS
    cols = pid_n * BN + tl.arange(0, BN)
    col_ok = cols < TK
    q_ptr = Q + bh.to(tl.int64) * TQ * D + (ROW0 + rows).to(tl.int64)[:, None] * D
    k_ptr = K + kv.to(tl.int64) * TK * D + cols.to(tl.int64)[:, None] * D
    s = tl.zeros([BM, BN], tl.float32)
    for d0 in range(0, D, BK):
        dim = d0 + tl.arange(0, BK)
        q = tl.load(q_ptr + dim[None, :], mask=row_ok[:, None] & (dim[None, :] < D), other=0.0).to(tl.float32)
        k = tl.load(k_ptr + dim[None, :], mask=col_ok[:, None] & (dim[None, :] < D), other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k), s, input_precision="tf32x3")
    tl.store(S + (bh.to(tl.int64) * ROWS + rows)[:, None] * TK + cols[None, :], s,
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _store_selection(key, out_rows, row_ok, TOP, BOTTOM, TK, KTOP, KBOT, BT: tl.constexpr,
                     HAS_BOTTOM: tl.constexpr):
    """Top (and bottom) ids of the rows of ``key (R, BT)`` (ordered keys, ``INT_MIN`` past ``TK``) into rows
    ``out_rows (R,)`` of ``TOP (B H TQ, KTOP)`` (``BOTTOM (B H TQ, KBOT)``), rows where ``row_ok``."""
    cols = tl.arange(0, BT)
    ok = row_ok[:, None]
    store_taken(TOP + out_rows * KTOP, first_k_rows(key, KTOP, BT - TK, False) & ok, cols)
    if HAS_BOTTOM:
        store_taken(BOTTOM + out_rows * KBOT, first_k_rows(key, KBOT, BT - TK, True) & ok, cols)


@triton.jit
def _select_kernel(S, TOP, BOTTOM, TQ, TK, ROW0, ROWS, KTOP, KBOT, BT: tl.constexpr, HAS_BOTTOM: tl.constexpr):
    """Top (and bottom) ids of score row ``program_id(0)`` of ``S (B H, ROWS, TK)`` into row ``ROW0 + r``
    of ``TOP (B H, TQ, KTOP)`` (``BOTTOM (B H, TQ, KBOT)``)."""
    r = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    cols = tl.arange(0, BT)
    valid = cols < TK
    key = tl.where(valid, ordered_key(tl.load(S + (bh * ROWS + r) * TK + cols, mask=valid, other=0.0)), INT_MIN)
    out_row = tl.zeros([1], tl.int64) + bh * TQ + ROW0 + r
    _store_selection(key[None, :], out_row, tl.full([1], True, tl.int1), TOP, BOTTOM, TK, KTOP, KBOT, BT, HAS_BOTTOM)


@triton.jit
def _scored_select_kernel(Q, K, TOP, BOTTOM, H, GROUP, TQ, TK, KTOP, KBOT, D: tl.constexpr, BK: tl.constexpr,
                          BM: tl.constexpr, BT: tl.constexpr, HAS_BOTTOM: tl.constexpr):
    """``_scores_kernel`` and ``_select_kernel`` in one pass for rows of at most ``BT`` keys: ``BM`` query rows
    of head ``program_id(1)`` scored against every key in registers, then selected. The scores are computed here,
    not in a helper shared with ``_scores_kernel``: torch's write analysis takes a helper's results as derived from
    its pointer operands, and the selection's store addresses derive from the scores (q and k would count as
    written)."""
    bh = tl.program_id(1)
    kv = (bh // H) * (H // GROUP) + (bh % H) // GROUP
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    row_ok = rows < TQ
    cols = tl.arange(0, BT)
    col_ok = cols < TK
    q_ptr = Q + bh.to(tl.int64) * TQ * D + rows.to(tl.int64)[:, None] * D
    k_ptr = K + kv.to(tl.int64) * TK * D + cols.to(tl.int64)[:, None] * D
    s = tl.zeros([BM, BT], tl.float32)
    for d0 in range(0, D, BK):
        dim = d0 + tl.arange(0, BK)
        q = tl.load(q_ptr + dim[None, :], mask=row_ok[:, None] & (dim[None, :] < D), other=0.0).to(tl.float32)
        k = tl.load(k_ptr + dim[None, :], mask=col_ok[:, None] & (dim[None, :] < D), other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k), s, input_precision="tf32x3")
    key = tl.where(col_ok[None, :], ordered_key(s), INT_MIN)
    _store_selection(key, bh.to(tl.int64) * TQ + rows, row_ok, TOP, BOTTOM, TK, KTOP, KBOT, BT, HAS_BOTTOM)


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
def _scores(q_base, kt_base, rows, row_ok, cols, col_ok, TK, D: tl.constexpr):
    """fp32 dots ``(len(rows), len(cols))`` of q rows ``(Tq, D)`` and key columns of ``k^T`` ``(D, Tk)``."""
    s = tl.zeros([rows.shape[0], cols.shape[0]], tl.float32)
    for d in range(D):
        qd = tl.load(q_base + rows * D + d, mask=row_ok, other=0.0)
        kd = tl.load(kt_base + d * TK + cols, mask=col_ok, other=0.0)
        s += qd[:, None] * kd[None, :]
    return s


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


def topk_tiles(tk: int) -> dict:
    """Launch sizes for rows of ``tk`` keys: score tiles ``BM x BN`` (D in ``BK`` slices) on ``WARPS`` warps and
    ``STAGES`` pipeline stages, ``SELECT_WARPS`` per row; calls of at most ``FUSED_TILE`` key elements (keys times
    head dim, padded) and ``FUSED_SCORES`` scores score and select in one kernel, ``FUSED_ROWS`` rows
    per program on ``FUSED_WARPS`` warps (module docstring; overrides: kind ``block_topk`` of ``tiles``)."""
    bt = pow2(tk, 16)
    return with_overrides("block_topk", {"BM": 64, "BN": 64, "BK": 64, "WARPS": 4, "STAGES": 3,
                                         "SELECT_WARPS": max(1, min(16, bt // _KEYS_PER_WARP)),
                                         "FUSED_TILE": 256 * 64, "FUSED_SCORES": 1 << 21, "FUSED_ROWS": 16,
                                         "FUSED_WARPS": 4})


def select_scores(scores: torch.Tensor, top: torch.Tensor, bottom: torch.Tensor, row0: int = 0,
                  warps: int | None = None) -> None:
    """Write the top / bottom ids of score rows ``scores (B H, R, Tk)`` fp32 contiguous into rows
    ``[row0, row0 + R)`` of ``top (B, H, Tq, topk)`` and ``bottom (B, H, Tq, bottomk)`` (int32 contiguous;
    ``bottom`` may be empty). ``1 <= topk``, ``topk + bottomk <= Tk``."""
    bh, rows, tk = scores.shape
    topk, bottomk = top.shape[-1], bottom.shape[-1]
    bt = pow2(tk, 16)
    warps = warps or topk_tiles(tk)["SELECT_WARPS"]
    launcher(_select_kernel)[(rows, bh)](
        scores, top, bottom if bottomk else scores, top.shape[2], tk, row0, rows, topk, bottomk,
        BT=bt, HAS_BOTTOM=bottomk > 0, num_warps=warps)


def block_topk(q_pooled: torch.Tensor, k_pooled: torch.Tensor, topk: int, bottomk: int,
               row_limit: int = ROW_LIMIT, scratch: int = SCRATCH) -> tuple[torch.Tensor, torch.Tensor]:
    """``(top (B, H, Tq, topk), bottom (B, H, Tq, bottomk))`` int32 ascending, from pooled q ``(B, H, Tq, D)``
    and k ``(B, Hk, Tk, D)`` (fp16 / bf16 / fp32; scored in fp32). ``1 <= topk``, ``topk + bottomk <= Tk``.
    Rows longer than ``row_limit`` keys take the streaming kernel, small calls (``topk_tiles``' ``FUSED_TILE``,
    ``FUSED_SCORES``) the fused one; others go through an fp32 score scratch of at most ``scratch`` elements (whole
    rows, at least one row per head)."""
    bsz, heads, tq, d = q_pooled.shape
    kv_heads, tk = k_pooled.shape[1], k_pooled.shape[2]
    top = q_pooled.new_empty(bsz, heads, tq, topk, dtype=torch.int32)
    bottom = q_pooled.new_empty(bsz, heads, tq, bottomk, dtype=torch.int32)
    group = heads // kv_heads
    if pow2(tk, 16) > row_limit:
        qp = q_pooled.to(torch.float32).contiguous()
        kt = k_pooled.to(torch.float32).transpose(-1, -2).contiguous()
        launcher(_stream_topk_kernel)[(cdiv(tq, _STREAM_ROWS), bsz * heads)](
            qp, kt, top, bottom if bottomk else qp, heads, group, tq, tk, D=d, BQ=_STREAM_ROWS,
            BC=_STREAM_CHUNK, KTOP=topk, KBOT=bottomk, KP2=pow2(topk, 2), KBP2=pow2(bottomk, 2))
        return top, bottom
    qp, kp = q_pooled.contiguous(), k_pooled.contiguous()
    tiles = topk_tiles(tk)
    bk = min(tiles["BK"], pow2(d, 16))
    bt = pow2(tk, 16)
    if bt * pow2(d, 16) <= tiles["FUSED_TILE"] and bsz * heads * tq * bt <= tiles["FUSED_SCORES"]:
        launcher(_scored_select_kernel)[(cdiv(tq, tiles["FUSED_ROWS"]), bsz * heads)](
            qp, kp, top, bottom if bottomk else qp, heads, group, tq, tk, topk, bottomk, D=d, BK=bk,
            BM=tiles["FUSED_ROWS"], BT=bt, HAS_BOTTOM=bottomk > 0, num_warps=tiles["FUSED_WARPS"])
        return top, bottom
    chunk = min(tq, max(1, scratch // (bsz * heads * tk)))
    for row0 in range(0, tq, chunk):
        rows = min(chunk, tq - row0)
        scores = qp.new_empty(bsz * heads, rows, tk, dtype=torch.float32)  # a fresh buffer, never a view
        launcher(_scores_kernel)[(cdiv(rows, tiles["BM"]), cdiv(tk, tiles["BN"]), bsz * heads)](
            qp, kp, scores, heads, group, tq, tk, row0, rows, D=d, BK=bk, BM=tiles["BM"],
            BN=tiles["BN"], num_warps=tiles["WARPS"], num_stages=tiles["STAGES"])
        select_scores(scores, top, bottom, row0, tiles["SELECT_WARPS"])
    return top, bottom
