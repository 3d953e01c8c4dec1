"""LLSA backward.

dQ, query-major, in two kernels: ``_coarse_dq_kernel`` (the forward's tiles and key lists over levels 1..L, also
stores ``Delta = rowsum(O * dO) - dLSE``) then ``_fine_dq_kernel`` (adds the fine level; batched like the fine part
of the fused forward, ``_fine_dq_ragged_kernel`` for the other N and b). Or, with the tile option ``fuse_dq`` (the
default at head dims over 64) where the fine level runs batched, in one: ``_fused_dq_kernel``, the forward's fused
tiles, dQ stored once.

dK/dV, with no dense mask and no loop over all queries below the top level:

* ``_fine_dkv_kernel`` for level 0 where the fine level runs batched (``fwd.batched_blocks``; tile option
  ``batched_dkv``): one key block per warp walks its CSC list of ``S_1`` one query block per step (batched
  ``b x b`` products), the list ids read ``dkv_slots`` at a time into registers, so the pipelined gathers of Q and
  dO wait on no index load; it adds the pooled levels' gradients like the kernel below.
* ``entry_dkv.entry_dkv`` for a coarse level l < L whose partial sums are small (``entry_memory``; with
  ``b = 16``, ``K = 8``: levels 2 and up): ancestor-major, each query row read once per key chunk (H100, B2 H8
  N262144 L3 D64 fwd+bwd 13.54-14.42 ms from level 2, 13.19-13.24 with every coarse level on it, 15.16-15.26 with
  none; level 1's partials would take as many bytes as k and v).
* ``_sparse_dkv_kernel`` for the other levels l < L (level 0 where the fine level is not batched): one program
  per level-(l+1) token p owns its ``b`` children at level l and walks the CSC list of ``S_{l+1}`` (the
  level-(l+1) query tokens that selected p); each entry stands for ``b^{l+1}`` consecutive fine queries
  (``_dkv_t_step``: queries and the head dim are the wgmma M dims), walked entry by entry when the steps divide
  the entries (``ENTRY_MAJOR``: no index load per step; H100, whole backward B2 H8 N262144 L3 D64 11.35-11.37 ms
  against 11.50-11.55 stepping over the list's rows, N16384 0.592 against 0.601). Levels with few parents split
  every list over programs and sum the partials.
  For l = 0 it can also add the gradients of the pooled levels (``dK^(l)[n // b^l] / count``), which is
  the backward of the pooling pyramid.
* ``_top_dkv_kernel`` for level L: dense, one program per key chunk, query head and query range; the partial
  sums (ranges, and the query heads of a KV head) are added in a fixed order (deterministic).

GQA: a key-major dK/dV program loops over the query heads of its KV head (the ancestor-major and top-level ones
sum them with their partials), so no atomics are needed. Probabilities are recomputed from the saved LSE; every
level-l logit carries its ``ln(count)`` bias, so coarse gradients get their weights.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...masks import levels as level_columns
from .._runtime.registry import launcher
from ..common.jit import (CSC_OFF, KV_OFF, LOG2E, SEL_OFF, SPAN, T, TOPK, backward_rows, dkv_rows, load_rows, load_slab,
                          load_tile, log2_count, mm, program_heads, sparse_keys, store_rows, store_slab)
from .._runtime.sizes import cdiv, pow2
from ...masks.levels import Levels
from .entry_dkv import entry_dkv, entry_scratch
from .fwd import (HOIST_RUNS, batched_blocks, coarse_bases, coarse_keys, coarse_keys_from_runs, coarse_launch,
                  coarse_rows, fine_bases, fine_ids, fine_launch, fine_tokens, fused_launch, hoisting, listed_runs,
                  step_blocks)
from .._runtime.tiles import with_overrides


@triton.jit
def _dq_step(s, lse2, do, delta, k, v, dq, IEEE: tl.constexpr):
    """``dq += dS @ K`` (unscaled) for log2 logits ``s (BM, BN)`` (-inf where a key is not attended); or batched:
    ``s (W, BM, BN)``, ``k, v (W, BN, BD)``."""
    p = tl.exp2(s - tl.expand_dims(lse2, -1))
    ds = p * (mm(do, tl.trans(v), IEEE) - tl.expand_dims(delta, -1))
    return dq + mm(ds.to(k.dtype), k, IEEE)


@triton.jit
def coarse_dq(Q, O, DO, LSE, DLSE, DELTA, kc, vc, lst, LOG2C, q_head, o_head, do_head, bh, rows, row_ok, q_n, o_n,
              do_n, N, TOP_OFF, TOP_T, D: tl.constexpr, BD: tl.constexpr, N_SPARSE: tl.constexpr, SCALE2: tl.constexpr,
              BM: tl.constexpr, BN: tl.constexpr, EVEN: tl.constexpr, STAGES: tl.constexpr, HAS_DLSE: tl.constexpr,
              IEEE: tl.constexpr, HOIST: tl.constexpr, BLOCK: tl.constexpr, RUNS: tl.constexpr):
    """The coarse levels' dQ (unscaled, ``(BM, BD)`` fp32) of query rows ``rows`` of one head (its q, o, dO at
    offsets ``q_head``, ``o_head``, ``do_head``, row strides ``q_n``, ``o_n``, ``do_n``), over the ancestor's key
    list ``lst`` and the top level; stores ``Delta`` of those rows. Returns ``(q, do, lse2, delta, dq)`` for the fine
    level. Its only stores are ``Delta``'s, at addresses from ``bh`` and ``rows``."""
    dim = tl.arange(0, BD)
    q = load_rows(Q + q_head, rows, q_n, dim, row_ok, D)
    do = load_rows(DO + do_head, rows, do_n, dim, row_ok, D)
    delta = tl.sum(load_rows(O + o_head, rows, o_n, dim, row_ok, D).to(tl.float32) * do.to(tl.float32), axis=1)
    if HAS_DLSE:
        delta -= tl.load(DLSE + bh.to(tl.int64) * N + rows, mask=row_ok, other=0.0)
    tl.store(DELTA + bh.to(tl.int64) * N + rows, delta, mask=row_ok)
    lse2 = tl.load(LSE + bh.to(tl.int64) * N + rows, mask=row_ok, other=0.0) * LOG2E
    dq = tl.zeros([BM, BD], tl.float32)
    n_total = N_SPARSE + TOP_T
    # the forward's chunk loading, written out: a helper shared with the forward ran 3-4 % slower
    # (docs/triton_llsa.md)
    if HOIST:
        starts, run_bias, top_bias = listed_runs(lst, LOG2C, TOP_OFF, N_SPARSE, BLOCK, RUNS)
    for c in tl.range(0, n_total, BN, num_stages=STAGES):
        if HOIST:
            key_rows, bias = coarse_keys_from_runs(starts, run_bias, top_bias, c, BN, N_SPARSE, BLOCK, RUNS, TOP_OFF)
        else:
            key_rows, bias = coarse_keys(lst, LOG2C, c, BN, N_SPARSE, n_total, TOP_OFF, EVEN)  # -inf bias: p = 0
        k = load_tile(kc, key_rows, D, dim, key_rows >= 0, D, BD, not EVEN).to(q.dtype)
        v = load_tile(vc, key_rows, D, dim, key_rows >= 0, D, BD, not EVEN).to(q.dtype)
        if EVEN:
            s = mm(q, tl.trans(k), IEEE) * SCALE2 + bias
        else:
            s = mm(q, tl.trans(k), IEEE) * SCALE2 + bias[None, :]
        dq = _dq_step(s, lse2, do, delta, k, v, dq, IEEE)
    return q, do, lse2, delta, dq


