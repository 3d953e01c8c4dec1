"""SLA / SLA2 forward for Hopper in Gluon: the warp-specialized block-sparse forward (``block_sparse.fwd_ws``) with the
masked linear branch's output and the methods' combine in its epilogue.

The values of ``block_sparse.fwd_ws`` followed by ``fwd``'s output kernel with a ``Mix``, given the query-block
states ``H_i``, ``Z_i`` of the dense strategy (``fwd.dense_query_states``). After a query tile's sparse loop
the producer loads ``H_i`` (and SLA's ``W^T``) by TMA into the K (and V) slots of the ring, which the loop has
released; the consumer computes phi(Q) from the Q tile still in shared memory,
``O_l = phi(Q) H_i / (eps + phi(Q) . Z_i)`` rounded to q's dtype, and SLA's ``O_s + O_l W^T + b`` or SLA2's
``O_l + alpha (O_s - O_l)`` (alpha = sigmoid of its logit) with ``O_s`` rounded to q's dtype, as the separate
kernels do. So O_s makes no round trip through HBM and q is read once; without gradients only O and the LSE are
stored. No shared memory beyond the sparse kernel's (its occupancy is unchanged).

Not traceable by ``torch.compile`` (``wrap_triton`` takes no Gluon kernel): compiled graphs call it as the
opaque custom op ``flexsparse::sparse_linear_ws``.
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from .._runtime.registry import launcher
from ..block_sparse import fwd_ws as block_fwd_ws
from ..block_sparse.fwd_ws import LOG2E, attend, store_lse, store_rows
from .fwd import feature_code, mixed_outputs

MIX_PROJECTION, MIX_ALPHA = 1, 2


@gluon.constexpr_function
def square_layout(d, dtype):
    """The shared-memory layout of a ``(d, d)`` tile of ``dtype`` (``H_i``, ``W^T``), as their TMA descriptors'."""
    return gl.NVMMASharedLayout.get_default_for([d, d], dtype)


