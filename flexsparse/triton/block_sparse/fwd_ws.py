"""Block-sparse attention forward for Hopper in Gluon: a TMA producer warp and one wgmma consumer partition.

Same contract as ``fwd.block_forward`` for 64-token key blocks, head dims 64 and 128, bf16 / fp16 and
contiguous ``(B, H, N, D)`` tensors (``supported``); ragged tails are masked (keys past ``Nk`` get -inf logits,
rows past ``Nq`` are not stored). One program per query tile of ``BM`` rows (64; 128 possible for query blocks
of 128 and more) for one (batch, query head):

* the producer (1 warp, 24 registers) loads the Q tile once and then, per selected key block, its K and V tiles
  through TMA (2D descriptors over the flattened ``(B * H * N, D)`` tensors) into a ring of ``STAGES``
  shared-memory slots (``ready`` / ``empty`` mbarriers per slot);
* the consumer (``BM / 16`` warps) runs the online softmax in log2 units with ``Q K_j^T`` and
  ``P_{j-1} V_{j-1}`` issued back to back, so that ``P V`` runs on the tensor cores while the softmax of
  tile j does, and stores O and the natural-log LSE.

Triton's own pipeliner cannot warp-specialize gathered loads on sm_90 (``tl.range(..., warp_specialize=True)``
fails there: docs/triton_blocks.md). The sums run in the Triton kernel's order: outputs agree bitwise on
the measured shapes. Not traceable by ``torch.compile`` (``wrap_triton`` takes no Gluon kernel): compiled
graphs call it as the opaque custom op ``flexsparse::block_attn_ws``.
"""
from __future__ import annotations

import dataclasses
import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .._runtime.registry import launcher

LOG2E = 1.4426950408889634


@gluon.constexpr_function
def mma_layout(num_warps, cols):
    """The wgmma accumulator layout of a tile of ``cols`` columns on ``num_warps`` warps (16 rows per warp)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, cols, 16])


@gluon.jit
def _barriers(STAGES: gl.constexpr):
    """Initialised mbarriers: one for the tiles loaded once, and ``ready`` / ``empty`` per slot of a ring."""
    once = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(once, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    fence_async_shared()
    return once, ready, empty


@gluon.jit
def _load_two(a_desc, b_desc, a_smem, b_smem, bar, row):
    """TMA loads of the ``row ...`` tiles of two descriptors, completing ``bar``."""
    mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(a_desc, [row, 0], bar, a_smem)
    tma.async_copy_global_to_shared(b_desc, [row, 0], bar, b_smem)


@gluon.jit
def _fill_slot(a_desc, b_desc, a_bufs, b_bufs, ready, empty, step, row):
    """Step ``step`` of a ring: once its slot is free, the ``row ...`` tiles of both descriptors into it."""
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    slot = step % STAGES
    mbarrier.wait(empty.index(slot), ((step // STAGES) & 1) ^ 1)
    _load_two(a_desc, b_desc, a_bufs.index(slot), b_bufs.index(slot), ready.index(slot), row)


@gluon.jit
def _producer(q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_bar, ready, empty, idx_ptr, q_row, kv_row,
              n_steps, BLOCK_K: gl.constexpr):
    """Q once, then the K and V tiles of the row's blocks into the ring of slots."""
    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_row, 0], q_bar, q_smem)
    for e in range(n_steps):
        _fill_slot(k_desc, v_desc, k_bufs, v_bufs, ready, empty, e, kv_row + gl.load(idx_ptr + e) * BLOCK_K)


@gluon.jit
def _mask_tail(s, idx_ptr, e, NK, BLOCK_K: gl.constexpr, s_layout: gl.constexpr):
    """Logits of keys past ``NK`` (in the ragged last block) set to -inf in the scores ``s`` of step e."""
    first = gl.load(idx_ptr + e) * BLOCK_K
    if first + BLOCK_K > NK:
        cols = first + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, s_layout))
        s = gl.where(gl.expand_dims(cols < NK, 0), s, float("-inf"))
    return s


@gluon.jit
def _softmax(s, m_i, l_i, SCALE2: gl.constexpr):
    """Online-softmax step on the raw scores ``s (BM, BN)``: ``(p, m, l, alpha)`` (every row has a real key)."""
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * SCALE2)
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s * SCALE2 - gl.expand_dims(m_new, 1))
    return p, m_new, l_i * alpha + gl.sum(p, axis=1), alpha