@triton.jit
def _coarse_dq_kernel(Q, KC, VC, LIST, LOG2C, O, DO, LSE, DLSE, DELTA, DQ, q_b, q_h, q_n, o_b, o_h, o_n, do_b, do_h,
                      do_n, c_b, c_h, l_bh, H, GROUP, N, TOP_OFF, TOP_T,
                      D: tl.constexpr, BD: tl.constexpr, BLOCK: tl.constexpr, TB: tl.constexpr,
                      N_SPARSE: tl.constexpr, SCALE2: tl.constexpr, SCALE: tl.constexpr, BM: tl.constexpr,
                      BN: tl.constexpr, EVEN: tl.constexpr, STAGES: tl.constexpr, HAS_DLSE: tl.constexpr,
                      HOIST: tl.constexpr, RUNS: tl.constexpr, IEEE: tl.constexpr):
    bh, b, h = program_heads(H)
    kc, vc, lst = coarse_bases(KC, VC, LIST, b, h, bh, c_b, c_h, l_bh, GROUP, TB, BLOCK, N_SPARSE)
    local = tl.arange(0, BM)
    rows = tl.program_id(0) * TB * BLOCK + local
    row_ok = (local < TB * BLOCK) & (rows < N)
    b64, h64 = b.to(tl.int64), h.to(tl.int64)
    dq = coarse_dq(Q, O, DO, LSE, DLSE, DELTA, kc, vc, lst, LOG2C, b64 * q_b + h64 * q_h, b64 * o_b + h64 * o_h,
                   b64 * do_b + h64 * do_h, bh, rows, row_ok, q_n, o_n, do_n, N, TOP_OFF, TOP_T, D, BD, N_SPARSE,
                   SCALE2, BM, BN, EVEN, STAGES, HAS_DLSE, IEEE, HOIST, BLOCK, RUNS)[4]
    store_rows(DQ + bh.to(tl.int64) * N * D, dq * SCALE, rows, D, tl.arange(0, BD), row_ok, D)


