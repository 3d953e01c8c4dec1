"""FP8 block-sparse attention forward for Hopper in Gluon: ``fwd_fp8``'s math on ``fwd_ws``'s warp-specialized
schedule (a TMA producer warp, one wgmma consumer partition).

Same contract as ``fwd_fp8.block_attend_fp8`` on ``fp8_quant.quantize_qkv``'s e4m3 tensors, for 64-token key
blocks, head dims 64 and 128 and query tiles of 64 rows (``supported``). Per step the producer loads the selected
key block's ``K8`` tile ``(64, D)`` and ``V8^T`` tile ``(D, 64)`` (keys contiguous, the K-major second operand that
fp8 ``wgmma`` wants) into a ring of shared-memory slots. The consumer computes raw ``s = Q8 K8^T`` (fp32), the
scalar factor ``c = scale log2(e) / (s_q s_k)``, ``p = exp2(s c - m + log2 448)`` (448 times the softmax
numerator: the e4m3 grid of P), ``l`` from the unquantized ``p``, and ``P8 V8`` from e4m3 ``p`` in registers,
issued after the next tile's ``Q K^T`` as in ``fwd_ws``. With ``FRESH_ACC`` each tile's ``P V`` starts from a zero
accumulator and is added in fp32 (the fp8 MMA's accumulator keeps fewer bits), as the Triton kernel does.
Epilogue ``o = acc / (l s_v)`` and LSE ``(m + log2 l - log2 448) ln 2 + scale (q8 . k_mean) / s_q``.
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from .._runtime.registry import launcher
from .._runtime.tiles import with_overrides
from . import fp8_quant
from .fp8_quant import permutes_keys
from .fwd_ws import LOG2E, _barriers, _mask_tail, descriptor, program_tile, shared_layout, store_rows

LOG2_448: gl.constexpr = gl.constexpr(8.807354922057604)
LN2: gl.constexpr = gl.constexpr(0.6931471805599453)


@gluon.constexpr_function
def mma_layout(num_warps, cols):
    """The fp8 wgmma accumulator layout of a tile of ``cols`` columns (16 rows per warp, a reduction of 32)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, cols, 32])


@gluon.jit
def producer(q_desc, k_desc, vt_desc, q_smem, k_bufs, v_bufs, q_bar, ready, empty, idx_ptr, q_row, kv_row, vt_row,
              n_steps, BLOCK_K: gl.constexpr):
    """Q8 once, then per step the K8 rows and V8^T columns of the row's key block into the ring of slots."""
    STAGES: gl.constexpr = k_bufs.type.shape[0]
    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_row, 0], q_bar, q_smem)
    for e in range(n_steps):
        slot = e % STAGES
        first = gl.load(idx_ptr + e) * BLOCK_K
        mbarrier.wait(empty.index(slot), ((e // STAGES) & 1) ^ 1)
        bar = ready.index(slot)
        mbarrier.expect(bar, k_desc.block_type.nbytes + vt_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [kv_row + first, 0], bar, k_bufs.index(slot))
        tma.async_copy_global_to_shared(vt_desc, [vt_row, first], bar, v_bufs.index(slot))


@gluon.constexpr_function
def operand_layout(num_warps, cols):
    """The register layout of P as the A operand of the fp8 ``P V`` wgmma with ``cols`` output columns."""
    return gl.DotOperandLayout(operand_index=0, parent=mma_layout(num_warps, cols), k_width=4)


@gluon.jit
def _initial_state(q_smem, BLOCK_K: gl.constexpr, num_warps: gl.constexpr):
    """The online softmax's start for the query tile ``q_smem (BM, D)``: ``(zeros, zeros_o, m, l, acc, alpha_prev)``,
    the zero score and output tiles the MMAs start from, the running max (-inf), the row sums, the accumulator and
    the pending rescale of a deferred one (ones)."""
    BM: gl.constexpr = q_smem.type.shape[0]
    D: gl.constexpr = q_smem.type.shape[1]
    s_layout: gl.constexpr = mma_layout(num_warps, BLOCK_K)
    o_layout: gl.constexpr = mma_layout(num_warps, D)
    return (gl.zeros([BM, BLOCK_K], gl.float32, s_layout), gl.zeros([BM, D], gl.float32, o_layout),
            gl.full([BM], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout)),
            gl.zeros([BM], gl.float32, gl.SliceLayout(1, s_layout)), gl.zeros([BM, D], gl.float32, o_layout),
            gl.full([BM], 1.0, gl.float32, gl.SliceLayout(1, o_layout)))


@gluon.jit
def _softmax(s, m_i, l_i, c):
    """Online-softmax step on raw scores ``s (BM, BN)`` with the step's factor ``c > 0``: ``(p, m, l, alpha)``,
    ``p`` on the e4m3 grid's scale (448 at the row max); every row has a real key."""
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * c)
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s * c - gl.expand_dims(m_new - LOG2_448, 1))
    return p, m_new, l_i * alpha + gl.sum(p, axis=1), alpha