@gluon.jit
def attend(q_smem, k_bufs, v_bufs, q_bar, ready, empty, idx_ptr, NK, n_steps, BLOCK_K: gl.constexpr,
           SCALE2: gl.constexpr, num_warps: gl.constexpr):
    """The online softmax over the ring's tiles: ``Q K_j^T`` and ``P_{j-1} V_{j-1}`` issued back to back, the
    softmax of tile j while ``P_{j-1} V_{j-1}`` runs. Returns ``(acc, m, l)``: the unnormalised O (``mma_layout``
    of D columns) and the rows' max and sum (log2 units), every slot released.
    (Issuing ``Q K_{j+1}^T`` before the softmax of tile j as well, FlashAttention-3's full schedule with
    separate K and V rings, measured slower: 2.06 against 1.81 ms at B2 H16 N32760 D128 K=25, H200.)"""
    BM: gl.constexpr = q_smem.type.shape[0]
    D: gl.constexpr = q_smem.type.shape[1]
    STAGES: gl.constexpr = k_bufs.type.shape[0]
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = mma_layout(num_warps, BLOCK_K)
    o_layout: gl.constexpr = mma_layout(num_warps, D)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    zeros = gl.zeros([BM, BLOCK_K], gl.float32, s_layout)
    m_i = gl.full([BM], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([BM], gl.float32, row_s)
    acc = gl.zeros([BM, D], gl.float32, o_layout)

    mbarrier.wait(q_bar, 0)
    mbarrier.wait(ready.index(0), 0)
    s = warpgroup_mma(q_smem, k_bufs.index(0).permute((1, 0)), zeros, use_acc=False, is_async=True)
    s = _mask_tail(warpgroup_mma_wait(num_outstanding=0, deps=(s, )), idx_ptr, 0, NK, BLOCK_K, s_layout)
    p, m_i, l_i, alpha = _softmax(s, m_i, l_i, SCALE2)
    for e in range(1, n_steps):
        slot = e % STAGES
        prev = (e - 1) % STAGES
        mbarrier.wait(ready.index(slot), (e // STAGES) & 1)
        s = warpgroup_mma(q_smem, k_bufs.index(slot).permute((1, 0)), zeros, use_acc=False, is_async=True)
        pv = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), v_bufs.index(prev), acc, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s, ))  # groups complete in order: P V may still run
        p, m_i, l_i, alpha = _softmax(_mask_tail(s, idx_ptr, e, NK, BLOCK_K, s_layout), m_i, l_i, SCALE2)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(pv, ))
        mbarrier.arrive(empty.index(prev), count=1)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
    last = (n_steps - 1) % STAGES
    acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), v_bufs.index(last), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    mbarrier.arrive(empty.index(last), count=1)
    return acc, m_i, l_i


@gluon.jit
def store_rows(ptr, x, q_row, q_first, NQ):
    """The rows of the ``(BM, D)`` tile ``x`` (first row ``q_row`` of the flattened ``(B * H * N, D)`` tensor at
    ``ptr``) whose token ``q_first + row`` lies below ``NQ``."""
    BM: gl.constexpr = x.type.shape[0]
    D: gl.constexpr = x.type.shape[1]
    layout: gl.constexpr = x.type.layout
    local = gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
    ptrs = ptr + gl.expand_dims((q_row + local).to(gl.int64) * D, 1) + gl.expand_dims(cols, 0)
    gl.store(ptrs, x, mask=gl.expand_dims(q_first + local < NQ, 1))


@gluon.jit
def store_lse(lse_ptr, m_i, l_i, q_row, q_first, NQ):
    """The natural-log LSE of the rows below ``NQ`` from the softmax's max and sum (log2 units)."""
    BM: gl.constexpr = m_i.type.shape[0]
    local = gl.arange(0, BM, layout=m_i.type.layout)
    gl.store(lse_ptr + q_row + local, (m_i + gl.log2(l_i)) * 0.6931471805599453, mask=q_first + local < NQ)


@gluon.jit
def _consumer(q_smem, k_bufs, v_bufs, q_bar, ready, empty, o_ptr, lse_ptr, idx_ptr, q_row, q_first, NQ, NK,
              n_steps, BLOCK_K: gl.constexpr, SCALE2: gl.constexpr, num_warps: gl.constexpr):
    """``attend``, then the rows of O and LSE below ``NQ``."""
    acc, m_i, l_i = attend(q_smem, k_bufs, v_bufs, q_bar, ready, empty, idx_ptr, NK, n_steps, BLOCK_K, SCALE2,
                           num_warps)
    row_o: gl.constexpr = gl.SliceLayout(1, acc.type.layout)
    store_rows(o_ptr, (acc / gl.expand_dims(gl.convert_layout(l_i, row_o), 1)).to(q_smem.dtype), q_row, q_first, NQ)
    store_lse(lse_ptr, m_i, l_i, q_row, q_first, NQ)


