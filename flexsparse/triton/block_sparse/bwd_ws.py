"""Block-sparse attention backward for Hopper in Gluon: dK/dV (``ws_dkv``) and dQ (``ws_dq``), each a TMA
producer warp and one wgmma consumer warpgroup (``bwd`` picks them per head dim: ``WS_DKV_HEAD_DIMS``,
``WS_DQ_HEAD_DIMS``).

dK/dV: ``bwd``'s ``_block_dkv_kernel`` for 64-token key blocks without GQA, head dims 64 and 128, bf16 /
fp16 and contiguous tensors (``supported``). One program per key block and (batch, head), in
``bwd.longest_first`` order:

* the producer (1 warp) loads the key block's K and V tiles once, then per entry of its CSC list (the query
  blocks that selected it, ``Q_SPLIT`` tiles of 64 rows each) the Q and dO tiles through TMA into a ring of
  ``STAGES`` shared-memory slots;
* the consumer (4 warps) issues ``S^T = K Q^T`` and ``dP^T = V dO^T`` of tile t and then ``dV += P^T dO`` and
  ``dK += dS^T Q`` of tile t-1, so that the last two run on the tensor cores while the exponentials and
  ``dS^T = P^T (dP^T - Delta)`` of tile t do (tile -1 is a zero ``P^T``). Query rows past ``Nq`` get
  ``P^T = dS^T = 0``; key rows past ``Nk`` are not stored. The list order fixes the summation order, so dK/dV
  are reproducible under a deterministic CSC.

dQ: ``bwd``'s ``_block_dq_kernel`` (GQA included) with the same structure as ``fwd_ws``: Q and dO
once, K and V per selected block; ``S``, ``dP`` of tile t issued before ``dQ += dS K`` of tile t-1. It also
stores ``Delta = rowsum(O dO) - dLSE``.

Both are launched directly, or as the opaque custom ops ``flexsparse::block_dkv_ws`` / ``block_dq_ws`` under
``torch.compile``.
"""
from __future__ import annotations

from typing import Optional

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

from .fwd_ws import (LOG2E, _barriers, _fill_slot, _load_two, _mask_tail, descriptor, mma_layout, program_tile,
                     shared_layout)
from .._runtime.registry import launcher
from .._runtime.sizes import cdiv


