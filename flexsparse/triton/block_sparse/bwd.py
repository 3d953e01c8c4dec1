"""Block-sparse attention backward: dQ query-major over the index table, dK/dV key-major over its CSC.

* ``_block_dq_kernel``: one program per query tile (as the forward), walks the row's selected key blocks,
  recomputes ``P = exp2(S - LSE2)`` from the saved LSE and adds ``dS K``. It also computes and stores
  ``Delta = rowsum(O * dO) - dLSE`` (so a gradient that reaches the LSE output is right), which the
  dK/dV kernel reads; the two kernels run in this order.
* ``_block_dkv_kernel``: one program per key tile (``K_SPLIT`` per key block) and (batch, KV head), launched
  head by head, longest CSC lists first where the call is large and the grid takes more than one wave
  (``program_order``: a popular key block does not trail the grid).
  It walks, for every query head of its KV head (GQA: no atomics), the CSC list of its key block: the
  query blocks that selected it (``csc.block_csc``), each as ``Q_SPLIT`` tiles, or ``Q_GROUP`` small
  query blocks side by side per step.
  Work is O(entries), so the backward grows linearly in N at a fixed number of blocks per row; with a
  deterministic CSC (ascending lists) dK/dV are bitwise reproducible.

Every matrix product's first operand is a plain loaded tile or a computed one (triton 3.6 on Hopper
miscompiles a transposed shared-memory A operand; ``docs/triton_llsa.md``).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ...masks.constants import kept_constant
from .fwd import chunk_rows, geometry, list_rows, list_steps
from .._runtime.registry import launcher
from ..common.jit import LOG2E, load_tile, mm, store_tile
from .gluon import block_bwd_ws, block_fwd_ws
from .._runtime.sizes import cdiv, pow2, repeat_rows, static
from .._runtime.registry import launching_directly
from .._runtime.tiles import overrides, with_overrides

# Head dims where the warp-specialized Gluon kernels (sm_90) replace the Triton ones; H200, 5 % of 64x64 blocks,
# ms Gluon / Triton per kernel: dK/dV (no GQA) at B2 H8 N65536 D64 3.54-3.66 / ~4.0 (at D=128 it spills: 5.7 /
# 3.65); dQ at B2 H16 N32760 D128 2.45 / ~2.9 (at D=64 2.74 / 2.25)
WS_DKV_HEAD_DIMS = (64,)
WS_DQ_HEAD_DIMS = (128,)
SORTED_FROM_ENTRIES = 1 << 16   # CSC entries from which the dK/dV programs run longest first (program_order)
WS_DKV_MIN_STEPS = 16  # Gluon dK/dV only for CSC lists of this many 64-row tiles on average: at 8 (K=8 of 64x64
# blocks) the backward took 1.38 ms against 1.34 with the Triton dK/dV, at 31 (sla2 97 %) and 51 it is faster


@triton.jit
def _block_dq_kernel(Q, K, V, IDX, O, DO, LSE, DLSE, DELTA, DQ, q_b, q_h, q_n, k_b, k_h, k_n,
                     H, GROUP, NQ, NK, TQ, TOPK,
                     BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                     SCALE2: tl.constexpr, SCALE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                     TILE_Q: tl.constexpr, TILE_K: tl.constexpr, Q_SPLIT: tl.constexpr, K_SPLIT: tl.constexpr,
                     Q_GROUP: tl.constexpr, K_GROUP: tl.constexpr, MASK_Q: tl.constexpr, MASK_K: tl.constexpr,
                     HAS_DLSE: tl.constexpr, STAGES: tl.constexpr, IEEE: tl.constexpr):
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh - b * H
    q_head = b.to(tl.int64) * q_b + h.to(tl.int64) * q_h
    kv_head = b.to(tl.int64) * k_b + (h // GROUP).to(tl.int64) * k_h
    qblk = pid // Q_SPLIT
    rows, row_ok = chunk_rows(qblk, pid - qblk * Q_SPLIT, BLOCK_Q, TILE_Q, NQ)
    dim = tl.arange(0, BD)
    q = load_tile(Q + q_head, rows, q_n, dim, row_ok, D, BD, MASK_Q)
    do = load_tile(DO + q_head, rows, q_n, dim, row_ok, D, BD, MASK_Q)
    o = load_tile(O + q_head, rows, q_n, dim, row_ok, D, BD, MASK_Q)
    stats = bh.to(tl.int64) * NQ + rows
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    if MASK_Q:
        if HAS_DLSE:
            delta -= tl.load(DLSE + stats, mask=row_ok, other=0.0)
        tl.store(DELTA + stats, delta, mask=row_ok)
        lse2 = tl.load(LSE + stats, mask=row_ok, other=0.0) * LOG2E
    else:
        if HAS_DLSE:
            delta -= tl.load(DLSE + stats)
        tl.store(DELTA + stats, delta)
        lse2 = tl.load(LSE + stats) * LOG2E
    table = IDX + (bh.to(tl.int64) * TQ + qblk) * TOPK
    dq = tl.zeros([BM, BD], tl.float32)
    for e in tl.range(0, list_steps(0, TOPK, K_SPLIT, K_GROUP), num_stages=STAGES):
        keys, key_ok = list_rows(table, 0, TOPK, e, NK, BLOCK_K, TILE_K, K_SPLIT, K_GROUP)
        k = load_tile(K + kv_head, keys, k_n, dim, key_ok, D, BD, MASK_K)
        v = load_tile(V + kv_head, keys, k_n, dim, key_ok, D, BD, MASK_K)
        p = tl.exp2(mm(q, tl.trans(k), IEEE) * SCALE2 - lse2[:, None])
        if MASK_K:
            p = tl.where(key_ok[None, :], p, 0.0)
        ds = p * (mm(do, tl.trans(v), IEEE) - delta[:, None])
        dq += mm(ds.to(k.dtype), k, IEEE)
    store_tile(DQ + q_head, dq * SCALE, rows, q_n, dim, row_ok, D, BD, MASK_Q)


@triton.jit
def _block_dkv_kernel(Q, K, V, DO, LSE, DELTA, OFFSETS, ROWS, ORDER, DK, DV, q_b, q_h, q_n, k_b, k_h, k_n,
                      H, HK, GROUP, NQ, NK, TQ, TK, TOPK,
                      BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                      SCALE2: tl.constexpr, SCALE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                      TILE_Q: tl.constexpr, TILE_K: tl.constexpr, Q_SPLIT: tl.constexpr, K_SPLIT: tl.constexpr,
                      Q_GROUP: tl.constexpr, K_GROUP: tl.constexpr, MASK_Q: tl.constexpr, MASK_K: tl.constexpr,
                      STAGES: tl.constexpr, IEEE: tl.constexpr):
    pid = tl.program_id(0)
    slot = pid // K_SPLIT
    item = tl.load(ORDER + slot)  # (batch, KV head, key block): head by head, longest lists first
    bhk = item // TK
    kblk = item - bhk * TK
    b = bhk // HK
    hk = bhk - b * HK
    kv_head = b.to(tl.int64) * k_b + hk.to(tl.int64) * k_h
    keys, key_ok = chunk_rows(kblk, pid - slot * K_SPLIT, BLOCK_K, TILE_K, NK)
    dim = tl.arange(0, BD)
    k = load_tile(K + kv_head, keys, k_n, dim, key_ok, D, BD, MASK_K)
    v = load_tile(V + kv_head, keys, k_n, dim, key_ok, D, BD, MASK_K)
    dk = tl.zeros([BN, BD], tl.float32)
    dv = tl.zeros([BN, BD], tl.float32)
    for g in range(GROUP):
        h = hk * GROUP + g
        bh = (b * H + h).to(tl.int64)
        q_head = b.to(tl.int64) * q_b + h.to(tl.int64) * q_h
        lo = tl.load(OFFSETS + bh * (TK + 1) + kblk)
        hi = tl.load(OFFSETS + bh * (TK + 1) + kblk + 1)
        members = ROWS + bh * TQ * TOPK
        for e in tl.range(0, list_steps(lo, hi, Q_SPLIT, Q_GROUP), num_stages=STAGES):
            rows, row_ok = list_rows(members, lo, hi, e, NQ, BLOCK_Q, TILE_Q, Q_SPLIT, Q_GROUP)
            q = load_tile(Q + q_head, rows, q_n, dim, row_ok, D, BD, MASK_Q)
            do = load_tile(DO + q_head, rows, q_n, dim, row_ok, D, BD, MASK_Q)
            # padded query rows (and with Q_GROUP > 1 the slots past the list) load q = dO = 0 and
            # lse = delta = 0: their P^T = 1 meets dO = 0 and dS^T = 0 meets q = 0, so they add nothing
            if MASK_Q:
                lse2 = tl.load(LSE + bh * NQ + rows, mask=row_ok, other=0.0) * LOG2E
                delta = tl.load(DELTA + bh * NQ + rows, mask=row_ok, other=0.0)
            else:
                lse2 = tl.load(LSE + bh * NQ + rows) * LOG2E
                delta = tl.load(DELTA + bh * NQ + rows)
            p_t = tl.exp2(mm(k, tl.trans(q), IEEE) * SCALE2 - lse2[None, :])
            dv += mm(p_t.to(do.dtype), do, IEEE)
            ds_t = p_t * (mm(v, tl.trans(do), IEEE) - delta[None, :])
            dk += mm(ds_t.to(q.dtype), q, IEEE)
    store_tile(DK + kv_head, dk * SCALE, keys, k_n, dim, key_ok, D, BD, MASK_K)
    store_tile(DV + kv_head, dv, keys, k_n, dim, key_ok, D, BD, MASK_K)


def backward_tiles(device: torch.device, d: int, dtype: torch.dtype) -> dict:
    """Tile caps, warps and stages of the two backward kernels, with ``tiles.overrides("block_bwd")``:
    ``DQ_BM``/``DQ_BN`` (query/key tile of dQ), ``DQ_KB`` (key blocks per step of dQ), ``DKV_BN``/``DKV_BM``
    (key/query tile of dK/dV), ``DKV_QB`` (query blocks per step of dK/dV). fp32: narrow tiles, 8 warps.
    dK/dV runs on 4 warps up to D = 128: at D = 128 its 64-key tile on 8 warps splits every product's N over
    two warpgroups (64x32 wgmma, 1 CTA per SM) and took 7.4-7.9 ms against 3.9-4.1 on 4 warps (some spills, 2
    CTAs per SM) at the public SLA shape on an H200."""
    if device.type == "cpu":
        base = dict(DQ_BM=16, DQ_BN=16, DQ_KB=1, DKV_BN=16, DKV_BM=16, DKV_QB=1, dq_warps=4, dq_stages=1,
                    dkv_warps=4, dkv_stages=1)
    elif dtype == torch.float32:
        base = dict(DQ_BM=64, DQ_BN=32, DQ_KB=1, DKV_BN=64, DKV_BM=32, DKV_QB=1, dq_warps=8, dq_stages=2,
                    dkv_warps=8, dkv_stages=2)
    else:
        wide = d > 64
        base = dict(DQ_BM=64, DQ_BN=64, DQ_KB=1, DKV_BN=64, DKV_BM=64, DKV_QB=1, dq_warps=4,
                    dq_stages=2 if wide else 3, dkv_warps=8 if d > 128 else 4, dkv_stages=2)
    return with_overrides("block_bwd", base)


def longest_first(offsets: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Order of the dK/dV programs: ``(B * Hk * Tk,)`` int32 ids ``(b * Hk + hk) * Tk + key block``, head by
    head (programs in flight share one head's Q and dO in L2), within a head by descending work (the CSC
    list lengths summed over its query heads), so that popular key blocks (long lists) start first."""
    bsz, heads, width = offsets.shape
    counts = offsets[:, :, 1:] - offsets[:, :, :-1]
    if heads != kv_heads:
        counts = counts.view(bsz, kv_heads, heads // kv_heads, width - 1).sum(2)
    order = torch.argsort(counts, dim=-1, descending=True, stable=True)
    first = torch.arange(0, bsz * kv_heads * (width - 1), width - 1, dtype=torch.int32, device=offsets.device)
    ids = torch.empty(order.shape, dtype=torch.int32, device=offsets.device)
    return torch.add(order, first.view(bsz, kv_heads, 1), out=ids).flatten()     # int32 ids in one op


def program_order(offsets: torch.Tensor, kv_heads: int, split: int, entries: int) -> torch.Tensor:
    """The dK/dV programs' order (``split`` programs per key block, ``entries`` CSC entries in all): the identity
    (``identity_order``: no op in an eager call, where the sort is five) for a call of fewer than
    ``SORTED_FROM_ENTRIES`` entries, whose host time exceeds what an order could save, or where the whole grid fits
    the device's SMs at once, so that the order cannot matter; else ``longest_first``. A symbolic size takes the sort
    (``sizes.static``). B2 H8 N4096 and N16384 D64 bf16 forward+backward, sorted against identity (H200, ms): `sla`
    2.10 / 1.94 and 2.91 / 2.29 (53248 entries), `topk` 1.47 / 1.15 and 1.39 / 1.17, `sla2` 2.42 / 2.20 and `vsa`
    2.47 / 2.02 at N4096."""
    items = offsets.shape[0] * kv_heads * (offsets.shape[2] - 1)
    if static(items, entries) and (entries < SORTED_FROM_ENTRIES
                                   or offsets.is_cuda and items * split <= sm_count(offsets.device)):
        return identity_order(items, offsets)
    return longest_first(offsets, kv_heads)


def identity_order(items: int, like: torch.Tensor) -> torch.Tensor:
    """``arange(items)`` int32 on ``like``'s device, kept per size and device (``masks.kept_constant``), so an eager
    backward launches no op for it."""
    return kept_constant(("identity_order", items), like,
                         lambda device: torch.arange(items, dtype=torch.int32, device=device))


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of the CUDA ``device``."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def dkv_blocks(indices: torch.Tensor, block_q: int, nq: int, tile: int) -> tuple[torch.Tensor, int]:
    """The index table ``(B, H, Tq, K)`` on query blocks of at most ``tile`` rows (the dK/dV kernel's query tile,
    ``backward_tiles``' ``DKV_BM``) and their size: a block of several whole tiles becomes one block per tile with
    its row. The dK/dV kernel walks the same tiles either way, but over the CSC of 128-row blocks (two tiles per
    entry) it takes 3.92 ms against 3.70 on this table's CSC (B2 H16 N32760 D128, 25 of 512 blocks, H200; the
    Gluon D=64 kernel 3.50 against 3.48)."""
    if block_q <= tile or block_q % tile:
        return indices, block_q
    return repeat_rows(indices, block_q // tile)[:, :, :cdiv(nq, tile)].contiguous(), tile


def block_backward(do, dlse, q, k, v, indices, offsets, rows, o, lse, block_q: int, block_k: int, scale: float,
                   tiles: dict | None = None, dkv_block_q: int | None = None):
    """Gradients ``(dq, dk, dv)`` of ``fwd.block_forward`` in the input dtypes.

    Shapes as there; do like q (same strides); dlse ``(B, H, Nq)`` fp32 or None; o, lse: the forward's
    outputs; offsets ``(B, H, Tk + 1)``, rows ``(B, H, Tq' * K)``: the CSC (``csc.block_csc``) of indices on
    query blocks of ``dkv_block_q`` rows (default ``block_q``; ``dkv_blocks``' table, ``Tq'`` its blocks).
    """
    bsz, heads, nq, d = q.shape
    kv_heads, nk = k.shape[1], k.shape[2]
    tq, topk = indices.shape[2], indices.shape[3]
    tk = offsets.shape[2] - 1
    dkv_block_q = dkv_block_q or block_q
    gluon = block_bwd_ws is not None and tiles is None and not overrides("block_bwd")
    gluon_dq = (gluon and d in WS_DQ_HEAD_DIMS and block_fwd_ws.supported(q, k, v, indices, block_q, block_k)
                and do.is_contiguous() and o.is_contiguous())
    gluon_dkv = (gluon and d in WS_DKV_HEAD_DIMS and block_bwd_ws.supported(q, k, v, do, dkv_block_q, block_k)
                 and block_q // 64 * tq * topk >= WS_DKV_MIN_STEPS * tk)
    tiles = tiles or backward_tiles(q.device, d, q.dtype)
    common = dict(D=d, BD=pow2(d, 16), SCALE2=float(scale * LOG2E.value), SCALE=float(scale),
                  IEEE=q.dtype == torch.float32)
    strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2))
    if gluon_dq:
        run = block_bwd_ws.ws_dq if launching_directly() else block_bwd_ws.block_dq_ws
        dq, delta = run(q, k, v, do, o, lse, dlse, indices, block_q, scale)
    else:
        dq = torch.empty_like(q)
        delta = torch.empty_like(lse)
        geo = geometry(block_q, block_k, nq, nk, tiles["DQ_BM"], tiles["DQ_BN"], topk, k_group=tiles["DQ_KB"])
        launcher(_block_dq_kernel)[(tq * geo["Q_SPLIT"], bsz * heads)](
            q, k, v, indices, o, do, lse, dlse if dlse is not None else lse, delta, dq, *strides,
            heads, heads // kv_heads, nq, nk, tq, topk, HAS_DLSE=dlse is not None, STAGES=tiles["dq_stages"],
            num_warps=tiles["dq_warps"], num_stages=tiles["dq_stages"], **geo, **common)
    if gluon_dkv:
        run = block_bwd_ws.ws_dkv if launching_directly() else block_bwd_ws.block_dkv_ws
        order = program_order(offsets, kv_heads, 1, rows.numel())
        dk, dv = run(q, k, v, do, lse, delta, offsets, rows, order, dkv_block_q, scale)
        return dq, dk, dv
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    geo = geometry(dkv_block_q, block_k, nq, nk, tiles["DKV_BM"], tiles["DKV_BN"], topk, q_group=tiles["DKV_QB"])
    order = program_order(offsets, kv_heads, geo["K_SPLIT"], rows.numel())
    launcher(_block_dkv_kernel)[(bsz * kv_heads * tk * geo["K_SPLIT"],)](
        q, k, v, do, lse, delta, offsets, rows, order, dk, dv, *strides,
        heads, kv_heads, heads // kv_heads, nq, nk, cdiv(nq, dkv_block_q), tk, topk, STAGES=tiles["dkv_stages"],
        num_warps=tiles["dkv_warps"], num_stages=tiles["dkv_stages"], **geo, **common)
    return dq, dk, dv