@gluon.jit
def program_tile(H, GROUP, NQ, NK, BLOCK_Q: gl.constexpr, Q_SPLIT: gl.constexpr, BM: gl.constexpr):
    """This program's query tile: ``(bh, h, qblk, q_first, q_row, kv_row)`` (batch x head, head, query block,
    first row of the tile within its head and in the flattened q, first row of its KV head in k and v)."""
    pid = gl.program_id(0)
    bh = gl.program_id(1)
    b = bh // H
    h = bh - b * H
    qblk = pid // Q_SPLIT
    q_first = qblk * BLOCK_Q + (pid - qblk * Q_SPLIT) * BM
    return bh, h, qblk, q_first, bh * NQ + q_first, (b * (H // GROUP) + h // GROUP) * NK


@gluon.jit
def allocate_ring(q_desc, k_desc, v_desc, STAGES: gl.constexpr, BLOCK_K: gl.constexpr):
    """Shared memory of the Q tile and of the K / V ring, and its barriers (``_barriers``)."""
    D: gl.constexpr = q_desc.block_type.shape[1]
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [q_desc.block_type.shape[0], D], q_desc.layout)
    k_bufs = gl.allocate_shared_memory(q_desc.dtype, [STAGES, BLOCK_K, D], k_desc.layout)
    v_bufs = gl.allocate_shared_memory(q_desc.dtype, [STAGES, BLOCK_K, D], v_desc.layout)
    q_bar, ready, empty = _barriers(STAGES)
    return q_smem, k_bufs, v_bufs, q_bar, ready, empty


@gluon.jit
def _ws_fwd_kernel(q_desc, k_desc, v_desc, o_ptr, lse_ptr, idx_ptr, H, GROUP, NQ, NK, TQ, TOPK,
                   BLOCK_Q: gl.constexpr, BLOCK_K: gl.constexpr, Q_SPLIT: gl.constexpr, SCALE2: gl.constexpr,
                   STAGES: gl.constexpr, num_warps: gl.constexpr):
    bh, h, qblk, q_first, q_row, kv_row = program_tile(H, GROUP, NQ, NK, BLOCK_Q, Q_SPLIT, q_desc.block_type.shape[0])
    idx = idx_ptr + (bh.to(gl.int64) * TQ + qblk) * TOPK
    q_smem, k_bufs, v_bufs, q_bar, ready, empty = allocate_ring(q_desc, k_desc, v_desc, STAGES, BLOCK_K)

    gl.warp_specialize([
        (_consumer, (q_smem, k_bufs, v_bufs, q_bar, ready, empty, o_ptr, lse_ptr, idx, q_row, q_first, NQ, NK,
                     TOPK, BLOCK_K, SCALE2, num_warps)),
        (_producer, (q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_bar, ready, empty, idx, q_row, kv_row,
                     TOPK, BLOCK_K)),
    ], [1], [24])


def supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor, block_q: int,
              block_k: int) -> bool:
    """Whether ``ws_block_forward`` takes this call: CUDA sm_90, bf16/fp16, D in (64, 128), query blocks of 64 or
    a multiple of 128 rows, key blocks of 64, contiguous tensors, at least one block per row (any token counts:
    ragged tails are masked)."""
    if q.device.type != "cuda" or torch.cuda.get_device_capability(q.device)[0] != 9:
        return False
    return (q.dtype in (torch.bfloat16, torch.float16) and q.shape[3] in (64, 128) and block_k == 64
            and (block_q == 64 or block_q % 128 == 0) and indices.shape[3] > 0
            and all(t.is_contiguous() for t in (q, k, v, indices)))


def default_tiles(d: int) -> dict:
    """Slots of the K/V ring, register cap per thread (the partitions share it out; 80 at D=64 lets three
    programs share an SM) and query-tile rows: the fastest measured (H200, B2 H8 N65536 D64 K=51 and B2 H16
    N32768 D128 K=25, 64x64 and 128x64 blocks; 64-row tiles also for 128-row query blocks: 1.28 against 1.35 ms
    at D=64, 1.84 against 2.30 at D=128)."""
    return dict(stages=4, maxnreg=80, bm=64) if d <= 64 else dict(stages=3, maxnreg=128, bm=64)