@gluon.jit
def _square(bufs):
    """The first ``D / rows`` slots of a ring ``(STAGES, rows, D)`` (contiguous) as one ``(D, D)`` tile
    (``square_layout``)."""
    gl.static_assert(bufs.type.shape[2] // bufs.type.shape[1] <= bufs.type.shape[0], "(D, D) exceeds the ring")
    D: gl.constexpr = bufs.type.shape[2]
    return bufs.index(0)._reinterpret(bufs.dtype, [D, D], square_layout(D, bufs.dtype))


@gluon.jit
def _feature(x, FMAP: gl.constexpr):
    """phi of the fp32 tile ``x (rows, D)`` over its columns, as ``fwd.feature`` (0 softmax, 1 elu + 1,
    2 relu; no padding: D is the tile's width)."""
    if FMAP == 0:
        p = gl.exp(x - gl.expand_dims(gl.max(x, axis=1), 1))
        return p / gl.expand_dims(gl.sum(p, axis=1), 1)
    elif FMAP == 1:
        return gl.where(x > 0, x + 1.0, gl.exp(gl.minimum(x, 0.0)))
    else:
        return gl.maximum(x, 0.0)


@gluon.jit
def _mix_producer(q_desc, k_desc, v_desc, h_desc, w_desc, q_smem, k_bufs, v_bufs, q_bar, ready, empty, idx_ptr,
                  q_row, kv_row, h_row, n_steps, BLOCK_K: gl.constexpr, MIX: gl.constexpr):
    """``block_sparse.fwd_ws``'s producer, then, once every slot is released, ``H_i`` into the K slots (and ``W^T`` into
    the V slots), completing ``q_bar``'s second phase."""
    block_fwd_ws._producer(q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_bar, ready, empty, idx_ptr, q_row,
                           kv_row, n_steps, BLOCK_K)
    STAGES: gl.constexpr = k_bufs.type.shape[0]
    for e in range(n_steps, n_steps + STAGES):
        mbarrier.wait(empty.index(e % STAGES), ((e // STAGES) & 1) ^ 1)
    if MIX == 1:
        mbarrier.expect(q_bar, h_desc.block_type.nbytes + w_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(w_desc, [0, 0], q_bar, _square(v_bufs))
    else:
        mbarrier.expect(q_bar, h_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(h_desc, [h_row, 0], q_bar, _square(k_bufs))


@gluon.jit
def linear_epilogue(q_tile, h_tile, w_tile, o_s, o_ptr, os_ptr, ol_ptr, z_ptr, bias_ptr, logit_ptr, q_row, q_first, NQ,
                    EPS: gl.constexpr, FMAP: gl.constexpr, MIX: gl.constexpr, STORE: gl.constexpr):
    """O_s (stored with ``STORE``); O_l from the Q tile ``q_tile`` and ``H_i`` (``h_tile``, shared memory, q's
    dtype) (stored with ``STORE``); the combined O with SLA's ``W^T`` (``w_tile``) or SLA2's alpha (the sigmoid of
    the fp32 logit at ``logit_ptr``, rounded to q's dtype). ``o_s``: ``(BM, D)`` in q's dtype on the wgmma
    accumulator layout."""
    BM: gl.constexpr = q_tile.type.shape[0]
    D: gl.constexpr = q_tile.type.shape[1]
    dtype: gl.constexpr = q_tile.dtype
    o_layout: gl.constexpr = o_s.type.layout
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
    zeros = gl.zeros([BM, D], gl.float32, o_layout)
    if STORE:
        store_rows(os_ptr, o_s, q_row, q_first, NQ)
    phi = _feature(q_tile.load(o_layout).to(gl.float32), FMAP)
    den = EPS + gl.sum(phi * gl.expand_dims(gl.load(z_ptr + cols), 0), axis=1)
    num = warpgroup_mma(gl.convert_layout(phi.to(dtype), a_layout), h_tile, zeros, use_acc=False, is_async=True)
    num = warpgroup_mma_wait(num_outstanding=0, deps=(num, ))
    o_l = (num / gl.expand_dims(den, 1)).to(dtype)
    if STORE:
        store_rows(ol_ptr, o_l, q_row, q_first, NQ)
    if MIX == 1:
        out = warpgroup_mma(gl.convert_layout(o_l, a_layout), w_tile, zeros, use_acc=False, is_async=True)
        out = warpgroup_mma_wait(num_outstanding=0, deps=(out, ))
        out = o_s.to(gl.float32) + out + gl.expand_dims(gl.load(bias_ptr + cols).to(dtype).to(gl.float32), 0)
    else:
        lin = o_l.to(gl.float32)
        alpha = (1.0 / (1.0 + gl.exp(-gl.load(logit_ptr).to(gl.float32)))).to(dtype).to(gl.float32)
        out = lin + alpha * (o_s.to(gl.float32) - lin)
    store_rows(o_ptr, out.to(dtype), q_row, q_first, NQ)


@gluon.jit
def _mix_consumer(q_smem, k_bufs, v_bufs, q_bar, ready, empty, o_ptr, lse_ptr, os_ptr, ol_ptr, z_ptr, bias_ptr,
                  logit_ptr, idx_ptr, q_row, q_first, NQ, NK, n_steps, BLOCK_K: gl.constexpr,
                  SCALE2: gl.constexpr, EPS: gl.constexpr, FMAP: gl.constexpr, MIX: gl.constexpr, STORE: gl.constexpr,
                  num_warps: gl.constexpr):
    """``attend``; the LSE; then ``linear_epilogue`` with ``H_i`` in the K slots (and ``W^T`` in the V slots)."""
    acc, m_i, l_i = attend(q_smem, k_bufs, v_bufs, q_bar, ready, empty, idx_ptr, NK, n_steps, BLOCK_K, SCALE2,
                           num_warps)
    store_lse(lse_ptr, m_i, l_i, q_row, q_first, NQ)
    o_s = (acc / gl.expand_dims(gl.convert_layout(l_i, gl.SliceLayout(1, acc.type.layout)), 1)).to(q_smem.dtype)
    mbarrier.wait(q_bar, 1)                       # H_i (and W^T) in the released slots
    linear_epilogue(q_smem, _square(k_bufs), _square(v_bufs), o_s, o_ptr, os_ptr, ol_ptr, z_ptr, bias_ptr, logit_ptr,
                    q_row, q_first, NQ, EPS, FMAP, MIX, STORE)


@gluon.jit
def _ws_mix_kernel(q_desc, k_desc, v_desc, h_desc, w_desc, o_ptr, lse_ptr, os_ptr, ol_ptr, z_ptr, bias_ptr,
                   logit_ptr, idx_ptr, H, GROUP, NQ, NK, TQ, TOPK, logit_h, BLOCK_Q: gl.constexpr,
                   BLOCK_K: gl.constexpr, Q_SPLIT: gl.constexpr, SCALE2: gl.constexpr, EPS: gl.constexpr,
                   FMAP: gl.constexpr, MIX: gl.constexpr, STORE: gl.constexpr, STAGES: gl.constexpr,
                   num_warps: gl.constexpr):
    D: gl.constexpr = q_desc.block_type.shape[1]
    bh, h, qblk, q_first, q_row, kv_row = block_fwd_ws.program_tile(H, GROUP, NQ, NK, BLOCK_Q, Q_SPLIT,
                                                                    q_desc.block_type.shape[0])
    state = bh.to(gl.int64) * TQ + qblk                      # the query block's row of H_i, Z_i
    idx = idx_ptr + state * TOPK
    q_smem, k_bufs, v_bufs, q_bar, ready, empty = block_fwd_ws.allocate_ring(q_desc, k_desc, v_desc, STAGES, BLOCK_K)

    gl.warp_specialize([
        (_mix_consumer, (q_smem, k_bufs, v_bufs, q_bar, ready, empty, o_ptr, lse_ptr, os_ptr, ol_ptr,
                         z_ptr + state * D, bias_ptr, logit_ptr + h * logit_h + qblk, idx, q_row, q_first, NQ, NK,
                         TOPK, BLOCK_K, SCALE2, EPS, FMAP, MIX, STORE, num_warps)),
        (_mix_producer, (q_desc, k_desc, v_desc, h_desc, w_desc, q_smem, k_bufs, v_bufs, q_bar, ready, empty, idx,
                         q_row, kv_row, (bh * TQ + qblk) * D, TOPK, BLOCK_K, MIX)),  # int32: a TMA row
    ], [1], [24])


def linear_operands(q, rows_h, weight_t, gl_dtype, store: bool):
    """The linear epilogue's launch operands: TMA descriptors of ``rows_h`` and ``weight_t`` (``(D, D)`` tiles in
    ``gl_dtype``; ``rows_h``'s stands in where ``weight_t`` is None), the mix code, and the empty ``out``, ``lse``
    and ``o_s``, ``o_l`` (empty unless ``store``)."""
    d = q.shape[-1]
    square = block_fwd_ws.shared_layout(d, d, gl_dtype)      # square_layout's, built once
    h_desc = block_fwd_ws.descriptor(rows_h.view(-1, d), [d, d], square)
    w_desc = h_desc if weight_t is None else block_fwd_ws.descriptor(weight_t, [d, d], square)
    mix = MIX_ALPHA if weight_t is None else MIX_PROJECTION
    return h_desc, w_desc, mix, *mixed_outputs(q, store)


def ws_sparse_linear_forward(q, k, v, indices, rows_h, rows_z, weight_t, bias, alpha_logit, block_q: int,
                             block_k: int, scale: float, feature_map: str, eps: float, store: bool):
    """``(out, lse, o_s, o_l)``: the sparse branch over ``indices`` (``block_sparse.fwd_ws.ws_block_forward``)
    mixed with the masked linear branch of the query-block states ``rows_h (B, H, Tq, D, D)`` (q's dtype) and
    ``rows_z (B, H, Tq, D)`` fp32: SLA's ``O_s + O_l W^T + bias`` (``weight_t = W^T (D, D)`` contiguous in q's
    dtype, ``bias (D,)`` contiguous, alpha_logit None) or SLA2's ``O_l + alpha (O_s - O_l)`` with ``alpha =
    sigmoid(alpha_logit)`` (``alpha_logit (1 or H, Tq)`` contiguous; weight_t and bias None); bias and alpha in any
    float dtype, rounded to q's in the kernel (alpha after an fp32 sigmoid). o_s and o_l ``(B, H, Nq, D)`` when
    ``store`` (the backward needs them), else empty. Takes the bf16 calls ``block_sparse.fwd_ws.supported`` takes
    (the ``(D, D)`` states fit the ring's first slots at both head dims)."""
    bsz, heads, nq, d = q.shape
    tq, topk = indices.shape[2], indices.shape[3]
    tiles = block_fwd_ws.default_tiles(d)
    q_desc, k_desc, v_desc, gl_dtype = block_fwd_ws.descriptors(q, k, v, block_k, tiles["bm"])
    h_desc, w_desc, mix, out, lse, o_s, o_l = linear_operands(q, rows_h, weight_t, gl_dtype, store)
    launcher(_ws_mix_kernel)[(tq * (block_q // tiles["bm"]), bsz * heads)](
        q_desc, k_desc, v_desc, h_desc, w_desc, out, lse, o_s if store else q, o_l if store else q, rows_z,
        q if bias is None else bias, q if alpha_logit is None else alpha_logit, indices, heads, heads // k.shape[1],
        nq, k.shape[2], tq, topk, tq if alpha_logit is not None and alpha_logit.shape[0] > 1 else 0, BLOCK_Q=block_q,
        BLOCK_K=block_k, Q_SPLIT=block_q // tiles["bm"], SCALE2=float(scale * LOG2E), EPS=float(eps),
        FMAP=feature_code(feature_map), MIX=mix, STORE=store, STAGES=tiles["stages"], num_warps=tiles["bm"] // 16,
        maxnreg=tiles["maxnreg"])
    return out, lse, o_s, o_l


@torch.library.custom_op("flexsparse::sparse_linear_ws", mutates_args=())
def sparse_linear_ws(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor, rows_h: torch.Tensor,
                     rows_z: torch.Tensor, weight_t: torch.Tensor | None, bias: torch.Tensor | None,
                     alpha_logit: torch.Tensor | None, block_q: int, block_k: int, scale: float, feature_map: str,
                     eps: float, store: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``ws_sparse_linear_forward`` as an opaque custom op (its kernel is launched directly, not traced by
    ``torch.compile``: ``wrap_triton`` does not take Gluon kernels)."""
    return ws_sparse_linear_forward(q, k, v, indices, rows_h, rows_z, weight_t, bias, alpha_logit, block_q, block_k,
                                    scale, feature_map, eps, store)


@sparse_linear_ws.register_fake
def _sparse_linear_ws_fake(q, k, v, indices, rows_h, rows_z, weight_t, bias, alpha_logit, block_q, block_k, scale,
                           feature_map, eps, store):
    return mixed_outputs(q, store)