permuted_columns = gluon.jit(fp8_quant.permuted_columns.fn)   # the Triton kernels', for Gluon


@gluon.jit
def operand_p(p, p_layout: gl.constexpr, PERMUTED: gl.constexpr):
    """e4m3 of P ``(BM, BLOCK_K)`` (the score accumulator's layout) as the A operand of ``P V`` (``p_layout``);
    with ``PERMUTED`` (V^T's keys in ``fp8_quant.key_slot`` order) its columns permuted alike, a relabelling that
    leaves every value in its thread (the conversion is checked trivial when the kernel compiles)."""
    p8 = p.to(gl.float8e4nv)
    if PERMUTED:
        x = permuted_columns(p8, p8.shape[0], p8.shape[1])
        return gl.convert_layout(x, p_layout, assert_trivial=True)
    else:
        return gl.convert_layout(p8, p_layout)


@gluon.jit
def attend(q_smem, k_bufs, v_bufs, q_bar, ready, empty, idx_ptr, kd_ptr, q_factor, NK, n_steps,
            BLOCK_K: gl.constexpr, FRESH_ACC: gl.constexpr, DEFER_RESCALE: gl.constexpr, PERMUTED: gl.constexpr,
            num_warps: gl.constexpr):
    """The online softmax over the ring's tiles (``fwd_ws.attend``'s schedule): ``(acc, m, l)``, every slot
    released. ``kd_ptr``: the reciprocal K scales of this KV head's key blocks; ``PERMUTED``: see ``operand_p``.
    With ``FRESH_ACC`` each step adds the previous tile's ``P V`` (relative to that tile's max) to ``acc``:
    ``(acc + pv) alpha`` (``acc`` relative to the latest max), or with ``DEFER_RESCALE`` ``acc alpha' + pv`` with
    the step before's ``alpha'`` (``acc`` one max behind): one FMA per element instead of an add and a multiply."""
    STAGES: gl.constexpr = k_bufs.type.shape[0]
    s_layout: gl.constexpr = mma_layout(num_warps, BLOCK_K)
    p_layout: gl.constexpr = operand_layout(num_warps, q_smem.type.shape[1])
    row_o: gl.constexpr = gl.SliceLayout(1, mma_layout(num_warps, q_smem.type.shape[1]))
    zeros, zeros_o, m_i, l_i, acc, alpha_prev = _initial_state(q_smem, BLOCK_K, num_warps)

    mbarrier.wait(q_bar, 0)
    mbarrier.wait(ready.index(0), 0)
    s = warpgroup_mma(q_smem, k_bufs.index(0).permute((1, 0)), zeros, use_acc=False, is_async=True)
    s = _mask_tail(warpgroup_mma_wait(num_outstanding=0, deps=(s, )), idx_ptr, 0, NK, BLOCK_K, s_layout)
    p, m_i, l_i, alpha = _softmax(s, m_i, l_i, q_factor * gl.load(kd_ptr + gl.load(idx_ptr)))
    for e in range(1, n_steps):
        slot = e % STAGES
        prev = (e - 1) % STAGES
        mbarrier.wait(ready.index(slot), (e // STAGES) & 1)
        s = warpgroup_mma(q_smem, k_bufs.index(slot).permute((1, 0)), zeros, use_acc=False, is_async=True)
        p8 = operand_p(p, p_layout, PERMUTED)
        if FRESH_ACC:
            pv = warpgroup_mma(p8, v_bufs.index(prev).permute((1, 0)), zeros_o, use_acc=False, is_async=True)
        else:
            pv = warpgroup_mma(p8, v_bufs.index(prev).permute((1, 0)), acc, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s, ))  # groups complete in order: P V may still run
        c = q_factor * gl.load(kd_ptr + gl.load(idx_ptr + e))
        p, m_i, l_i, alpha = _softmax(_mask_tail(s, idx_ptr, e, NK, BLOCK_K, s_layout), m_i, l_i, c)
        pv = warpgroup_mma_wait(num_outstanding=0, deps=(pv, ))
        mbarrier.arrive(empty.index(prev), count=1)
        if FRESH_ACC and DEFER_RESCALE:
            acc = acc * gl.expand_dims(alpha_prev, 1) + pv
            alpha_prev = gl.convert_layout(alpha, row_o)
        else:
            if FRESH_ACC:
                pv = acc + pv
            acc = pv * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
    last = (n_steps - 1) % STAGES
    p8 = operand_p(p, p_layout, PERMUTED)
    if FRESH_ACC:
        pv = warpgroup_mma(p8, v_bufs.index(last).permute((1, 0)), zeros_o, use_acc=False, is_async=True)
        if DEFER_RESCALE:
            acc = acc * gl.expand_dims(alpha_prev, 1)
        acc = acc + warpgroup_mma_wait(num_outstanding=0, deps=(pv, ))
    else:
        acc = warpgroup_mma(p8, v_bufs.index(last).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    mbarrier.arrive(empty.index(last), count=1)
    return acc, m_i, l_i


@gluon.jit
def _softmax_pair(s0, s1, m_i, l_i, c0, c1):
    """``_softmax`` on two key blocks' raw scores with their factors: ``(p0, p1, m, l, alpha)``."""
    m_new = gl.maximum(m_i, gl.maximum(gl.max(s0, axis=1) * c0, gl.max(s1, axis=1) * c1))
    alpha = gl.exp2(m_i - m_new)
    shift = gl.expand_dims(m_new - LOG2_448, 1)
    p0 = gl.exp2(s0 * c0 - shift)
    p1 = gl.exp2(s1 * c1 - shift)
    return p0, p1, m_new, l_i * alpha + gl.sum(p0 + p1, axis=1), alpha


@gluon.jit
def _pair_scores(q_smem, k_bufs, ready, idx_ptr, kd_ptr, q_factor, NK, e, zeros, BLOCK_K: gl.constexpr,
                 s_layout: gl.constexpr):
    """Issue ``Q K^T`` of key blocks e and e + 1 (slots ``e % STAGES`` and the next; STAGES even)."""
    STAGES: gl.constexpr = k_bufs.type.shape[0]
    slot = e % STAGES
    mbarrier.wait(ready.index(slot), (e // STAGES) & 1)
    mbarrier.wait(ready.index(slot + 1), ((e + 1) // STAGES) & 1)
    s0 = warpgroup_mma(q_smem, k_bufs.index(slot).permute((1, 0)), zeros, use_acc=False, is_async=True)
    s1 = warpgroup_mma(q_smem, k_bufs.index(slot + 1).permute((1, 0)), zeros, use_acc=False, is_async=True)
    return s0, s1


@gluon.jit
def _pair_softmax(s0, s1, m_i, l_i, idx_ptr, kd_ptr, q_factor, NK, e, BLOCK_K: gl.constexpr,
                  s_layout: gl.constexpr):
    """``_softmax_pair`` on the scores of key blocks e and e + 1: ``(p0, p1, m, l, alpha)``."""
    c0 = q_factor * gl.load(kd_ptr + gl.load(idx_ptr + e))
    c1 = q_factor * gl.load(kd_ptr + gl.load(idx_ptr + e + 1))
    s0 = _mask_tail(s0, idx_ptr, e, NK, BLOCK_K, s_layout)
    s1 = _mask_tail(s1, idx_ptr, e + 1, NK, BLOCK_K, s_layout)
    return _softmax_pair(s0, s1, m_i, l_i, c0, c1)


@gluon.jit
def attend_pairs(q_smem, k_bufs, v_bufs, q_bar, ready, empty, idx_ptr, kd_ptr, q_factor, NK, n_steps,
                 BLOCK_K: gl.constexpr, FRESH_ACC: gl.constexpr, PERMUTED: gl.constexpr, num_warps: gl.constexpr):
    """``attend`` on two key blocks per softmax step: the slots e and e + 1 (``check_ring``), one max, one ``alpha``
    and one accumulator update per 128 keys, ``P V`` of the pair as two chained wgmmas, into a fresh accumulator
    added with the deferred rescale (``FRESH_ACC``; the consumer spills at D = 128) or into ``acc`` rescaled first
    (the MMA's accumulator, as ``fresh_acc=False``); an odd last block takes a step of its own."""
    STAGES: gl.constexpr = k_bufs.type.shape[0]
    s_layout: gl.constexpr = mma_layout(num_warps, BLOCK_K)
    p_layout: gl.constexpr = operand_layout(num_warps, q_smem.type.shape[1])
    row_o: gl.constexpr = gl.SliceLayout(1, mma_layout(num_warps, q_smem.type.shape[1]))
    zeros, zeros_o, m_i, l_i, acc, alpha_prev = _initial_state(q_smem, BLOCK_K, num_warps)
    n_pairs = n_steps // 2

    mbarrier.wait(q_bar, 0)
    if n_pairs > 0:
        s0, s1 = _pair_scores(q_smem, k_bufs, ready, idx_ptr, kd_ptr, q_factor, NK, 0, zeros, BLOCK_K, s_layout)
        s0, s1 = warpgroup_mma_wait(num_outstanding=0, deps=(s0, s1))
        p0, p1, m_i, l_i, alpha = _pair_softmax(s0, s1, m_i, l_i, idx_ptr, kd_ptr, q_factor, NK, 0, BLOCK_K,
                                                s_layout)
        for j in range(1, n_pairs):
            e = 2 * j
            prev = (e - 2) % STAGES
            p0 = operand_p(p0, p_layout, PERMUTED)
            p1 = operand_p(p1, p_layout, PERMUTED)
            s0, s1 = _pair_scores(q_smem, k_bufs, ready, idx_ptr, kd_ptr, q_factor, NK, e, zeros, BLOCK_K, s_layout)
            if FRESH_ACC:
                pv = warpgroup_mma(p0, v_bufs.index(prev).permute((1, 0)), zeros_o, use_acc=False, is_async=True)
            else:                                   # acc at the pair's max, P V accumulated in the MMA
                acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
                pv = warpgroup_mma(p0, v_bufs.index(prev).permute((1, 0)), acc, is_async=True)
            pv = warpgroup_mma(p1, v_bufs.index(prev + 1).permute((1, 0)), pv, is_async=True)
            s0, s1 = warpgroup_mma_wait(num_outstanding=2, deps=(s0, s1))   # in order: the pair's P V may run
            p0, p1, m_i, l_i, alpha = _pair_softmax(s0, s1, m_i, l_i, idx_ptr, kd_ptr, q_factor, NK, e, BLOCK_K,
                                                    s_layout)
            pv = warpgroup_mma_wait(num_outstanding=0, deps=(pv, ))
            mbarrier.arrive(empty.index(prev), count=1)
            mbarrier.arrive(empty.index(prev + 1), count=1)
            if FRESH_ACC:
                acc = acc * gl.expand_dims(alpha_prev, 1) + pv
                alpha_prev = gl.convert_layout(alpha, row_o)
            else:
                acc = pv
        last = (2 * n_pairs - 2) % STAGES
        if FRESH_ACC:
            pv = warpgroup_mma(operand_p(p0, p_layout, PERMUTED), v_bufs.index(last).permute((1, 0)), zeros_o,
                               use_acc=False, is_async=True)
            acc = acc * gl.expand_dims(alpha_prev, 1)
        else:
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
            pv = warpgroup_mma(operand_p(p0, p_layout, PERMUTED), v_bufs.index(last).permute((1, 0)), acc,
                               is_async=True)
        pv = warpgroup_mma(operand_p(p1, p_layout, PERMUTED), v_bufs.index(last + 1).permute((1, 0)), pv,
                           is_async=True)
        pv = warpgroup_mma_wait(num_outstanding=0, deps=(pv, ))
        acc = acc + pv if FRESH_ACC else pv
        mbarrier.arrive(empty.index(last), count=1)
        mbarrier.arrive(empty.index(last + 1), count=1)
    if n_steps % 2 == 1:
        e = n_steps - 1
        slot = e % STAGES
        mbarrier.wait(ready.index(slot), (e // STAGES) & 1)
        s = warpgroup_mma(q_smem, k_bufs.index(slot).permute((1, 0)), zeros, use_acc=False, is_async=True)
        s = _mask_tail(warpgroup_mma_wait(num_outstanding=0, deps=(s, )), idx_ptr, e, NK, BLOCK_K, s_layout)
        p, m_i, l_i, alpha = _softmax(s, m_i, l_i, q_factor * gl.load(kd_ptr + gl.load(idx_ptr + e)))
        pv = warpgroup_mma(operand_p(p, p_layout, PERMUTED), v_bufs.index(slot).permute((1, 0)), zeros_o,
                           use_acc=False, is_async=True)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1) + warpgroup_mma_wait(num_outstanding=0,
                                                                                            deps=(pv, ))
        mbarrier.arrive(empty.index(slot), count=1)
    return acc, m_i, l_i


@gluon.jit
def attend_selected(q_smem, k_bufs, v_bufs, q_bar, ready, empty, idx_ptr, kd_ptr, q_factor, NK, n_steps,
                    BLOCK_K: gl.constexpr, FRESH_ACC: gl.constexpr, DEFER_RESCALE: gl.constexpr,
                    PERMUTED: gl.constexpr, PAIRS: gl.constexpr, num_warps: gl.constexpr):
    """The query tile over its selected key blocks: ``attend_pairs`` with ``PAIRS`` (``DEFER_RESCALE`` unused),
    else ``attend``; ``(acc, m, l)``."""
    if PAIRS:
        return attend_pairs(q_smem, k_bufs, v_bufs, q_bar, ready, empty, idx_ptr, kd_ptr, q_factor, NK, n_steps,
                            BLOCK_K, FRESH_ACC, PERMUTED, num_warps)
    else:
        return attend(q_smem, k_bufs, v_bufs, q_bar, ready, empty, idx_ptr, kd_ptr, q_factor, NK, n_steps, BLOCK_K,
                      FRESH_ACC, DEFER_RESCALE, PERMUTED, num_warps)


@gluon.jit
def finish(acc, m_i, l_i, q_smem, lse_ptr, vs_ptr, km_ptr, q_scale, q_row, q_first, NQ, SCALE: gl.constexpr):
    """The LSE of the unsmoothed logits stored for the rows below ``NQ``; returns O ``acc / (l s_v)`` (fp32, the
    accumulator's layout). ``vs_ptr``, ``km_ptr``: this KV head's V scales and K mean ``(D,)`` fp32."""
    BM: gl.constexpr = q_smem.type.shape[0]
    D: gl.constexpr = q_smem.type.shape[1]
    o_layout: gl.constexpr = acc.type.layout
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
    inv_l = gl.convert_layout(1.0 / l_i, gl.SliceLayout(1, o_layout))
    o = acc * gl.expand_dims(inv_l, 1) * gl.expand_dims(1.0 / gl.load(vs_ptr + cols), 0)
    q = q_smem.load(o_layout).to(gl.float32)                   # the smoothing's LSE term: scale q8 . k_mean / s_q
    shift = gl.sum(q * gl.expand_dims(gl.load(km_ptr + cols), 0), axis=1) * (SCALE / q_scale)
    row_s: gl.constexpr = m_i.type.layout
    local = gl.arange(0, BM, layout=row_s)
    lse = (m_i + gl.log2(l_i) - LOG2_448) * LN2 + gl.convert_layout(shift, row_s)
    gl.store(lse_ptr + q_row + local, lse, mask=q_first + local < NQ)
    return o


@gluon.jit
def _consumer(q_smem, k_bufs, v_bufs, q_bar, ready, empty, o_ptr, lse_ptr, idx_ptr, kd_ptr, vs_ptr, km_ptr,
              q_scale, q_row, q_first, NQ, NK, n_steps, BLOCK_K: gl.constexpr, SCALE: gl.constexpr,
              SCALE2: gl.constexpr, FRESH_ACC: gl.constexpr, DEFER_RESCALE: gl.constexpr, PERMUTED: gl.constexpr,
              PAIRS: gl.constexpr, num_warps: gl.constexpr):
    """``attend_selected``, then O and the LSE (``finish``) for the rows below ``NQ``."""
    acc, m_i, l_i = attend_selected(q_smem, k_bufs, v_bufs, q_bar, ready, empty, idx_ptr, kd_ptr, SCALE2 / q_scale,
                                    NK, n_steps, BLOCK_K, FRESH_ACC, DEFER_RESCALE, PERMUTED, PAIRS, num_warps)
    o = finish(acc, m_i, l_i, q_smem, lse_ptr, vs_ptr, km_ptr, q_scale, q_row, q_first, NQ, SCALE)
    store_rows(o_ptr, o.to(o_ptr.dtype.element_ty), q_row, q_first, NQ)


@gluon.jit
def allocate_ring(q_desc, k_desc, vt_desc, STAGES: gl.constexpr, BLOCK_K: gl.constexpr):
    """Shared memory of the Q8 tile and of the K8 / V8^T ring, and its barriers (``fwd_ws._barriers``)."""
    D: gl.constexpr = q_desc.block_type.shape[1]
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [q_desc.block_type.shape[0], D], q_desc.layout)
    k_bufs = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_K, D], k_desc.layout)
    v_bufs = gl.allocate_shared_memory(vt_desc.dtype, [STAGES, D, BLOCK_K], vt_desc.layout)
    q_bar, ready, empty = _barriers(STAGES)
    return q_smem, k_bufs, v_bufs, q_bar, ready, empty


@gluon.jit
def _ws_fwd_fp8_kernel(q_desc, k_desc, vt_desc, o_ptr, lse_ptr, idx_ptr, qs_ptr, kd_ptr, vs_ptr, km_ptr, H, GROUP,
                       NQ, NK, TQ, TK, TOPK, BLOCK_Q: gl.constexpr, BLOCK_K: gl.constexpr, Q_SPLIT: gl.constexpr,
                       SCALE: gl.constexpr, SCALE2: gl.constexpr, STAGES: gl.constexpr, FRESH_ACC: gl.constexpr,
                       DEFER_RESCALE: gl.constexpr, PERMUTED: gl.constexpr, PAIRS: gl.constexpr,
                       num_warps: gl.constexpr):
    BM: gl.constexpr = q_desc.block_type.shape[0]
    D: gl.constexpr = q_desc.block_type.shape[1]
    bh, h, qblk, q_first, q_row, kv_row = program_tile(H, GROUP, NQ, NK, BLOCK_Q, Q_SPLIT, BM)
    hk = kv_row // NK                                           # flat (batch, KV head)
    idx = idx_ptr + (bh.to(gl.int64) * TQ + qblk) * TOPK
    q_scale = gl.load(qs_ptr + bh.to(gl.int64) * TQ + qblk)
    q_smem, k_bufs, v_bufs, q_bar, ready, empty = allocate_ring(q_desc, k_desc, vt_desc, STAGES, BLOCK_K)

    gl.warp_specialize([
        (_consumer, (q_smem, k_bufs, v_bufs, q_bar, ready, empty, o_ptr, lse_ptr, idx, kd_ptr + hk * TK,
                     vs_ptr + hk * D, km_ptr + hk * D, q_scale, q_row, q_first, NQ, NK, TOPK, BLOCK_K, SCALE, SCALE2,
                     FRESH_ACC, DEFER_RESCALE, PERMUTED, PAIRS, num_warps)),
        (producer, (q_desc, k_desc, vt_desc, q_smem, k_bufs, v_bufs, q_bar, ready, empty, idx, q_row, kv_row, hk * D,
                     TOPK, BLOCK_K)),
    ], [1], [24])


def supported(k8: torch.Tensor, indices: torch.Tensor, block_q: int, block_k: int) -> bool:
    """Whether ``ws_block_attend_fp8`` takes this call (``k8``: the pre-pass's K): CUDA sm_90 e4m3 tensors, D = 128,
    query blocks of 64 or a multiple of 64 rows, key blocks of 64, at least one block per row. At D = 64 the Triton
    kernel is the faster one (1.83 ms against 2.13 at its best tiles with a fresh accumulator; B2 H8 N65536, 5 % of
    blocks, H200)."""
    if k8.device.type != "cuda" or torch.cuda.get_device_capability(k8.device)[0] != 9:
        return False
    return (k8.dtype == torch.float8_e4m3fn and k8.shape[3] == 128 and block_k == 64 and block_q % 64 == 0
            and indices.shape[3] > 0)


def default_tiles(d: int) -> dict:
    """Ring slots, register cap per thread, ``fresh_acc``, ``defer_rescale`` (``attend``) and ``pairs``
    (``attend_pairs``: two key blocks per softmax step, an even number of slots) at head dim ``d``, with
    ``tiles.overrides("block_fwd_ws_fp8")``. Measured at D = 128, B2 H8 N65536, 5 % of blocks (H200), each run
    against the bf16 kernel in the same process: the default 1.34x (2.93 ms, triton 3.6), rel L2 to bf16 5.315 %.
    Rejected: one block per step, 1.25x (its best: ``defer_rescale``, 349 SASS per key step against 412, accumulating
    in the MMA, 0.23 % from the fp32 sum); fewer slots (one block per step: 2.93-2.95 ms at 2-4, no gain; pairs need
    4, ``check_ring``); caps of 96 or 168 registers (4.2-4.9 ms); 80 registers, three programs per SM (does not
    compile: ptxas needs 94 for the ``P V`` wgmma); a fresh accumulator per pair (the consumer spills at every cap)."""
    return with_overrides("block_fwd_ws_fp8", dict(stages=4, maxnreg=128, fresh_acc=False, defer_rescale=True,
                                                   pairs=True))


def check_ring(tiles: dict, stages: int) -> None:
    """``pairs`` takes two slots a step and holds them until the next pair's scores are issued: an even ring of at
    least 4 slots (with 2 the next pair would wait for the slots it holds)."""
    if tiles["pairs"] and (stages % 2 or stages < 4):
        raise ValueError(f"tile setting pairs needs an even number of ring slots, at least 4, got {stages}")


BM = 64                                                         # query-tile rows: one consumer warpgroup


def descriptors(q8, k8, vt8, block_k: int):
    """TMA descriptors of q8 (``(BM, D)`` tiles), k8 (``(block_k, D)``) and V8^T (``(D, block_k)``) over the flattened
    ``(B * H * N, D)`` and ``(B * Hk * D, NP)`` tensors."""
    d, np_ = q8.shape[-1], vt8.shape[-1]
    return (descriptor(q8.view(-1, d), [BM, d], shared_layout(BM, d, gl.float8e4nv)),
            descriptor(k8.view(-1, d), [block_k, d], shared_layout(block_k, d, gl.float8e4nv)),
            descriptor(vt8.view(-1, np_), [d, block_k], shared_layout(d, block_k, gl.float8e4nv)))


def ws_block_attend_fp8(q8, q_scales, k8, k_scales, k_mean, vt8, v_scales, indices, block_q: int, block_k: int,
                        scale: float, out_dtype: torch.dtype, tiles: dict | None = None):
    """``fwd_fp8.block_attend_fp8`` on the Gluon kernel (see ``supported``): O ``(B, H, Nq, D)`` in ``out_dtype``,
    natural-log LSE ``(B, H, Nq)`` fp32. ``tiles``: ``default_tiles``' keys."""
    bsz, heads, nq, d = q8.shape
    tq, topk = indices.shape[2], indices.shape[3]
    tiles = {**default_tiles(d), **(tiles or {})}
    check_ring(tiles, tiles["stages"])
    q_desc, k_desc, vt_desc = descriptors(q8, k8, vt8, block_k)
    o = torch.empty(bsz, heads, nq, d, device=q8.device, dtype=out_dtype)
    lse = torch.empty(bsz, heads, nq, device=q8.device, dtype=torch.float32)
    launcher(_ws_fwd_fp8_kernel)[(tq * (block_q // BM), bsz * heads)](
        q_desc, k_desc, vt_desc, o, lse, indices, q_scales, 1.0 / k_scales, v_scales, k_mean, heads,
        heads // k8.shape[1], nq, k8.shape[2], tq, k_scales.shape[2], topk, BLOCK_Q=block_q, BLOCK_K=block_k,
        Q_SPLIT=block_q // BM, SCALE=float(scale), SCALE2=float(scale * LOG2E), STAGES=tiles["stages"],
        FRESH_ACC=tiles["fresh_acc"], DEFER_RESCALE=tiles["defer_rescale"], PERMUTED=permutes_keys(block_k),
        PAIRS=tiles["pairs"], num_warps=BM // 16, maxnreg=tiles["maxnreg"])
    return o, lse


@torch.library.custom_op("flexsparse::block_attn_fp8_ws", mutates_args=())
def block_attn_fp8_ws(q8: torch.Tensor, q_scales: torch.Tensor, k8: torch.Tensor, k_scales: torch.Tensor,
                      k_mean: torch.Tensor, vt8: torch.Tensor, v_scales: torch.Tensor, indices: torch.Tensor,
                      block_q: int, block_k: int, scale: float,
                      out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``ws_block_attend_fp8`` as an opaque custom op (``wrap_triton`` does not take Gluon kernels)."""
    return ws_block_attend_fp8(q8, q_scales, k8, k_scales, k_mean, vt8, v_scales, indices, block_q, block_k, scale,
                               out_dtype)


@block_attn_fp8_ws.register_fake
def _block_attn_fp8_ws_fake(q8, q_scales, k8, k_scales, k_mean, vt8, v_scales, indices, block_q, block_k, scale,
                            out_dtype):
    return q8.new_empty(q8.shape, dtype=out_dtype), q8.new_empty(q8.shape[:3], dtype=torch.float32)