@functools.lru_cache(maxsize=None)
def shared_layout(rows: int, cols: int, dtype) -> gl.NVMMASharedLayout:
    """The default shared-memory layout of a ``(rows, cols)`` TMA tile of the Gluon ``dtype``, built once per
    shape and dtype (building one costs ~10 us of host time)."""
    return gl.NVMMASharedLayout.get_default_for([rows, cols], dtype)


_DESCRIPTOR_DEFAULTS = {field.name: field.default for field in dataclasses.fields(TensorDescriptor)
                        if field.default is not dataclasses.MISSING}


def descriptor(x: torch.Tensor, block_shape: list[int], layout: gl.NVMMASharedLayout) -> TensorDescriptor:
    """``TensorDescriptor.from_tensor(x, block_shape, layout)`` for a 2-D ``x`` without Triton's checks of its
    arguments in Python (~4 us of host time a descriptor on an H200 host): the kernels' shapes and layouts are fixed
    by their ``supported`` conditions, and the tensor's address and row stride are checked here (16-byte aligned, rows
    contiguous: what TMA needs)."""
    if x.data_ptr() % 16 or x.stride(1) != 1 or x.stride(0) * x.element_size() % 16:
        raise ValueError(f"a TMA descriptor needs a 16-byte aligned address and row stride and contiguous rows; got "
                         f"a {tuple(x.shape)} tensor at address {x.data_ptr()} with strides {x.stride()}")
    made = object.__new__(TensorDescriptor)
    made.__dict__.update(_DESCRIPTOR_DEFAULTS, base=x, shape=x.shape, strides=x.stride(), block_shape=block_shape,
                         layout=layout)
    return made


def descriptors(q, k, v, block_k: int, bm: int):
    """TMA descriptors of q (``(bm, D)`` tiles), k and v (``(block_k, D)`` tiles) over the flattened
    ``(B * H * N, D)`` tensors, and the Gluon dtype of q."""
    d = q.shape[-1]
    gl_dtype = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    q_desc = descriptor(q.view(-1, d), [bm, d], shared_layout(bm, d, gl_dtype))
    kv_layout = shared_layout(block_k, d, gl_dtype)
    k_desc = descriptor(k.view(-1, d), [block_k, d], kv_layout)
    v_desc = descriptor(v.view(-1, d), [block_k, d], kv_layout)
    return q_desc, k_desc, v_desc, gl_dtype


def ws_block_forward(q, k, v, indices, block_q: int, block_k: int, scale: float, stages: int | None = None,
                     maxnreg: int | None = None, bm: int | None = None):
    """O ``(B, H, Nq, D)`` in q's dtype and natural-log LSE ``(B, H, Nq)`` fp32, as ``fwd.block_forward``
    (see ``supported``). ``stages``, ``maxnreg`` and ``bm`` (64, or 128 for query blocks of 128 and more)
    default to ``default_tiles``."""
    bsz, heads, nq, d = q.shape
    tq, topk = indices.shape[2], indices.shape[3]
    tiles = default_tiles(d)
    stages, maxnreg, bm = stages or tiles["stages"], maxnreg or tiles["maxnreg"], bm or tiles["bm"]
    q_desc, k_desc, v_desc, _ = descriptors(q, k, v, block_k, bm)
    o = torch.empty_like(q)
    lse = q.new_empty(bsz, heads, nq, dtype=torch.float32)
    launcher(_ws_fwd_kernel)[(tq * (block_q // bm), bsz * heads)](
        q_desc, k_desc, v_desc, o, lse, indices, heads, heads // k.shape[1], nq, k.shape[2], tq, topk,
        BLOCK_Q=block_q, BLOCK_K=block_k, Q_SPLIT=block_q // bm, SCALE2=float(scale * LOG2E), STAGES=stages,
        num_warps=bm // 16, maxnreg=maxnreg)
    return o, lse


@torch.library.custom_op("flexsparse::block_attn_ws", mutates_args=())
def block_attn_ws(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor, block_q: int,
                  block_k: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``ws_block_forward`` as an opaque custom op (its kernel is launched directly, not traced by
    ``torch.compile``: ``wrap_triton`` does not take Gluon kernels)."""
    return ws_block_forward(q, k, v, indices, block_q, block_k, scale)


@block_attn_ws.register_fake
def _block_attn_ws_fake(q, k, v, indices, block_q, block_k, scale):
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)
