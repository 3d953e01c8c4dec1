"""LLSA forward: one online softmax over the fine level, the enriched coarse levels and the top level.

Query tiles of whole query blocks that share their level-2 ancestor (``TB`` blocks, ``TB * b`` rows) attend, in one
pipelined loop (``coarse_softmax``), the ancestor's key list (``coarse_rows``: the level-l children of ``S_{l+1}``
of its ancestors, l = 1..L-1, shared by every query block under it) and every level-L token, each level-l token with
logit bias ``log2(count)``. The fine level and that coarse loop run in one of two ways:

1. ``_fused_fwd_kernel`` (b a power of two >= 16 that divides N, ``batched_blocks``): the program first takes each
   block's ``K_1 * b`` fine keys of ``S_1`` in chunks of ``WN`` as batched 3-d products (``(TB, b, keys)``; with one
   block per warp the row reductions stay in the warp and P in registers), then reshapes its softmax state to
   ``TB * b`` rows for the coarse loop and stores the output and the natural-log LSE. The partial state never leaves
   the registers (two kernels sharing a bf16 partial output and its LSE through memory, as in 2. below, took 0.721
   ms against 0.689 at B2 H8 N65536 D64 and 1.586 against 1.321 at D128 on an H100). Fine keys first: with the
   coarse loop first the kernel took 654-664 us against 576-583 at B2 H8 N65536 D64 on an H200, 2697 against 2345
   at N262144 L3, 141 against 121 at N16384.
2. Otherwise ``_coarse_fwd_kernel`` stores the normalised partial output and its LSE (log2 units), and
   ``_fine_fwd_ragged_kernel`` (any N and b, ``FQ`` rows per step, with masks) starts from that partial state
   (running max = partial LSE, running sum 1, accumulator = partial output).

The fine products have ``b`` rows (``mma.sync`` on Hopper). A transposed form (keys x queries, wgmma with N = b)
needs a transposed shared-memory A operand, which triton 3.6 miscompiles (out-of-bounds wgmma reads on an H200).
The coarse pass has an ``EVEN`` specialisation (N a multiple of ``b^L``, whole key chunks per level: no masks).
Everything runs in the log2 domain (``SCALE2 = scale * log2(e)``); padding logits are -inf.

**Hoisted key rows** (``HOIST``; ``EVEN`` lists of at most ``HOIST_RUNS`` runs, i.e. ``K_2 + ... + K_L`` selected
tokens). Each chunk's key rows come from an index load (the ancestor's list, the blocks' ``S_1``), and Triton's
pipeliner puts that load and the dependent ``cp.async`` of the chunk in one stage, so every iteration waits for all
of its copies: a CTA never overlaps its own gathers with its products. ``_fused_fwd_kernel`` with ``HOIST`` reads
the list once as runs of ``b`` rows (``listed_runs``) and the tile's ``S_1`` once, and computes each chunk's rows in
registers (a compare-and-sum over the runs or ids). The coarse loop then keeps the next chunk's copies in flight on
3 stages (``DEPBAR.LE SB0, 0x2`` in the SASS, against ``0x0``). H100, B2 H8 b16 K8: the kernel 673-678 us against
700-703 unhoisted at N65536 D64, 1185-1195 against 1300-1303 at D128; but 16 runs (N262144 L3) took 160 registers
instead of 128 and 2844-2848 us against 2726, hence the cap. The dQ kernels (``bwd``) hoist theirs the same way.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...masks import levels as level_columns
from .._runtime.registry import launcher
from ..common.jit import (KV_OFF, LN2, LOG2E, SEL_OFF, T, TOPK, load_rows, load_slab, load_tile, mm, program_heads,
                          softmax_step, sparse_keys, store_rows)
from .._runtime.sizes import cdiv, pow2
from ...masks.levels import Levels
from .._runtime.tiles import with_overrides


HOIST_RUNS = 8  # most runs (selected coarse tokens) in a list whose loops hoist their key rows (module docstring)


def coarse_tile_blocks(block: int, rows_cap: int) -> int:
    """Query blocks per tile of the coarse kernels: the largest divisor ``t`` of ``block`` with
    ``t * block <= rows_cap`` (at least 1). The ``t`` blocks of a tile share their level-2 ancestor, so one
    key list (``coarse_rows``) serves every row of the tile."""
    return max([t for t in range(1, block + 1) if block % t == 0 and t * block <= rows_cap] or [1])


@triton.jit
def _coarse_list_kernel(SEL, META, LIST, S_TOTAL, LEVELS: tl.constexpr, BLOCK: tl.constexpr, BK: tl.constexpr,
                        N_SPARSE: tl.constexpr):
    """The key list of level-2 ancestor ``program_id(0)`` (see ``coarse_rows``)."""
    g = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    sel = SEL + bh * S_TOTAL
    out = LIST + (bh * tl.num_programs(0) + g) * N_SPARSE
    e = tl.arange(0, BK)
    first = 0
    up = g  # the level-(level + 1) ancestor, g // b^(level - 1), by one division per level (no power of b to overflow)
    for level in tl.static_range(1, LEVELS):
        topk = tl.load(META + level * 6 + TOPK)
        ok = e < topk * BLOCK
        ids = tl.load(sel + tl.load(META + level * 6 + SEL_OFF) + up * topk + e // BLOCK, mask=ok, other=0)
        tok = ids * BLOCK + e % BLOCK
        rows = tl.where(tok < tl.load(META + level * 6 + T), tl.load(META + level * 6 + KV_OFF) + tok, -1)
        tl.store(out + first + e, rows, mask=ok)
        first += topk * BLOCK
        up = up // BLOCK


def coarse_rows(sel: torch.Tensor, levels: Levels) -> torch.Tensor:
    """Coarse keys below the top level of every level-2 ancestor: ``(B, H, T_2, S)`` int32 rows of the pyramid
    ``(T_1 + ... + T_L)``, ``S = b * (K_2 + ... + K_L)``: for l = 1..L-1 the level-l children of
    ``S_{l+1}`` of the ancestor at level l+1, in selection order; -1 for children past ``T_l``. For L = 1 (no
    such level) a ``(B, H, 1, 1)`` table of -1. The top level is not listed (every query attends all of it)."""
    bsz, heads = sel.shape[:2]
    if levels.levels == 1:      # the same table at every call of a shape: built once, not filled per call
        return levels.constant(f"no coarse rows {bsz}x{heads} {sel.dtype}", sel,
                               lambda device: torch.full((bsz, heads, 1, 1), -1, dtype=sel.dtype, device=device))
    rows = sel.new_empty(bsz, heads, levels.tokens(2), levels.coarse_keys)
    launcher(_coarse_list_kernel)[(levels.tokens(2), bsz * heads)](
        sel, levels.meta(sel), rows, levels.selection_size, LEVELS=levels.levels, BLOCK=levels.block,
        BK=pow2(levels.block * max(levels.topk[1:]), 16), N_SPARSE=levels.coarse_keys)
    return rows


@triton.jit
def coarse_keys(lst, LOG2C, c, BN: tl.constexpr, N_SPARSE: tl.constexpr, n_total, top_off, EVEN: tl.constexpr):
    """Coarse key slots ``c .. c + BN``: their pyramid rows (the ancestor's list ``lst``, ``coarse_rows``,
    for the first ``N_SPARSE`` slots, then the top level's tokens in order; -1 past ``n_total`` or for a listed
    child past its level's end) and their logit bias ``log2(count)`` (-inf where the row is -1). With ``EVEN``
    (no ragged token, whole chunks of one level) the bias is the chunk's first key's, a scalar."""
    e = c + tl.arange(0, BN)
    listed = e < N_SPARSE
    rows = tl.where(listed, tl.load(lst + e, mask=listed, other=-1), tl.where(e < n_total, top_off + e - N_SPARSE, -1))
    if EVEN:
        first = tl.load(lst + c, mask=c < N_SPARSE, other=0)
        bias = tl.load(LOG2C + tl.where(c < N_SPARSE, first, top_off + c - N_SPARSE))
    else:
        bias = tl.load(LOG2C + rows, mask=rows >= 0, other=float("-inf"))
    return rows, bias


@triton.jit
def listed_runs(lst, LOG2C, top_off, N_SPARSE: tl.constexpr, BLOCK: tl.constexpr, RUNS: tl.constexpr):
    """An ``EVEN`` ancestor's listed keys as runs of ``BLOCK`` consecutive pyramid rows (one per selected token):
    the runs' first rows ``(RUNS,)``, their logit biases ``log2(count)`` and the top level's bias, for
    ``coarse_keys_from_runs``."""
    run = tl.arange(0, RUNS)
    ok = run * BLOCK < N_SPARSE
    starts = tl.load(lst + run * BLOCK, mask=ok, other=0)
    return starts, tl.load(LOG2C + starts, mask=ok, other=0.0), tl.load(LOG2C + top_off)


@triton.jit
def coarse_keys_from_runs(starts, run_bias, top_bias, c, BN: tl.constexpr, N_SPARSE: tl.constexpr,
                          BLOCK: tl.constexpr, RUNS: tl.constexpr, top_off):
    """``coarse_keys`` of an ``EVEN`` chunk without a load: its rows from ``listed_runs``' runs (or the top level's
    tokens) and its bias (a chunk lies in one level), the top level's ``top_bias``."""
    e = c + tl.arange(0, BN)
    run = tl.arange(0, RUNS)
    listed = tl.sum(tl.where(run[None, :] == (e // BLOCK)[:, None], starts[None, :], 0), axis=1) + e % BLOCK
    rows = tl.where(e < N_SPARSE, listed, top_off + e - N_SPARSE)
    bias = tl.where(c < N_SPARSE, tl.sum(tl.where(run == c // BLOCK, run_bias, 0.0)), top_bias)
    return rows, bias


@triton.jit
def coarse_softmax(q, kc, vc, lst, LOG2C, dim, TOP_OFF, TOP_T, D: tl.constexpr, BD: tl.constexpr,
                   N_SPARSE: tl.constexpr, SCALE2: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                   EVEN: tl.constexpr, STAGES: tl.constexpr, IEEE: tl.constexpr, HOIST: tl.constexpr,
                   BLOCK: tl.constexpr, RUNS: tl.constexpr, m, l, acc):
    """The online-softmax state ``(m, l, acc)`` (log2 units; ``(BM,)``, ``(BM,)``, ``(BM, BD)`` fp32) of query rows
    ``q (BM, BD)`` carried on over their ancestor's key list ``lst`` and every top-level token, in chunks of
    ``BN``. With ``HOIST`` (``EVEN`` only) the list is read once, as ``RUNS`` runs of ``BLOCK`` rows (module
    docstring)."""
    n_total = N_SPARSE + TOP_T
    if HOIST:
        starts, run_bias, top_bias = listed_runs(lst, LOG2C, TOP_OFF, N_SPARSE, BLOCK, RUNS)
    for c in tl.range(0, n_total, BN, num_stages=STAGES):
        if HOIST:
            key_rows, bias = coarse_keys_from_runs(starts, run_bias, top_bias, c, BN, N_SPARSE, BLOCK, RUNS, TOP_OFF)
        else:
            key_rows, bias = coarse_keys(lst, LOG2C, c, BN, N_SPARSE, n_total, TOP_OFF, EVEN)
        k = load_tile(kc, key_rows, D, dim, key_rows >= 0, D, BD, not EVEN).to(q.dtype)
        v = load_tile(vc, key_rows, D, dim, key_rows >= 0, D, BD, not EVEN).to(q.dtype)
        if EVEN:
            s = mm(q, tl.trans(k), IEEE) * SCALE2 + bias
        else:
            s = mm(q, tl.trans(k), IEEE) * SCALE2 + bias[None, :]
        m, l, acc = softmax_step(s, 1.0, v, m, l, acc, IEEE)
    return m, l, acc


@triton.jit
def coarse_bases(KC, VC, LIST, b, h, bh, c_b, c_h, l_bh, GROUP, TB: tl.constexpr, BLOCK: tl.constexpr,
                 N_SPARSE: tl.constexpr):
    """The pooled K and V of head ``(b, h)``'s KV head and the key list of this tile's ancestor (``program_id(0)`` is
    the tile of ``TB`` query blocks); read-only (``program_heads``)."""
    kv = b.to(tl.int64) * c_b + (h // GROUP).to(tl.int64) * c_h
    return KC + kv, VC + kv, LIST + bh.to(tl.int64) * l_bh + ((tl.program_id(0) * TB) // BLOCK) * N_SPARSE


@triton.jit
def _coarse_fwd_kernel(Q, KC, VC, LIST, LOG2C, O, LSE, q_b, q_h, q_n, o_b, o_h, o_n, c_b, c_h, l_bh,
                       H, GROUP, N, TOP_OFF, TOP_T,
                       D: tl.constexpr, BD: tl.constexpr, BLOCK: tl.constexpr, TB: tl.constexpr,
                       N_SPARSE: tl.constexpr, SCALE2: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                       EVEN: tl.constexpr, STAGES: tl.constexpr, IEEE: tl.constexpr):
    bh, b, h = program_heads(H)
    kc, vc, lst = coarse_bases(KC, VC, LIST, b, h, bh, c_b, c_h, l_bh, GROUP, TB, BLOCK, N_SPARSE)
    local = tl.arange(0, BM)
    rows = tl.program_id(0) * TB * BLOCK + local
    row_ok = (local < TB * BLOCK) & (rows < N)
    dim = tl.arange(0, BD)
    q = load_rows(Q + b.to(tl.int64) * q_b + h.to(tl.int64) * q_h, rows, q_n, dim, row_ok, D)
    m, l, acc = coarse_softmax(q, kc, vc, lst, LOG2C, dim, TOP_OFF, TOP_T, D, BD, N_SPARSE, SCALE2, BM, BN, EVEN,
                               STAGES, IEEE, False, BLOCK, 1, tl.full([BM], float("-inf"), tl.float32),
                               tl.zeros([BM], tl.float32), tl.zeros([BM, BD], tl.float32))
    store_rows(O + b.to(tl.int64) * o_b + h.to(tl.int64) * o_h, acc / l[:, None], rows, o_n, dim, row_ok, D)
    tl.store(LSE + bh.to(tl.int64) * N + rows, m + tl.log2(l), mask=row_ok)


@triton.jit
def _fused_fwd_kernel(Q, K, V, KC, VC, LIST, LOG2C, SEL, META, O, LSE, q_b, q_h, q_n, k_b, k_h, k_n, v_b, v_h, v_n,
                      o_b, o_h, o_n, c_b, c_h, l_bh, H, GROUP, N, TOP_OFF, TOP_T, S_TOTAL,
                      D: tl.constexpr, BD: tl.constexpr, BLOCK: tl.constexpr, TB: tl.constexpr,
                      N_SPARSE: tl.constexpr, SCALE2: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                      EVEN: tl.constexpr, STAGES: tl.constexpr, WN: tl.constexpr, KEYS: tl.constexpr,
                      W_STAGES: tl.constexpr, KV_ROWS: tl.constexpr, HOIST: tl.constexpr, RUNS: tl.constexpr,
                      TOPK1P: tl.constexpr, IEEE: tl.constexpr):
    """The whole forward of a tile of ``TB`` query blocks (b a power of two >= 16 that divides N): the state
    ``(TB, b, ...)``, one block per warp where ``TB`` is the warp count, first takes each block's ``K_1 * b`` fine keys
    (batched 3-d products, chunks of ``WN``; ``KV_ROWS``: v's token stride is ``k_n``), then, reshaped to ``TB * b``
    rows, the coarse pass as ``_coarse_fwd_kernel``; stores the output and the natural-log LSE. ``HOIST`` (``EVEN``
    only): both loops take their key rows from registers (module docstring; ``RUNS`` runs in the list,
    ``TOPK1P = pow2(K_1)``)."""
    bh, b, h = program_heads(H)
    real, blk, rows = step_blocks(tl.program_id(0), 0, N // BLOCK, TB, 1, BLOCK)
    dim = tl.arange(0, BD)
    q_head = Q + b.to(tl.int64) * q_b + h.to(tl.int64) * q_h
    q = load_slab(q_head, rows, q_n, dim, D, BD)
    m = tl.full([TB, BLOCK], float("-inf"), tl.float32)
    l = tl.zeros([TB, BLOCK], tl.float32)
    acc = tl.zeros([TB, BLOCK, BD], tl.float32)
    kb, vb, sel = fine_bases(K, V, SEL, META, b, h, bh, k_b, k_h, v_b, v_h, GROUP, S_TOTAL)
    ids = fine_ids(sel, blk, KEYS // BLOCK, TOPK1P, HOIST)
    for c in tl.range(0, KEYS, WN, num_stages=W_STAGES):
        tok = fine_tokens(sel, blk, ids, c, WN, BLOCK, KEYS // BLOCK, TOPK1P, HOIST)
        s = mm(q, tl.trans(load_slab(kb, tok, k_n, dim, D, BD)), IEEE)
        if KV_ROWS:  # v's token stride is k's: one address computation for both gathers (H200: the kernel
            # 693-695 against 698 us at B2 H8 N65536 D64, 1253-1266 against 1274-1282 at D128, coarse loop first)
            v_slab = load_slab(vb, tok, k_n, dim, D, BD)
        else:
            v_slab = load_slab(vb, tok, v_n, dim, D, BD)
        m, l, acc = softmax_step(s, SCALE2, v_slab, m, l, acc, IEEE)
    # q loaded again in the coarse products' layout: reshaping the fine loop's copy kept both live (at D=64 and fine
    # chunks of 32, 168 registers against 128 here, offline sm_90 compile; H200: the kernel 636 against 576-583 us at
    # B2 H8 N65536)
    rows = tl.reshape(rows, (BM,))
    # from the blocks' flags: the equal `program_id(0) * BM + arange(BM) < N` took D=128 from 194 to 244 registers
    real = tl.reshape(tl.broadcast_to(real[:, None], (TB, BLOCK)), (BM,))
    kc, vc, lst = coarse_bases(KC, VC, LIST, b, h, bh, c_b, c_h, l_bh, GROUP, TB, BLOCK, N_SPARSE)
    m, l, acc = coarse_softmax(load_tile(q_head, rows, q_n, dim, real, D, BD, False), kc, vc, lst, LOG2C, dim, TOP_OFF,
                               TOP_T, D, BD, N_SPARSE, SCALE2, BM, BN, EVEN, STAGES, IEEE, HOIST, BLOCK, RUNS,
                               tl.reshape(m, (BM,)), tl.reshape(l, (BM,)), tl.reshape(acc, (BM, BD)))
    store_rows(O + b.to(tl.int64) * o_b + h.to(tl.int64) * o_h, acc / l[:, None], rows, o_n, dim, real, D)
    tl.store(LSE + bh.to(tl.int64) * N + rows, (m + tl.log2(l)) * LN2, mask=real)


@triton.jit
def fine_bases(K, V, SEL, META, b, h, bh, k_b, k_h, v_b, v_h, GROUP, S_TOTAL):
    """The K and V of head ``(b, h)``'s KV head and its rows of ``S_1``; read-only (``program_heads``)."""
    b64, hk64 = b.to(tl.int64), (h // GROUP).to(tl.int64)
    sel = SEL + bh.to(tl.int64) * S_TOTAL + tl.load(META + SEL_OFF)
    return K + b64 * k_b + hk64 * k_h, V + b64 * v_b + hk64 * v_h, sel


@triton.jit
def step_blocks(pid, sub, blocks, W: tl.constexpr, WSUB: tl.constexpr, BLOCK: tl.constexpr):
    """Query blocks of step ``sub`` of program ``pid`` of the batched fine kernels: ``(real (W,), block (W,),
    rows (W, BLOCK))``. A partial last step repeats the last block (``real`` is False there: never stored)."""
    step = (pid * WSUB + sub) * W + tl.arange(0, W)
    blk = tl.minimum(step, blocks - 1)
    return step < blocks, blk, blk[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]


@triton.jit
def fine_ids(sel, blk, TOPK1: tl.constexpr, TOPK1P: tl.constexpr, HOIST: tl.constexpr):
    """With ``HOIST``, ``S_1`` of query blocks ``blk (W,)`` (``TOPK1`` ids per row at ``sel``) held for
    ``fine_tokens``: ``(W, TOPK1P)``, zeros past ``TOPK1``; else zeros (unused)."""
    slot = tl.arange(0, TOPK1P)
    if HOIST:
        return tl.load(sel + blk[:, None] * TOPK1 + slot[None, :], mask=slot[None, :] < TOPK1, other=0)
    else:
        return tl.zeros_like(blk[:, None] + slot[None, :])


@triton.jit
def fine_tokens(sel, blk, ids, c, WN: tl.constexpr, BLOCK: tl.constexpr, TOPK1: tl.constexpr, TOPK1P: tl.constexpr,
                HOIST: tl.constexpr):
    """Fine key tokens ``(W, WN)`` of slots ``c .. c + WN`` of the selections of query blocks ``blk (W,)``
    (``TOPK1`` ids per row at ``sel``, ``BLOCK`` children per id): with ``HOIST`` from ``ids`` (``fine_ids``,
    registers) by a compare-and-sum, else loaded."""
    e = c + tl.arange(0, WN)
    if HOIST:
        hit = tl.arange(0, TOPK1P)[None, None, :] == (e // BLOCK)[None, :, None]
        return tl.sum(tl.where(hit, ids[:, None, :], 0), axis=2) * BLOCK + (e % BLOCK)[None, :]
    else:
        return tl.load(sel + blk[:, None] * TOPK1 + (e // BLOCK)[None, :]) * BLOCK + (e % BLOCK)[None, :]


@triton.jit
def _fine_fwd_ragged_kernel(Q, K, V, SEL, META, O, LSE, q_b, q_h, q_n, k_b, k_h, k_n, v_b, v_h, v_n, o_b, o_h, o_n,
                            H, GROUP, N, S_TOTAL,
                            D: tl.constexpr, BD: tl.constexpr, BLOCK: tl.constexpr, SCALE2: tl.constexpr,
                            FQ: tl.constexpr, FN: tl.constexpr, SUB: tl.constexpr, IEEE: tl.constexpr):
    pid = tl.program_id(0)
    bh, b, h = program_heads(H)
    kb, vb, sel = fine_bases(K, V, SEL, META, b, h, bh, k_b, k_h, v_b, v_h, GROUP, S_TOTAL)
    qb = Q + b.to(tl.int64) * q_b + h.to(tl.int64) * q_h
    o = O + b.to(tl.int64) * o_b + h.to(tl.int64) * o_h
    lse = LSE + bh.to(tl.int64) * N
    topk = tl.load(META + TOPK)
    dim = tl.arange(0, BD)
    for sub in range(SUB):
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
        for c in range(0, n_keys, FN):
            g, tok, ok = sparse_keys(sel + qb0 * topk, c + tl.arange(0, FN), n_keys, topk, BLOCK)
            ok = ok & (tok < N)
            s = mm(q, tl.trans(load_rows(kb, tok, k_n, dim, ok, D)), IEEE) * SCALE2
            s = tl.where(ok[None, :] & (row_block[:, None] == g[None, :]), s, float("-inf"))
            m, l, acc = softmax_step(s, 1.0, load_rows(vb, tok, v_n, dim, ok, D), m, l, acc, IEEE)
        store_rows(o, acc / l[:, None], rows, o_n, dim, row_ok, D)
        tl.store(lse + rows, (m + tl.log2(l)) * LN2, mask=row_ok)


def batched_blocks(levels: Levels) -> bool:
    """Whether the fine level runs batched (``_fused_fwd_kernel``, ``bwd._fine_dq_kernel``): b a power of two
    >= 16 that divides N."""
    return levels.block >= 16 and levels.block & (levels.block - 1) == 0 and levels.n % levels.block == 0


def key_chunk(keys: int, cap: int) -> int:
    """Fine keys per step: ``cap`` halved until it divides the ``keys = K_1 b`` of a query block."""
    while keys % cap:
        cap //= 2
    return cap


def fine_launch(levels: Levels, tiles: dict) -> tuple[bool, int, dict, dict]:
    """How the fine dQ kernels (and the ragged fine forward) run: ``(batched, programs per head, constants, launch
    options)``.

    Batched (``batched_blocks``, ``_fine_dq_kernel``): ``W`` query blocks per step (one per warp), ``WSUB`` steps
    per program, keys in chunks of ``WN`` (``key_chunk``) on ``w_stages`` pipeline stages, or with ``fine_hoist``
    (the blocks' ids read once, ``HOIST``) on ``fine_hoist_stages``; ``FULL`` when the steps cover the blocks
    exactly. Else the ragged kernels: ``FQ`` rows per step (``b`` rounded up to a power of two >= 16), ``SUB``
    steps, key chunks of ``FN`` at most."""
    block, keys = levels.block, levels.topk[0] * levels.block
    if batched_blocks(levels):
        per_program, hoist = tiles["W"] * tiles["WSUB"], tiles["fine_hoist"]
        return True, cdiv(levels.tokens(1), per_program), dict(
            W=tiles["W"], WN=key_chunk(keys, tiles["WN"]), WSUB=tiles["WSUB"], KEYS=keys,
            STAGES=tiles["fine_hoist_stages"] if hoist else tiles["w_stages"], FULL=levels.tokens(1) % per_program == 0,
            HOIST=hoist, TOPK1P=pow2(levels.topk[0])), dict(num_warps=tiles["W"], num_stages=1)
    fq = pow2(block, 16)
    blocks = fq // block if fq % block == 0 else fq // block + 2  # query blocks a step can touch
    return False, cdiv(cdiv(levels.n, fq), tiles["SUB"]), dict(
        FQ=fq, FN=min(tiles["FN"], pow2(blocks * keys, 16)), SUB=tiles["SUB"]), dict(
        num_warps=tiles["fine_warps"], num_stages=tiles["fine_stages"])


def forward_tiles(device: torch.device, d: int, dtype: torch.dtype) -> dict:
    """Tile sizes of the forward kernels (see module docstring and ``fine_launch``), with
    ``tiles.overrides("fwd")``. The fused kernel's tiles hold at most ``fused_BM`` rows (whole query blocks that
    share their ancestors) on ``fused_warps`` warps, ``BN`` coarse keys per step on ``stages`` stages (on
    ``hoist_stages`` where it hoists: ``EVEN`` and at most ``hoist_runs`` runs in the list), ``WN`` fine keys per
    step on ``w_stages``; the ragged path's coarse tiles ``BM`` rows on ``warps`` warps. fp32 on a GPU (tuned for
    fit, not speed) takes key chunks of a quarter the bytes (the bf16 ragged fine chunks of 256 keys needed 283 KB
    of shared memory at D=64 in fp32, ``benchmarks/sm90_fit.py``) and does not hoist."""
    if device.type == "cpu":
        base = dict(fused_BM=32, fused_warps=2, BM=32, BN=32, WN=32, w_stages=1, FN=64, SUB=2, warps=4, stages=1,
                    fine_warps=4, fine_stages=1, hoist_runs=HOIST_RUNS, hoist_stages=1)
    else:
        # WN: fine keys per step of the fused kernel; 64 up to D=32, else 32 (H200, B2 H8 N65536 b16 K8, the kernel
        # in us: D64 617 at 64 against 574-591 at 32; D32 393 at 64 against 407 at 32)
        base = dict(fused_BM=64, fused_warps=4, BM=128, BN=64, WN=64 if d <= 32 else 32, w_stages=2, FN=256, SUB=8,
                    warps=8, stages=2, fine_warps=4, fine_stages=2 if d > 64 else 3,
                    hoist_runs=HOIST_RUNS if d <= 128 else 0, hoist_stages=3)
        if dtype.itemsize > 2:
            base.update(BM=64, BN=32, WN=16, FN=64, warps=4, fine_stages=2, hoist_runs=0)
    return with_overrides("fwd", base)


def hoisting(levels: Levels, even: bool, tiles: dict) -> dict:
    """A coarse loop's constants ``HOIST`` (its key rows hoisted, module docstring: ``EVEN`` and at most
    ``tiles["hoist_runs"]`` runs of b rows, ``K_2 + ... + K_L``, in the list), ``RUNS`` (those runs, padded to a
    power of two) and ``STAGES``, its pipeline stages (``hoist_stages`` where it hoists, else ``stages``; the
    launch's ``num_stages`` too)."""
    runs = levels.coarse_keys // levels.block
    hoist = even and runs <= tiles["hoist_runs"]
    return dict(HOIST=hoist, RUNS=pow2(runs), STAGES=tiles["hoist_stages"] if hoist else tiles["stages"])


def coarse_launch(q: torch.Tensor, levels: Levels, rows_cap: int, keys_cap: int) -> tuple[tuple[int, int], dict]:
    """Grid and tile constants of the coarse kernels: tiles of ``TB`` whole query blocks (``BM`` rows), key
    chunks of ``BN <= keys_cap``. ``EVEN``: no ragged token (N a multiple of ``b^L``) and every level's keys
    (``K_{l+1} b`` listed per level, ``T_L`` at the top) whole chunks, then with ``BN`` the largest power of two
    (>= 16) that divides them all; the kernels drop every mask and take one bias per chunk."""
    tb = coarse_tile_blocks(levels.block, rows_cap)
    grid = (cdiv(levels.tokens(1), tb), q.shape[0] * q.shape[1])
    top = levels.levels
    counts = [levels.block * k for k in levels.topk[1:]] + [levels.tokens(top)]
    bn = keys_cap
    while bn > 16 and any(count % bn for count in counts):
        bn //= 2
    even = levels.n % levels.block**top == 0 and not any(count % bn for count in counts)
    return grid, dict(TOP_OFF=levels.rows[top][level_columns.KV_OFF], TOP_T=levels.tokens(top), BLOCK=levels.block,
                      TB=tb, BM=pow2(tb * levels.block, 16), BN=bn if even else keys_cap, N_SPARSE=levels.coarse_keys,
                      EVEN=even)


def fused_launch(q: torch.Tensor, levels: Levels, rows_cap: int, keys_cap: int, fine_cap: int):
    """Grid and constants of the fused kernels (``_fused_fwd_kernel``, ``bwd._fused_dq_kernel``;
    ``batched_blocks`` holds, so ``BM = TB * b``): ``coarse_launch``'s, and the fine level's ``KEYS = K_1 b`` keys
    per query block in chunks of ``WN`` (``key_chunk`` of ``fine_cap``), ``TOPK1P = pow2(K_1)``."""
    grid, coarse = coarse_launch(q, levels, rows_cap, keys_cap)
    keys = levels.topk[0] * levels.block
    return grid, dict(coarse, KEYS=keys, WN=key_chunk(keys, fine_cap), TOPK1P=pow2(levels.topk[0]))


def llsa_forward(q, k, v, kc, vc, sel, levels: Levels, scale: float, tiles: dict | None = None):
    """O ``(B, H, N, D)`` in q's dtype and natural-log LSE ``(B, H, N)`` fp32.

    q: ``(B, H, N, D)``; k, v: ``(B, Hk, N, D)``; each with its last dim contiguous, other strides
    free (e.g. views of one fused projection); kc, vc: pooled levels 1..L ``(B, Hk, T_1 + ... + T_L, D)``
    contiguous; sel: packed selection ``(B, H, S)`` int32. O is ``empty_like(q)``: q's memory order (a
    ``(B, N, H, D)`` layout for such views, so ``o.transpose(1, 2).reshape(B, N, H * D)`` needs no copy).
    """
    bsz, heads, n, d = q.shape
    tiles = tiles or forward_tiles(q.device, d, q.dtype)
    meta = levels.meta(q)
    common = dict(D=d, BD=pow2(d, 16), SCALE2=float(scale * LOG2E.value), IEEE=q.dtype == torch.float32)
    group = heads // k.shape[1]
    key_list = coarse_rows(sel, levels)
    o = torch.empty_like(q)
    lse = q.new_empty(bsz, heads, n, dtype=torch.float32)
    q_strides, o_strides, c_strides = q.stride()[:3], o.stride()[:3], kc.stride()[:2]
    list_stride = key_list.shape[2] * key_list.shape[3]
    if batched_blocks(levels):
        grid, fused = fused_launch(q, levels, tiles["fused_BM"], tiles["BN"], tiles["WN"])
        coarse_loop = hoisting(levels, fused["EVEN"], tiles)
        launcher(_fused_fwd_kernel)[grid](
            q, k, v, kc, vc, key_list, levels.log2_counts(q), sel, meta, o, lse, *q_strides, *k.stride()[:3],
            *v.stride()[:3], *o_strides, *c_strides, list_stride, heads, group, n,
            S_TOTAL=levels.selection_size, W_STAGES=tiles["w_stages"], KV_ROWS=k.stride(2) == v.stride(2),
            num_warps=tiles["fused_warps"], num_stages=coarse_loop["STAGES"], **coarse_loop, **fused, **common)
        return o, lse
    grid, coarse = coarse_launch(q, levels, tiles["BM"], tiles["BN"])
    launcher(_coarse_fwd_kernel)[grid](
        q, kc, vc, key_list, levels.log2_counts(q), o, lse, *q_strides, *o_strides, *c_strides, list_stride, heads,
        group, n, STAGES=tiles["stages"], num_warps=tiles["warps"], num_stages=tiles["stages"], **coarse, **common)
    _, programs, fine, options = fine_launch(levels, tiles)
    launcher(_fine_fwd_ragged_kernel)[(programs, bsz * heads)](
        q, k, v, sel, meta, o, lse, *q_strides, *k.stride()[:3], *v.stride()[:3], *o_strides, heads, group, n,
        levels.selection_size, BLOCK=levels.block, **options, **fine, **common)
    return o, lse