@gluon.jit
def _dkv_producer(q_desc, do_desc, k_desc, v_desc, k_smem, v_smem, q_bufs, do_bufs, kv_bar, ready, empty,
                  members, q_head_row, k_row, n_steps, BLOCK_Q: gl.constexpr, Q_SPLIT: gl.constexpr):
    """K and V once, then the Q and dO tiles of the list's steps into the ring of slots."""
    BM: gl.constexpr = q_desc.block_type.shape[0]
    _load_two(k_desc, v_desc, k_smem, v_smem, kv_bar, k_row)
    for t in range(n_steps):
        row = q_head_row + gl.load(members + t // Q_SPLIT) * BLOCK_Q + (t % Q_SPLIT) * BM
        _fill_slot(q_desc, do_desc, q_bufs, do_bufs, ready, empty, t, row)


@gluon.jit
def _dkv_consumer(k_smem, v_smem, q_bufs, do_bufs, kv_bar, ready, empty, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
                  members, stats_row, k_row, k_first, NQ, NK, n_steps, BLOCK_Q: gl.constexpr,
                  Q_SPLIT: gl.constexpr, SCALE2: gl.constexpr, SCALE: gl.constexpr, num_warps: gl.constexpr):
    BN: gl.constexpr = k_smem.type.shape[0]
    D: gl.constexpr = k_smem.type.shape[1]
    BM: gl.constexpr = q_bufs.type.shape[1]
    STAGES: gl.constexpr = q_bufs.type.shape[0]
    dtype: gl.constexpr = k_smem.dtype
    s_layout: gl.constexpr = mma_layout(num_warps, BM)
    g_layout: gl.constexpr = mma_layout(num_warps, D)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=g_layout, k_width=2)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)

    zeros = gl.zeros([BN, BM], gl.float32, s_layout)
    p_op = gl.zeros([BN, BM], dtype, a_layout)
    ds_op = gl.zeros([BN, BM], dtype, a_layout)
    dk = gl.zeros([BN, D], gl.float32, g_layout)
    dv = gl.zeros([BN, D], gl.float32, g_layout)
    cols = gl.arange(0, BM, layout=col_s)
    mbarrier.wait(kv_bar, 0)
    for t in range(n_steps):
        slot = t % STAGES
        prev = gl.where(t > 0, (t + STAGES - 1) % STAGES, slot)  # step -1: a zero P^T on this step's tiles
        first = gl.load(members + t // Q_SPLIT) * BLOCK_Q + (t % Q_SPLIT) * BM
        row_ok = first + cols < NQ
        lse2 = gl.load(lse_ptr + stats_row + first + cols, mask=row_ok, other=0.0) * 1.4426950408889634
        delta = gl.load(delta_ptr + stats_row + first + cols, mask=row_ok, other=0.0)
        mbarrier.wait(ready.index(slot), (t // STAGES) & 1)
        s_t = warpgroup_mma(k_smem, q_bufs.index(slot).permute((1, 0)), zeros, use_acc=False, is_async=True)
        dp_t = warpgroup_mma(v_smem, do_bufs.index(slot).permute((1, 0)), zeros, use_acc=False, is_async=True)
        dv_next = warpgroup_mma(p_op, do_bufs.index(prev), dv, is_async=True)
        dk_next = warpgroup_mma(ds_op, q_bufs.index(prev), dk, is_async=True)
        s_t, dp_t = warpgroup_mma_wait(num_outstanding=2, deps=(s_t, dp_t))  # groups complete in issue order
        p_t = gl.exp2(s_t * SCALE2 - gl.expand_dims(lse2, 0))
        p_t = gl.where(gl.expand_dims(row_ok, 0), p_t, 0.0)
        ds_t = p_t * (dp_t - gl.expand_dims(delta, 0))
        dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=(dv_next, dk_next))
        mbarrier.arrive(empty.index(prev), count=1, pred=t > 0)
        p_op = gl.convert_layout(p_t.to(dtype), a_layout)
        ds_op = gl.convert_layout(ds_t.to(dtype), a_layout)
    if n_steps > 0:
        last = (n_steps - 1) % STAGES
        dv = warpgroup_mma(p_op, do_bufs.index(last), dv)
        dk = warpgroup_mma(ds_op, q_bufs.index(last), dk)

    rows = gl.arange(0, BN, layout=gl.SliceLayout(1, g_layout))
    dims = gl.arange(0, D, layout=gl.SliceLayout(0, g_layout))
    offs = gl.expand_dims((k_row + rows).to(gl.int64) * D, 1) + gl.expand_dims(dims, 0)
    ok = gl.expand_dims(k_first + rows < NK, 1)
    gl.store(dk_ptr + offs, (dk * SCALE).to(dtype), mask=ok)
    gl.store(dv_ptr + offs, dv.to(dtype), mask=ok)


@gluon.jit
def _ws_dkv_kernel(q_desc, do_desc, k_desc, v_desc, lse_ptr, delta_ptr, offsets_ptr, rows_ptr, order_ptr, dk_ptr,
                   dv_ptr, NQ, NK, TQ, TK, TOPK, BLOCK_Q: gl.constexpr, Q_SPLIT: gl.constexpr,
                   SCALE2: gl.constexpr, SCALE: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr):
    BM: gl.constexpr = q_desc.block_type.shape[0]
    BN: gl.constexpr = k_desc.block_type.shape[0]
    D: gl.constexpr = k_desc.block_type.shape[1]
    dtype: gl.constexpr = k_desc.dtype
    item = gl.load(order_ptr + gl.program_id(0))  # (batch * head) * TK + key block
    bh = item // TK
    kblk = item - bh * TK
    k_first = kblk * BN
    k_row = bh * NK + k_first
    lo = gl.load(offsets_ptr + bh.to(gl.int64) * (TK + 1) + kblk)
    hi = gl.load(offsets_ptr + bh.to(gl.int64) * (TK + 1) + kblk + 1)
    members = rows_ptr + bh.to(gl.int64) * TQ * TOPK + lo
    n_steps = (hi - lo) * Q_SPLIT

    k_smem = gl.allocate_shared_memory(dtype, [BN, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [BN, D], v_desc.layout)
    q_bufs = gl.allocate_shared_memory(dtype, [STAGES, BM, D], q_desc.layout)
    do_bufs = gl.allocate_shared_memory(dtype, [STAGES, BM, D], do_desc.layout)
    kv_bar, ready, empty = _barriers(STAGES)

    gl.warp_specialize([
        (_dkv_consumer, (k_smem, v_smem, q_bufs, do_bufs, kv_bar, ready, empty, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
                         members, bh * NQ, k_row, k_first, NQ, NK, n_steps, BLOCK_Q, Q_SPLIT, SCALE2, SCALE,
                         num_warps)),
        (_dkv_producer, (q_desc, do_desc, k_desc, v_desc, k_smem, v_smem, q_bufs, do_bufs, kv_bar, ready, empty,
                         members, bh * NQ, k_row, n_steps, BLOCK_Q, Q_SPLIT)),
    ], [1], [24])


@gluon.jit
def _dq_producer(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_bufs, v_bufs, q_bar, ready, empty, idx_ptr,
                 q_row, kv_row, n_steps):
    """Q and dO once, then the K and V tiles of the row's blocks into the ring of slots."""
    BN: gl.constexpr = k_desc.block_type.shape[0]
    _load_two(q_desc, do_desc, q_smem, do_smem, q_bar, q_row)
    for e in range(n_steps):
        _fill_slot(k_desc, v_desc, k_bufs, v_bufs, ready, empty, e, kv_row + gl.load(idx_ptr + e) * BN)


@gluon.jit
def _dq_consumer(q_smem, do_smem, k_bufs, v_bufs, q_bar, ready, empty, o_ptr, lse_ptr, dlse_ptr, delta_ptr, dq_ptr,
                 idx_ptr, q_row, q_first, NQ, NK, n_steps, HAS_DLSE: gl.constexpr, SCALE2: gl.constexpr,
                 SCALE: gl.constexpr, num_warps: gl.constexpr):
    BM: gl.constexpr = q_smem.type.shape[0]
    D: gl.constexpr = q_smem.type.shape[1]
    BN: gl.constexpr = k_bufs.type.shape[1]
    STAGES: gl.constexpr = k_bufs.type.shape[0]
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = mma_layout(num_warps, BN)
    g_layout: gl.constexpr = mma_layout(num_warps, D)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=g_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_g: gl.constexpr = gl.SliceLayout(1, g_layout)

    # Delta = rowsum(O dO) - dLSE of the tile's rows (stored for the dK/dV kernel) and the rows' LSE
    local = gl.arange(0, BM, layout=row_g)
    dims = gl.arange(0, D, layout=gl.SliceLayout(0, g_layout))
    row_ok = q_first + local < NQ
    offs = gl.expand_dims((q_row + local).to(gl.int64) * D, 1) + gl.expand_dims(dims, 0)
    o = gl.load(o_ptr + offs, mask=gl.expand_dims(row_ok, 1), other=0.0).to(gl.float32)
    mbarrier.wait(q_bar, 0)
    delta = gl.sum(o * do_smem.load(g_layout).to(gl.float32), axis=1)
    if HAS_DLSE:
        delta -= gl.load(dlse_ptr + q_row + local, mask=row_ok, other=0.0)
    gl.store(delta_ptr + q_row + local, delta, mask=row_ok)
    delta = gl.convert_layout(delta, row_s)
    local_s = gl.arange(0, BM, layout=row_s)
    lse2 = gl.load(lse_ptr + q_row + local_s, mask=q_first + local_s < NQ, other=0.0) * 1.4426950408889634

    zeros = gl.zeros([BM, BN], gl.float32, s_layout)
    ds_op = gl.zeros([BM, BN], dtype, a_layout)
    dq = gl.zeros([BM, D], gl.float32, g_layout)
    for e in range(n_steps):
        slot = e % STAGES
        prev = gl.where(e > 0, (e + STAGES - 1) % STAGES, slot)  # step -1: a zero dS on this step's tiles
        mbarrier.wait(ready.index(slot), (e // STAGES) & 1)
        s = warpgroup_mma(q_smem, k_bufs.index(slot).permute((1, 0)), zeros, use_acc=False, is_async=True)
        dp = warpgroup_mma(do_smem, v_bufs.index(slot).permute((1, 0)), zeros, use_acc=False, is_async=True)
        dq_next = warpgroup_mma(ds_op, k_bufs.index(prev), dq, is_async=True)
        s, dp = warpgroup_mma_wait(num_outstanding=1, deps=(s, dp))  # groups complete in issue order
        p = gl.exp2(_mask_tail(s, idx_ptr, e, NK, BN, s_layout) * SCALE2 - gl.expand_dims(lse2, 1))
        ds = p * (dp - gl.expand_dims(delta, 1))
        dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq_next, ))
        mbarrier.arrive(empty.index(prev), count=1, pred=e > 0)
        ds_op = gl.convert_layout(ds.to(dtype), a_layout)
    last = (n_steps - 1) % STAGES
    dq = warpgroup_mma(ds_op, k_bufs.index(last), dq)
    mbarrier.arrive(empty.index(last), count=1)
    gl.store(dq_ptr + offs, (dq * SCALE).to(dtype), mask=gl.expand_dims(row_ok, 1))


@gluon.jit
def _ws_dq_kernel(q_desc, do_desc, k_desc, v_desc, o_ptr, lse_ptr, dlse_ptr, delta_ptr, dq_ptr, idx_ptr, H, GROUP, NQ,
                  NK, TQ, TOPK, BLOCK_Q: gl.constexpr, Q_SPLIT: gl.constexpr, HAS_DLSE: gl.constexpr,
                  SCALE2: gl.constexpr, SCALE: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr):
    BM: gl.constexpr = q_desc.block_type.shape[0]
    BN: gl.constexpr = k_desc.block_type.shape[0]
    D: gl.constexpr = q_desc.block_type.shape[1]
    dtype: gl.constexpr = q_desc.dtype
    bh, h, qblk, q_first, q_row, kv_row = program_tile(H, GROUP, NQ, NK, BLOCK_Q, Q_SPLIT, BM)
    idx = idx_ptr + (bh.to(gl.int64) * TQ + qblk) * TOPK

    q_smem = gl.allocate_shared_memory(dtype, [BM, D], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [BM, D], do_desc.layout)
    k_bufs = gl.allocate_shared_memory(dtype, [STAGES, BN, D], k_desc.layout)
    v_bufs = gl.allocate_shared_memory(dtype, [STAGES, BN, D], v_desc.layout)
    q_bar, ready, empty = _barriers(STAGES)

    gl.warp_specialize([
        (_dq_consumer, (q_smem, do_smem, k_bufs, v_bufs, q_bar, ready, empty, o_ptr, lse_ptr, dlse_ptr, delta_ptr,
                        dq_ptr, idx, q_row, q_first, NQ, NK, TOPK, HAS_DLSE, SCALE2, SCALE, num_warps)),
        (_dq_producer, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_bufs, v_bufs, q_bar, ready, empty, idx,
                        q_row, kv_row, TOPK)),
    ], [1], [24])


def ws_dq(q, k, v, do, o, lse, dlse, indices, block_q: int, scale: float, stages: int = 2, maxnreg: int = 128):
    """``(dq, delta)``: dQ ``(B, H, Nq, D)`` in q's dtype and ``Delta = rowsum(O dO) - dLSE`` ``(B, H, Nq)`` fp32
    (``dlse`` None: no gradient reaches the LSE), as ``bwd``'s dQ kernel; takes what
    ``fwd_ws.supported`` takes (GQA included), with do and o contiguous like q."""
    bsz, heads, nq, d = q.shape
    tq, topk = indices.shape[2], indices.shape[3]
    gl_dtype = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    layout = shared_layout(64, d, gl_dtype)
    q_desc, do_desc, k_desc, v_desc = (descriptor(x.view(-1, d), [64, d], layout) for x in (q, do, k, v))
    dq, delta = torch.empty_like(q), torch.empty_like(lse)
    launcher(_ws_dq_kernel)[(tq * (block_q // 64), bsz * heads)](
        q_desc, do_desc, k_desc, v_desc, o, lse, lse if dlse is None else dlse, delta, dq, indices, heads,
        heads // k.shape[1], nq, k.shape[2], tq, topk, BLOCK_Q=block_q, Q_SPLIT=block_q // 64,
        HAS_DLSE=dlse is not None, SCALE2=float(scale * LOG2E), SCALE=float(scale), STAGES=stages, num_warps=4,
        maxnreg=maxnreg)
    return dq, delta


def supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, block_q: int,
              block_k: int) -> bool:
    """Whether ``ws_dkv`` takes this call: CUDA sm_90, bf16/fp16, D in (64, 128), no GQA, key blocks of 64,
    query blocks a multiple of 64, contiguous q, k, v and do."""
    if q.device.type != "cuda" or torch.cuda.get_device_capability(q.device)[0] != 9:
        return False
    return (q.dtype in (torch.bfloat16, torch.float16) and q.shape[3] in (64, 128) and q.shape[1] == k.shape[1]
            and block_k == 64 and block_q % 64 == 0 and all(t.is_contiguous() for t in (q, k, v, do)))


def default_tiles(d: int) -> dict:
    """Slots of the Q/dO ring and the register cap per thread of the launch (128: two programs per SM, no spill
    at D=64; D=128 spills at any cap and runs slower than the Triton kernel, ``bwd.WS_DKV_HEAD_DIMS``)."""
    return dict(stages=2, maxnreg=128) if d <= 64 else dict(stages=2, maxnreg=168)


def ws_dkv(q, k, v, do, lse, delta, offsets, rows, order, block_q: int, scale: float, stages: int | None = None,
           maxnreg: int | None = None):
    """``(dk, dv)`` ``(B, H, Nk, D)`` in k's dtype (see ``supported``): lse, delta ``(B, H, Nq)`` fp32 (``Delta =
    rowsum(O dO) - dLSE`` from the dQ kernel); offsets, rows: the CSC of the index table; order: the programs'
    ``(b * H + h) * Tk + key block`` ids (``bwd.longest_first``)."""
    bsz, heads, nq, d = q.shape
    nk = k.shape[2]
    tk, tq = offsets.shape[2] - 1, cdiv(q.shape[2], block_q)
    tiles = default_tiles(d)
    stages, maxnreg = stages or tiles["stages"], maxnreg or tiles["maxnreg"]
    gl_dtype = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    layout = shared_layout(64, d, gl_dtype)
    q_desc, do_desc, k_desc, v_desc = (descriptor(x.view(-1, d), [64, d], layout) for x in (q, do, k, v))
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    launcher(_ws_dkv_kernel)[(order.numel(),)](
        q_desc, do_desc, k_desc, v_desc, lse, delta, offsets, rows, order, dk, dv, nq, nk, tq, tk,
        rows.shape[2] // tq, BLOCK_Q=block_q, Q_SPLIT=block_q // 64, SCALE2=float(scale * LOG2E),
        SCALE=float(scale), STAGES=stages, num_warps=4, maxnreg=maxnreg)
    return dk, dv


@torch.library.custom_op("flexsparse::block_dkv_ws", mutates_args=())
def block_dkv_ws(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, lse: torch.Tensor,
                 delta: torch.Tensor, offsets: torch.Tensor, rows: torch.Tensor, order: torch.Tensor, block_q: int,
                 scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``ws_dkv`` as an opaque custom op (``torch.compile`` does not trace Gluon kernels)."""
    return ws_dkv(q, k, v, do, lse, delta, offsets, rows, order, block_q, scale)


@block_dkv_ws.register_fake
def _block_dkv_ws_fake(q, k, v, do, lse, delta, offsets, rows, order, block_q, scale):
    return torch.empty_like(k), torch.empty_like(v)


@torch.library.custom_op("flexsparse::block_dq_ws", mutates_args=())
def block_dq_ws(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, o: torch.Tensor,
                lse: torch.Tensor, dlse: Optional[torch.Tensor], indices: torch.Tensor, block_q: int,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``ws_dq`` as an opaque custom op (``torch.compile`` does not trace Gluon kernels)."""
    return ws_dq(q, k, v, do, o, lse, dlse, indices, block_q, scale)


@block_dq_ws.register_fake
def _block_dq_ws_fake(q, k, v, do, o, lse, dlse, indices, block_q, scale):
    return torch.empty_like(q), torch.empty_like(lse)