@triton.jit
def _fused_dq_kernel(Q, K, V, KC, VC, LIST, LOG2C, SEL, META, O, DO, LSE, DLSE, DELTA, DQ, q_b, q_h, q_n, o_b, o_h,
                     o_n, do_b, do_h, do_n, k_b, k_h, k_n, v_b, v_h, v_n, c_b, c_h, l_bh, H, GROUP, N,
                     TOP_OFF, TOP_T, S_TOTAL,
                     D: tl.constexpr, BD: tl.constexpr, BLOCK: tl.constexpr, TB: tl.constexpr,
                     N_SPARSE: tl.constexpr, SCALE2: tl.constexpr, SCALE: tl.constexpr, BM: tl.constexpr,
                     BN: tl.constexpr, EVEN: tl.constexpr, STAGES: tl.constexpr, WN: tl.constexpr,
                     KEYS: tl.constexpr, W_STAGES: tl.constexpr, HAS_DLSE: tl.constexpr, HOIST: tl.constexpr,
                     RUNS: tl.constexpr, TOPK1P: tl.constexpr, IEEE: tl.constexpr):
    """The whole dQ of a tile of ``TB`` query blocks (``fwd._fused_fwd_kernel``'s tiles): ``_coarse_dq_kernel``
    on ``TB * b`` rows, then, reshaped to ``(TB, b, ...)``, the fine level's batched steps; dQ is stored once."""
    bh, b, h = program_heads(H)
    kc, vc, lst = coarse_bases(KC, VC, LIST, b, h, bh, c_b, c_h, l_bh, GROUP, TB, BLOCK, N_SPARSE)
    rows = tl.program_id(0) * BM + tl.arange(0, BM)  # BM = TB * b
    b64, h64 = b.to(tl.int64), h.to(tl.int64)
    q, do, lse2, delta, dq = coarse_dq(Q, O, DO, LSE, DLSE, DELTA, kc, vc, lst, LOG2C, b64 * q_b + h64 * q_h,
                                       b64 * o_b + h64 * o_h, b64 * do_b + h64 * do_h, bh, rows, rows < N, q_n, o_n,
                                       do_n, N, TOP_OFF, TOP_T, D, BD, N_SPARSE, SCALE2, BM, BN, EVEN, STAGES,
                                       HAS_DLSE, IEEE, HOIST, BLOCK, RUNS)
    real, blk, rows = step_blocks(tl.program_id(0), 0, N // BLOCK, TB, 1, BLOCK)
    q = tl.reshape(q, (TB, BLOCK, BD))
    do = tl.reshape(do, (TB, BLOCK, BD))
    lse2 = tl.reshape(lse2, (TB, BLOCK))
    delta = tl.reshape(delta, (TB, BLOCK))
    dq = tl.reshape(dq, (TB, BLOCK, BD))
    dim = tl.arange(0, BD)
    kb, vb, sel = fine_bases(K, V, SEL, META, b, h, bh, k_b, k_h, v_b, v_h, GROUP, S_TOTAL)
    ids = fine_ids(sel, blk, KEYS // BLOCK, TOPK1P, HOIST)
    for c in tl.range(0, KEYS, WN, num_stages=W_STAGES):
        tok = fine_tokens(sel, blk, ids, c, WN, BLOCK, KEYS // BLOCK, TOPK1P, HOIST)
        k = load_slab(kb, tok, k_n, dim, D, BD)
        dq = _dq_step(mm(q, tl.trans(k), IEEE) * SCALE2, lse2, do, delta, k, load_slab(vb, tok, v_n, dim, D, BD), dq,
                      IEEE)
    store_slab(DQ + bh.to(tl.int64) * N * D, dq * SCALE, rows, D, dim, real[:, None], D, BD, True)


@triton.jit
def _fine_dq_kernel(Q, K, V, SEL, META, DO, LSE, DELTA, DQ, q_b, q_h, q_n, do_b, do_h, do_n, k_b, k_h, k_n, v_b, v_h,
                    v_n, H, GROUP, N, S_TOTAL,
                    D: tl.constexpr, BD: tl.constexpr, BLOCK: tl.constexpr, SCALE2: tl.constexpr,
                    SCALE: tl.constexpr, W: tl.constexpr, WN: tl.constexpr, WSUB: tl.constexpr,
                    KEYS: tl.constexpr, STAGES: tl.constexpr, FULL: tl.constexpr, HOIST: tl.constexpr,
                    TOPK1P: tl.constexpr, IEEE: tl.constexpr):
    """The fine level's dQ, batched like the fine part of ``fwd._fused_fwd_kernel`` (``W`` query blocks per
    step, one per warp), added to the coarse dQ in ``DQ``."""
    pid = tl.program_id(0)
    bh, b, h = program_heads(H)
    kb, vb, sel = fine_bases(K, V, SEL, META, b, h, bh, k_b, k_h, v_b, v_h, GROUP, S_TOTAL)
    b64, h64 = b.to(tl.int64), h.to(tl.int64)
    dim = tl.arange(0, BD)
    for sub in range(WSUB):
        real, blk, rows = step_blocks(pid, sub, N // BLOCK, W, WSUB, BLOCK)
        q = load_slab(Q + b64 * q_b + h64 * q_h, rows, q_n, dim, D, BD)
        do = load_slab(DO + b64 * do_b + h64 * do_h, rows, do_n, dim, D, BD)
        lse2 = tl.load(LSE + bh.to(tl.int64) * N + rows) * LOG2E
        delta = tl.load(DELTA + bh.to(tl.int64) * N + rows)
        dq = tl.zeros([W, BLOCK, BD], tl.float32)
        ids = fine_ids(sel, blk, KEYS // BLOCK, TOPK1P, HOIST)
        for c in tl.range(0, KEYS, WN, num_stages=STAGES):
            tok = fine_tokens(sel, blk, ids, c, WN, BLOCK, KEYS // BLOCK, TOPK1P, HOIST)
            k = load_slab(kb, tok, k_n, dim, D, BD)
            dq = _dq_step(mm(q, tl.trans(k), IEEE) * SCALE2, lse2, do, delta, k,
                          load_slab(vb, tok, v_n, dim, D, BD), dq, IEEE)
        dq = load_slab(DQ + bh.to(tl.int64) * N * D, rows, D, dim, D, BD).to(tl.float32) + dq * SCALE
        store_slab(DQ + bh.to(tl.int64) * N * D, dq, rows, D, dim, real[:, None], D, BD, not FULL)


@triton.jit
def _fine_dq_ragged_kernel(Q, K, V, SEL, META, DO, LSE, DELTA, DQ, q_b, q_h, q_n, do_b, do_h, do_n, k_b, k_h, k_n,
                           v_b, v_h, v_n, H, GROUP, N, S_TOTAL,
                           D: tl.constexpr, BD: tl.constexpr, BLOCK: tl.constexpr, SCALE2: tl.constexpr,
                           SCALE: tl.constexpr, FQ: tl.constexpr, FN: tl.constexpr, SUB: tl.constexpr,
                           IEEE: tl.constexpr):
    """The fine level's dQ for any N and b (``fwd._fine_fwd_ragged_kernel``'s steps)."""
    pid = tl.program_id(0)
    bh, b, h = program_heads(H)
    kb, vb, sel = fine_bases(K, V, SEL, META, b, h, bh, k_b, k_h, v_b, v_h, GROUP, S_TOTAL)
    b64, h64 = b.to(tl.int64), h.to(tl.int64)
    topk = tl.load(META + TOPK)
    dim = tl.arange(0, BD)
    for sub in range(SUB):
        start = (pid * SUB + sub) * FQ
        rows = start + tl.arange(0, FQ)
        row_ok = rows < N
        q = load_rows(Q + b64 * q_b + h64 * q_h, rows, q_n, dim, row_ok, D)
        do = load_rows(DO + b64 * do_b + h64 * do_h, rows, do_n, dim, row_ok, D)
        lse2 = tl.load(LSE + bh.to(tl.int64) * N + rows, mask=row_ok, other=0.0) * LOG2E
        delta = tl.load(DELTA + bh.to(tl.int64) * N + rows, mask=row_ok, other=0.0)
        dq = tl.zeros([FQ, BD], tl.float32)
        qb0 = start // BLOCK
        n_keys = ((tl.minimum(start + FQ, N) - 1) // BLOCK - qb0 + 1) * topk * BLOCK
        row_block = rows // BLOCK - qb0
        for c in range(0, n_keys, FN):
            g, tok, ok = sparse_keys(sel + qb0 * topk, c + tl.arange(0, FN), n_keys, topk, BLOCK)
            ok = ok & (tok < N)
            k = load_rows(kb, tok, k_n, dim, ok, D)
            s = mm(q, tl.trans(k), IEEE) * SCALE2
            s = tl.where(row_ok[:, None] & ok[None, :] & (row_block[:, None] == g[None, :]), s, float("-inf"))
            dq = _dq_step(s, lse2, do, delta, k, load_rows(vb, tok, v_n, dim, ok, D), dq, IEEE)
        dq = load_rows(DQ + bh.to(tl.int64) * N * D, rows, D, dim, row_ok, D).to(tl.float32) + dq * SCALE
        store_rows(DQ + bh.to(tl.int64) * N * D, dq, rows, D, dim, row_ok, D)


@triton.jit
def _dkv_t_step(q, do, lse2, delta, k, v, bias, dkt, dvt, SCALE2: tl.constexpr, IEEE: tl.constexpr):
    """Key-major update of ``dkt, dvt (BD, BK)`` = dK^T, dV^T (dK unscaled) for the few keys ``k, v (BK, BD)``
    with logit bias ``bias (BK,)`` from queries ``q, do (QR, BD)`` (rows past the end: zeros): ``S = Q K^T``
    ``(QR, BK)``, ``dV^T += dO^T P``, ``dK^T += Q^T dS``. The long dims (queries, head dim) are the matrix
    products' M, so a handful of keys still gets wgmma tiles; the transposed first operands are computed in
    registers (negated, then subtracted), never read as transposed shared-memory views (docs/triton_llsa.md)."""
    s = mm(q, tl.trans(k), IEEE) * SCALE2 + bias[None, :]
    p = tl.exp2(s - lse2[:, None])
    ds = p * (mm(do, tl.trans(v), IEEE) - delta[:, None])
    dvt -= mm(-tl.trans(do), p.to(do.dtype), IEEE)
    dkt -= mm(-tl.trans(q), ds.to(q.dtype), IEEE)
    return dkt, dvt


@triton.jit
def add_pooled_grads(dk, dv, pk, pv, tok, ok, META, N, LEVELS, dim, D: tl.constexpr):
    """``dk, dv (..., BD)`` of fine key tokens ``tok (...)`` plus the gradients of the pooled levels 1..LEVELS read
    at ``pk, pv`` (a KV head's pyramid rows, fp32, row stride D): ``dK^(l)[tok // b^l] / count``, the backward of the
    pooling pyramid. Rows where ``ok`` is False read zeros."""
    mask = tl.expand_dims(ok, -1) & (dim < D)
    for level in range(1, LEVELS + 1):
        span = tl.load(META + level * 6 + SPAN)
        up = tok // span
        inv = tl.expand_dims(1.0 / tl.maximum(tl.minimum(N - up * span, span), 1).to(tl.float32), -1)
        rows = tl.expand_dims((tl.load(META + level * 6 + KV_OFF) + up).to(tl.int64), -1) * D + dim
        dk += tl.load(pk + rows, mask=mask, other=0.0) * inv
        dv += tl.load(pv + rows, mask=mask, other=0.0) * inv
    return dk, dv


@triton.jit
def _dkv_t_rows(q_base, do_base, lse_base, delta_base, n, n_ok, q_n, do_n, dim, k, v, bias, dkt, dvt,
                D: tl.constexpr, SCALE2: tl.constexpr, IEEE: tl.constexpr):
    """``_dkv_t_step`` on query rows ``n`` (``n_ok``) of one head (``common.jit.backward_rows``' arguments)."""
    q, do, lse2, delta = backward_rows(q_base, do_base, lse_base, delta_base, n, n_ok, q_n, do_n, dim, D)
    return _dkv_t_step(q, do, lse2, delta, k, v, bias, dkt, dvt, SCALE2, IEEE)


@triton.jit
def _sparse_dkv_kernel(Q, K, V, KC, VC, DO, LSE, DELTA, OFFSETS, ROWS, META, DK, DV, DKC, DVC, PART_K, PART_V,
                       q_b, q_h, q_n, do_b, do_h, do_n, k_b, k_h, k_n, v_b, v_h, v_n, c_b, c_h, p_s,
                       p_b, p_h, part_off,
                       H, HK, GROUP, N, LEVELS, LEVEL, S_TOTAL, C_TOTAL, SPLITS,
                       D: tl.constexpr, BD: tl.constexpr, BLOCK: tl.constexpr, BK: tl.constexpr,
                       SCALE2: tl.constexpr, SCALE: tl.constexpr, QR: tl.constexpr, FINE: tl.constexpr,
                       ENTRY_MAJOR: tl.constexpr, FUSE_POOL: tl.constexpr, IEEE: tl.constexpr):
    parent = tl.program_id(0)
    split = tl.program_id(2)
    bhk, b, hk = program_heads(HK)
    tokens = tl.load(META + LEVEL * 6 + T)
    off = tl.load(META + LEVEL * 6 + KV_OFF)
    span = tl.load(META + LEVEL * 6 + SPAN)
    sel_off = tl.load(META + LEVEL * 6 + SEL_OFF)
    csc_off = tl.load(META + LEVEL * 6 + CSC_OFF)
    group = tl.minimum(span * BLOCK, N)  # queries under one level-(LEVEL+1) token: N where it is the only one
    child = tl.arange(0, BK)
    tok = parent * BLOCK + child
    k_ok = (child < BLOCK) & (tok < tokens)
    dim = tl.arange(0, BD)
    if FINE:
        kb = K + b.to(tl.int64) * k_b + hk.to(tl.int64) * k_h
        vb = V + b.to(tl.int64) * v_b + hk.to(tl.int64) * v_h
        key_rows = tok
        key_stride = k_n
        value_stride = v_n
    else:
        kb = KC + b.to(tl.int64) * c_b + hk.to(tl.int64) * c_h
        vb = VC + b.to(tl.int64) * c_b + hk.to(tl.int64) * c_h
        key_rows = off + tok
        key_stride = D
        value_stride = D
    k = load_rows(kb, key_rows, key_stride, dim, k_ok, D).to(Q.dtype.element_ty)
    v = load_rows(vb, key_rows, value_stride, dim, k_ok, D).to(Q.dtype.element_ty)
    bias = tl.where(k_ok, log2_count(tok, span, N), float("-inf"))
    dkt = tl.zeros([BD, BK], tl.float32)
    dvt = tl.zeros([BD, BK], tl.float32)
    for g in range(GROUP):
        bh = (b * H + hk * GROUP + g).to(tl.int64)
        h64 = (hk * GROUP + g).to(tl.int64)
        q_base = Q + b.to(tl.int64) * q_b + h64 * q_h
        do_base = DO + b.to(tl.int64) * do_b + h64 * do_h
        lo = tl.load(OFFSETS + bh * C_TOTAL + csc_off + parent)
        hi = tl.load(OFFSETS + bh * C_TOTAL + csc_off + parent + 1)
        per = tl.cdiv(hi - lo, SPLITS)  # this split's share of the list
        lo = lo + split * per
        entries = ROWS + bh * S_TOTAL + sel_off + lo
        n_entries = tl.maximum(tl.minimum(per, hi - lo), 0)
        if ENTRY_MAJOR:  # every step inside one entry: its first row loaded once, no index load per step
            for e in range(0, n_entries):
                first = tl.load(entries + e) * group
                for c in range(0, group, QR):
                    n = first + c + tl.arange(0, QR)
                    dkt, dvt = _dkv_t_rows(q_base, do_base, LSE + bh * N, DELTA + bh * N, n, n < N, q_n, do_n,
                                           dim, k, v, bias, dkt, dvt, D, SCALE2, IEEE)
        else:
            n_rows = n_entries * group
            for c in range(0, n_rows, QR):
                f = c + tl.arange(0, QR)
                entry = f // group
                n = tl.load(entries + entry, mask=f < n_rows, other=0) * group + (f - entry * group)
                dkt, dvt = _dkv_t_rows(q_base, do_base, LSE + bh * N, DELTA + bh * N, n, (f < n_rows) & (n < N),
                                       q_n, do_n, dim, k, v, bias, dkt, dvt, D, SCALE2, IEEE)
    dk = tl.trans(dkt) * SCALE
    dv = tl.trans(dvt)
    if FUSE_POOL:
        c_kv = b.to(tl.int64) * c_b + hk.to(tl.int64) * c_h
        dk, dv = add_pooled_grads(dk, dv, DKC + c_kv, DVC + c_kv, tok, k_ok, META, N, LEVELS, dim, D)
    if FINE:
        store_rows(DK + bhk.to(tl.int64) * N * D, dk, tok, D, dim, k_ok, D)
        store_rows(DV + bhk.to(tl.int64) * N * D, dv, tok, D, dim, k_ok, D)
    else:  # the pyramid's level rows (part_off = the level's offset), or a split's partial sums
        part = split.to(tl.int64) * p_s + b.to(tl.int64) * p_b + hk.to(tl.int64) * p_h
        store_rows(PART_K + part, dk, part_off + tok, D, dim, k_ok, D)
        store_rows(PART_V + part, dv, part_off + tok, D, dim, k_ok, D)


@triton.jit
def _fine_dkv_step(q, do, lse2, delta, k, v, dk, dv, SCALE2: tl.constexpr, IEEE: tl.constexpr):
    """Batched key-major update, one key block per warp: keys ``k, v (W, b, BD)``, one query block each ``q, do
    (W, b, BD)``, ``lse2, delta (W, b)`` (``lse2 = +inf``: a masked step, P = 0): ``dv += P^T dO``, ``dk += dS^T Q``
    (unscaled), on ``S^T (W, b, b)``."""
    p_t = tl.exp2(mm(k, tl.trans(q), IEEE) * SCALE2 - tl.expand_dims(lse2, 1))
    ds_t = p_t * (mm(v, tl.trans(do), IEEE) - tl.expand_dims(delta, 1))
    dv += mm(p_t.to(do.dtype), do, IEEE)
    dk += mm(ds_t.to(q.dtype), q, IEEE)
    return dk, dv


@triton.jit
def _fine_dkv_kernel(Q, K, V, DO, LSE, DELTA, OFFSETS, ROWS, META, DKC, DVC, DK, DV,
                     q_b, q_h, q_n, do_b, do_h, do_n, k_b, k_h, k_n, v_b, v_h, v_n, c_b, c_h, H, HK,
                     GROUP, N, LEVELS, S_TOTAL, C_TOTAL,
                     D: tl.constexpr, BD: tl.constexpr, BLOCK: tl.constexpr, SCALE2: tl.constexpr,
                     SCALE: tl.constexpr, W: tl.constexpr, SLOTS: tl.constexpr, STAGES: tl.constexpr,
                     FUSE_POOL: tl.constexpr, IEEE: tl.constexpr):
    """dK, dV of the fine level where it runs batched (``fwd.batched_blocks``): ``W`` key blocks per program,
    one per warp, each walking the CSC list of ``S_1`` (the query blocks that selected it) one query block per step
    (``_fine_dkv_step``); a program takes as many steps as its longest list, the shorter ones masked. A partial last
    program repeats the last block (not stored). With ``FUSE_POOL`` also adds the pooled levels' gradients."""
    bhk, b, hk = program_heads(HK)
    real, blk, tok = step_blocks(tl.program_id(0), 0, N // BLOCK, W, 1, BLOCK)
    dim = tl.arange(0, BD)
    k = load_slab(K + b.to(tl.int64) * k_b + hk.to(tl.int64) * k_h, tok, k_n, dim, D, BD)
    v = load_slab(V + b.to(tl.int64) * v_b + hk.to(tl.int64) * v_h, tok, v_n, dim, D, BD)
    csc = tl.load(META + CSC_OFF)
    sel = tl.load(META + SEL_OFF)
    local = tl.arange(0, BLOCK)
    slots = tl.arange(0, SLOTS)
    dk = tl.zeros([W, BLOCK, BD], tl.float32)
    dv = tl.zeros([W, BLOCK, BD], tl.float32)
    for g in range(GROUP):
        bh = (b * H + hk * GROUP + g).to(tl.int64)
        h64 = (hk * GROUP + g).to(tl.int64)
        q_base = Q + b.to(tl.int64) * q_b + h64 * q_h
        do_base = DO + b.to(tl.int64) * do_b + h64 * do_h
        lo = tl.load(OFFSETS + bh * C_TOTAL + csc + blk)
        count = tl.load(OFFSETS + bh * C_TOTAL + csc + blk + 1) - lo
        entries = ROWS + bh * S_TOTAL + sel + lo
        longest = tl.max(count, axis=0)
        for first in range(0, longest, SLOTS):  # the list ids SLOTS at a time, in registers: no index load per step
            ids = tl.load(entries[:, None] + (first + slots)[None, :], mask=(first + slots)[None, :] < count[:, None],
                          other=0)
            for step in tl.range(0, tl.minimum(longest - first, SLOTS), num_stages=STAGES):
                pick = tl.sum(tl.where(slots[None, :] == step, ids, 0), axis=1)
                rows = pick[:, None] * BLOCK + local[None, :]
                q = load_slab(q_base, rows, q_n, dim, D, BD)
                do = load_slab(do_base, rows, do_n, dim, D, BD)
                live = (first + step < count)[:, None]
                lse2 = tl.where(live, tl.load(LSE + bh * N + rows) * LOG2E, float("inf"))
                dk, dv = _fine_dkv_step(q, do, lse2, tl.load(DELTA + bh * N + rows), k, v, dk, dv, SCALE2, IEEE)
    dk = dk * SCALE
    if FUSE_POOL:
        c_kv = b.to(tl.int64) * c_b + hk.to(tl.int64) * c_h
        dk, dv = add_pooled_grads(dk, dv, DKC + c_kv, DVC + c_kv, tok, tok < N, META, N, LEVELS, dim, D)
    store_slab(DK + bhk.to(tl.int64) * N * D, dk, tok, D, dim, real[:, None], D, BD, True)
    store_slab(DV + bhk.to(tl.int64) * N * D, dv, tok, D, dim, real[:, None], D, BD, True)


@triton.jit
def _top_dkv_kernel(Q, KC, VC, DO, LSE, DELTA, META, PART_K, PART_V, q_b, q_h, q_n, do_b, do_h, do_n, c_b, c_h, p_s,
                    H, GROUP, N, LEVELS, QUERIES,
                    D: tl.constexpr, BD: tl.constexpr, TK: tl.constexpr, SCALE2: tl.constexpr,
                    SCALE: tl.constexpr, QR: tl.constexpr, IEEE: tl.constexpr):
    """dK, dV of the level-L tokens of chunk ``program_id(0)`` from the query rows of split ``program_id(2)`` of
    query head ``program_id(1)``: partial ``split * GROUP + g`` (g: the head's place in its KV group)."""
    chunk = tl.program_id(0)
    split = tl.program_id(2)
    bh, b, h = program_heads(H)
    hk = h // GROUP
    tokens = tl.load(META + LEVELS * 6 + T)
    off = tl.load(META + LEVELS * 6 + KV_OFF)
    span = tl.load(META + LEVELS * 6 + SPAN)
    tok = chunk * TK + tl.arange(0, TK)
    k_ok = tok < tokens
    dim = tl.arange(0, BD)
    kv = b.to(tl.int64) * c_b + hk.to(tl.int64) * c_h
    k = load_rows(KC + kv, off + tok, D, dim, k_ok, D).to(Q.dtype.element_ty)
    v = load_rows(VC + kv, off + tok, D, dim, k_ok, D).to(Q.dtype.element_ty)
    bias = tl.where(k_ok, log2_count(tok, span, N), float("-inf"))
    dk = tl.zeros([TK, BD], tl.float32)
    dv = tl.zeros([TK, BD], tl.float32)
    lo = split * QUERIES
    b64, h64 = b.to(tl.int64), h.to(tl.int64)
    dk, dv = dkv_rows(Q + b64 * q_b + h64 * q_h, DO + b64 * do_b + h64 * do_h, LSE + bh.to(tl.int64) * N,
                      DELTA + bh.to(tl.int64) * N, lo, tl.minimum(lo + QUERIES, N), q_n, do_n, dim, k, v, bias, dk, dv,
                      D, QR, SCALE2, IEEE)
    part = (split * GROUP + h - hk * GROUP).to(tl.int64) * p_s + kv
    store_rows(PART_K + part, dk * SCALE, off + tok, D, dim, k_ok, D)
    store_rows(PART_V + part, dv, off + tok, D, dim, k_ok, D)


def backward_tiles(device: torch.device, d: int, block: int, dtype: torch.dtype) -> dict:
    """Tile sizes of the backward kernels (see module docstring), with ``tiles.overrides("bwd")``;
    ``programs``: target grid of the top level; ``dkv_programs``: of the coarse sparse levels (lists split);
    ``fuse_dq``: dQ in ``_fused_dq_kernel`` (tiles of at most ``fused_BM`` rows on ``fused_warps`` warps, fine keys
    in chunks of ``fused_WN``) where the fine level runs batched, else the coarse and fine dQ kernels;
    ``dkv_coarse_stages``: pipeline stages of ``_sparse_dkv_kernel`` at the coarse levels; ``hoist_runs``,
    ``hoist_stages``: the coarse (or fused) dQ hoists its key rows as the forward does (``fwd.hoisting``), on
    that many stages; ``fine_hoist``: the batched fine dQ reads its blocks' ids once, on ``fine_hoist_stages``;
    ``batched_dkv``: level 0's dK/dV in ``_fine_dkv_kernel`` (``dkv_W`` key blocks per program, list ids ``dkv_slots``
    at a time, ``dkv_stages`` pipeline stages) where the fine level runs batched; ``entry_memory``: a coarse level's
    dK/dV runs ancestor-major (``entry_dkv``: keys in chunks of ``entry_TK``, ``entry_QR`` rows per step, at
    most ``entry_rows`` rows per program, ``entry_warps``, ``entry_stages``) where its partial sums take at most
    that many times the bytes of k and v, else key-major (``_sparse_dkv_kernel``)."""
    fq = pow2(block, 16)
    if device.type == "cpu":
        base = dict(fuse_dq=False, fused_BM=32, fused_warps=2, fused_WN=32, BM=max(32, fq), BN=32, W=2, WN=32,
                    WSUB=2, w_stages=1, FN=64, SUB=2, QR_FINE=32, QR=32, TK=32,
                    TOP_QR=32, warps=4, stages=1, fine_warps=4, fine_stages=1, dkv_warps=4, top_warps=4, top_stages=1,
                    programs=4, dkv_programs=4, dkv_coarse_stages=1, batched_dkv=True, dkv_W=2, dkv_slots=16,
                    dkv_stages=1, entry_memory=0.5, entry_TK=32, entry_QR=16, entry_rows=48, entry_warps=4,
                    entry_stages=1, hoist_runs=HOIST_RUNS, hoist_stages=1, fine_hoist=True, fine_hoist_stages=1)
    else:  # batched fine dQ: W=2, WN=16 measured best on an H200 (B2 H8 N65536 L2, D64 and D128). H100, whole
        # backward at B2 H8 N65536 L2 unless noted: the fused dQ at D128 6.06 ms against 6.35 with the two dQ kernels,
        # at D64 3.10 against 2.76 (its 64-row coarse tiles). Batched fine dK/dV: D64 2.49 ms against 2.74 key-major
        # per parent, D128 5.45 against 6.10 (dkv_W 2 or 4: 2.80 / 3.09 at D64; 16 slots or 2 stages: 2.50 / 2.61).
        # Top level and coarse dK/dV at D128: 4.55 ms with top_warps 4, TOP_QR 32, QR 128 against 5.42 with 8, 64, 64;
        # at D64 2.35 with TOP_QR 32 and 8 programs per SM against 2.43 with 64 and 4 (N262144 L3 11.58 against 11.56,
        # N16384 0.60 against 0.59). Coarse dK/dV at D64 on 64-row steps and 3 stages (its own key,
        # dkv_coarse_stages): 2.32 ms against 2.36-2.39 on 128-row steps and 2, N262144 L3 11.26 against 11.48-11.79,
        # N16384 0.577 against 0.597-0.602 (3 stages at D128: 4.81 against 4.57). Key rows hoisted (fwd's module
        # docstring), us per kernel at N65536: coarse dQ (D64, 3 stages) 405-406 against 423-428, fine dQ (3 stages)
        # 359-361 against 376-377, fused dQ (D128, 2 stages; 3: 2105) 1613-1616 against 1651
        wide = d > 64
        base = dict(fuse_dq=wide, fused_BM=64, fused_warps=4, fused_WN=32, BM=max(128, fq), BN=64, W=2, WN=16,
                    WSUB=1, w_stages=2, FN=256, SUB=8, QR_FINE=64,
                    QR=128 if wide else 64, TK=64, TOP_QR=32, warps=8, stages=2, fine_warps=4,
                    fine_stages=2 if wide else 3, dkv_warps=4, top_warps=4, top_stages=3,
                    programs=(4 if wide else 8) * 132, dkv_programs=16 * 132, dkv_coarse_stages=2 if wide else 3,
                    batched_dkv=True, dkv_W=1, dkv_slots=32, dkv_stages=3, entry_memory=0.5, entry_TK=64, entry_QR=32,
                    entry_rows=4096, entry_warps=4, entry_stages=3, hoist_runs=HOIST_RUNS,
                    hoist_stages=2 if wide else 3, fine_hoist=True, fine_hoist_stages=3)
        if dtype.itemsize > 2:  # fp32: chunks that fit shared memory (see fwd.forward_tiles)
            base.update(BM=max(64, fq), BN=32, FN=64, QR=64, fine_stages=2, warps=4, fused_WN=16, top_stages=2,
                        dkv_coarse_stages=2, dkv_stages=2, entry_stages=2, hoist_runs=0, fine_hoist=False)
    return with_overrides("bwd", base)


def llsa_backward(do, dlse, q, k, v, kc, vc, sel, offsets, rows, o, lse, levels: Levels, scale: float,
                  fuse_pool: bool, tiles: dict | None = None):
    """Gradients ``(dq, dk, dv, dkc, dvc)`` of the LLSA forward.

    Shapes as in ``llsa_forward``; do like q; q, k, v, o, do with contiguous rows, their other strides free (each
    its own); dlse ``(B, H, N)`` fp32 or None; offsets/rows: the CSC of ``sel`` (``csc.selection_csc``). dq, dk, dv
    are contiguous (autograd stacks them into a fused projection's gradient fastest that way), and the kernels
    address them so, with no stride arguments (dQ's strides, live across the coarse dQ's loop, took it from 128 to
    144 registers at L=3: one CTA per SM instead of two, 2.52 ms against 1.69 at B2 H8 N262144 D64 on an H100); dkc, dvc
    ``(B, Hk, T_1 + ... + T_L, D)`` fp32 are the gradients of the pooled levels; with ``fuse_pool`` dk, dv already
    include them (through the pooling).
    """
    bsz, heads, n, d = q.shape
    kv_heads, group = k.shape[1], heads // k.shape[1]
    tiles = tiles or backward_tiles(q.device, d, levels.block, q.dtype)
    meta = levels.meta(q)
    common = dict(D=d, BD=pow2(d, 16), SCALE2=float(scale * LOG2E.value), SCALE=float(scale),
                  IEEE=q.dtype == torch.float32)
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    delta = torch.empty_like(lse)
    key_list = coarse_rows(sel, levels)
    q_strides, c_strides = q.stride()[:3], (kc.stride(0), kc.stride(1))
    o_strides, do_strides = o.stride()[:3], do.stride()[:3]
    kv_strides = (*k.stride()[:3], *v.stride()[:3])
    list_stride = key_list.shape[2] * key_list.shape[3]
    if batched_blocks(levels) and tiles["fuse_dq"]:
        grid, fused = fused_launch(q, levels, tiles["fused_BM"], tiles["BN"], tiles["fused_WN"])
        coarse_loop = hoisting(levels, fused["EVEN"], tiles)
        launcher(_fused_dq_kernel)[grid](
            q, k, v, kc, vc, key_list, levels.log2_counts(q), sel, meta, o, do, lse,
            dlse if dlse is not None else lse, delta, dq, *q_strides, *o_strides, *do_strides,
            *kv_strides, *c_strides, list_stride, heads, group, n, S_TOTAL=levels.selection_size,
            W_STAGES=tiles["w_stages"], HAS_DLSE=dlse is not None, num_warps=tiles["fused_warps"],
            num_stages=coarse_loop["STAGES"], **coarse_loop, **fused, **common)
    else:
        grid, coarse = coarse_launch(q, levels, tiles["BM"], tiles["BN"])
        coarse_loop = hoisting(levels, coarse["EVEN"], tiles)
        launcher(_coarse_dq_kernel)[grid](
            q, kc, vc, key_list, levels.log2_counts(q), o, do, lse, dlse if dlse is not None else lse, delta, dq,
            *q_strides, *o_strides, *do_strides, *c_strides, list_stride, heads, group, n, HAS_DLSE=dlse is not None,
            num_warps=tiles["warps"], num_stages=coarse_loop["STAGES"], **coarse_loop, **coarse, **common)
        batched, programs, fine, options = fine_launch(levels, tiles)
        launcher(_fine_dq_kernel if batched else _fine_dq_ragged_kernel)[(programs, bsz * heads)](
            q, k, v, sel, meta, do, lse, delta, dq, *q_strides, *do_strides, *kv_strides, heads, group,
            n, levels.selection_size, BLOCK=levels.block, **options, **fine, **common)

    dkc = torch.empty_like(kc, dtype=torch.float32)
    dvc = torch.empty_like(dkc)
    top = levels.levels
    chunks = cdiv(levels.tokens(top), tiles["TK"])
    splits = max(1, min(cdiv(n, tiles["TOP_QR"]), cdiv(tiles["programs"], chunks * bsz * heads)))
    queries = cdiv(cdiv(n, splits), tiles["TOP_QR"]) * tiles["TOP_QR"]
    splits = cdiv(n, queries)
    part_k = dkc if splits * group == 1 else dkc.new_empty(splits * group, *dkc.shape)
    part_v = dvc if splits * group == 1 else dvc.new_empty(splits * group, *dvc.shape)
    launcher(_top_dkv_kernel)[(chunks, bsz * heads, splits)](
        q, kc, vc, do, lse, delta, meta, part_k, part_v, *q_strides, *do_strides, *c_strides, dkc.numel(), heads,
        group, n, top, queries, TK=tiles["TK"], QR=tiles["TOP_QR"], num_warps=tiles["top_warps"],
        num_stages=tiles["top_stages"], **common)
    if splits * group > 1:
        first = levels.rows[top][level_columns.KV_OFF]
        span = slice(first, first + levels.tokens(top))
        torch.sum(part_k[:, :, :, span], 0, out=dkc[:, :, span])       # one op each, in place
        torch.sum(part_v[:, :, :, span], 0, out=dvc[:, :, span])

    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty_like(dk)
    kv_bytes = 2 * kv_heads * n * k.element_size()  # of k and v, per batch entry and head-dim element
    for level in range(top - 1, -1, -1):
        fine = level == 0
        if fine and batched_blocks(levels) and tiles["batched_dkv"]:
            launcher(_fine_dkv_kernel)[(cdiv(levels.tokens(1), tiles["dkv_W"]), bsz * kv_heads)](
                q, k, v, do, lse, delta, offsets, rows, meta, dkc, dvc, dk, dv, *q_strides, *do_strides, *kv_strides,
                *c_strides, heads, kv_heads, group, n, top, levels.selection_size, levels.csc_size,
                BLOCK=levels.block, W=tiles["dkv_W"], SLOTS=tiles["dkv_slots"], STAGES=tiles["dkv_stages"],
                FUSE_POOL=fuse_pool, num_warps=tiles["dkv_W"], num_stages=tiles["dkv_stages"], **common)
            continue
        if not fine and entry_scratch(levels, level, heads, tiles) <= tiles["entry_memory"] * kv_bytes:
            entry_dkv(q, kc, vc, do, lse, delta, sel, offsets, rows, dkc, dvc, levels, level, scale, tiles)
            continue
        parents = levels.tokens(level + 1)
        # few parents with long lists (deep levels): split every list over programs, sum the partials after
        splits = 1 if fine else max(1, min(8, tiles["dkv_programs"] // (parents * bsz * kv_heads)))
        first, count = levels.rows[level][level_columns.KV_OFF], levels.tokens(level)
        qr = tiles["QR_FINE"] if fine else tiles["QR"]
        if splits == 1:
            part_k, part_v, part_off = dkc, dvc, first
        else:
            part_k = dkc.new_empty(splits, bsz, kv_heads, count, d)
            part_v = torch.empty_like(part_k)
            part_off = 0
        pooled = (dkc, dvc) if fine else (kc, vc)  # read at the fine level only; elsewhere inputs as the unused
        # pointers, never the stored part_k, part_v (_runtime.registry.launcher; tests/test_triton_writes.py)
        launcher(_sparse_dkv_kernel)[(parents, bsz * kv_heads, splits)](
            q, k, v, kc, vc, do, lse, delta, offsets, rows, meta, dk, dv, *pooled, part_k, part_v,
            *q_strides, *do_strides, *kv_strides, *c_strides, part_k.stride(0) if splits > 1 else 0,
            part_k.stride(-4), part_k.stride(-3), part_off,
            heads, kv_heads, group, n, top, level, levels.selection_size, levels.csc_size, splits,
            BLOCK=levels.block, BK=pow2(levels.block, 16), QR=qr, FINE=fine,
            ENTRY_MAJOR=levels.block ** (level + 1) % qr == 0, FUSE_POOL=fine and fuse_pool,
            num_warps=tiles["dkv_warps"], num_stages=tiles["stages" if fine else "dkv_coarse_stages"], **common)
        if splits > 1:
            dkc[:, :, first:first + count] = part_k.sum(0)
            dvc[:, :, first:first + count] = part_v.sum(0)
    return dq, dk, dv, dkc, dvc
