"""SLA / SLA2 forward with the FP8 sparse branch for Hopper in Gluon: ``block_sparse.fwd_ws_fp8`` with ``mix_ws``'s
epilogue (the masked linear branch's output and the combine), so that quantizing the sparse branch does not cost
the separate output kernel that reads q and O_s again.

The linear branch sees unquantized tensors: after the sparse loop the producer loads the bf16 / fp16 Q tile into a
buffer of its own and ``H_i`` (and SLA's ``W^T``) by TMA into the released K8 (and V8^T) slots, reinterpreted in
q's dtype (the ring holds ``(D, D)`` of it with 4 slots at D = 128, ``ring_stages``). The consumer
finishes O_s and the LSE as ``fwd_ws_fp8`` does, rounds O_s to q's dtype and runs ``mix_ws.linear_epilogue``.
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

from .._runtime.registry import launcher
from ..block_sparse import fwd_ws as block_fwd_ws
from ..block_sparse import fwd_ws_fp8
from ..block_sparse.fp8_quant import permutes_keys, quantize_qkv
from .fwd import feature_code, mixed_outputs
from .mix_ws import MIX_ALPHA, linear_epilogue, linear_operands, square_layout


@gluon.jit
def _as_square(bufs, dtype: gl.constexpr, D: gl.constexpr):
    """The first slots of a ring (contiguous) as one ``(D, D)`` tile of ``dtype`` (``square_layout``); the ring
    holds it (``ring_stages``)."""
    return bufs.index(0)._reinterpret(dtype, [D, D], square_layout(D, dtype))


@gluon.jit
def _mix_producer(q_desc, k_desc, vt_desc, qb_desc, h_desc, w_desc, q_smem, qb_smem, k_bufs, v_bufs, q_bar, ready,
                  empty, idx_ptr, q_row, kv_row, vt_row, h_row, n_steps, BLOCK_K: gl.constexpr, MIX: gl.constexpr):
    """``fwd_ws_fp8.producer``, then, once every slot is released, the Q tile in q's dtype, ``H_i`` into the K slots
    (and ``W^T`` into the V slots), completing ``q_bar``'s second phase."""
    fwd_ws_fp8.producer(q_desc, k_desc, vt_desc, q_smem, k_bufs, v_bufs, q_bar, ready, empty, idx_ptr, q_row, kv_row,
                        vt_row, n_steps, BLOCK_K)
    STAGES: gl.constexpr = k_bufs.type.shape[0]
    D: gl.constexpr = k_bufs.type.shape[2]
    for e in range(n_steps, n_steps + STAGES):
        mbarrier.wait(empty.index(e % STAGES), ((e // STAGES) & 1) ^ 1)
    if MIX == 1:
        mbarrier.expect(q_bar, qb_desc.block_type.nbytes + h_desc.block_type.nbytes + w_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(w_desc, [0, 0], q_bar, _as_square(v_bufs, w_desc.dtype, D))
    else:
        mbarrier.expect(q_bar, qb_desc.block_type.nbytes + h_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(qb_desc, [q_row, 0], q_bar, qb_smem)
    tma.async_copy_global_to_shared(h_desc, [h_row, 0], q_bar, _as_square(k_bufs, h_desc.dtype, D))


@gluon.jit
def _mix_consumer(q_smem, qb_smem, k_bufs, v_bufs, q_bar, ready, empty, o_ptr, lse_ptr, os_ptr, ol_ptr, z_ptr,
                  bias_ptr, logit_ptr, idx_ptr, kd_ptr, vs_ptr, km_ptr, q_scale, q_row, q_first, NQ, NK, n_steps,
                  BLOCK_K: gl.constexpr, SCALE: gl.constexpr, SCALE2: gl.constexpr, EPS: gl.constexpr,
                  FMAP: gl.constexpr, MIX: gl.constexpr, STORE: gl.constexpr, FRESH_ACC: gl.constexpr,
                  DEFER_RESCALE: gl.constexpr, PERMUTED: gl.constexpr, PAIRS: gl.constexpr, num_warps: gl.constexpr):
    """``fwd_ws_fp8.attend_selected`` and ``finish`` (the LSE), O_s in q's dtype on the 16-bit wgmma layout, then
    ``linear_epilogue`` with the Q tile in q's dtype and ``H_i`` (and ``W^T``) in the released slots."""
    D: gl.constexpr = q_smem.type.shape[1]
    dtype: gl.constexpr = qb_smem.dtype
    acc, m_i, l_i = fwd_ws_fp8.attend_selected(q_smem, k_bufs, v_bufs, q_bar, ready, empty, idx_ptr, kd_ptr,
                                               SCALE2 / q_scale, NK, n_steps, BLOCK_K, FRESH_ACC, DEFER_RESCALE,
                                               PERMUTED, PAIRS, num_warps)
    o_s = fwd_ws_fp8.finish(acc, m_i, l_i, q_smem, lse_ptr, vs_ptr, km_ptr, q_scale, q_row, q_first, NQ, SCALE)
    o_s = gl.convert_layout(o_s.to(dtype), block_fwd_ws.mma_layout(num_warps, D))
    mbarrier.wait(q_bar, 1)                       # Q in q's dtype, H_i (and W^T) in the released slots
    linear_epilogue(qb_smem, _as_square(k_bufs, dtype, D), _as_square(v_bufs, dtype, D), o_s, o_ptr, os_ptr, ol_ptr,
                    z_ptr, bias_ptr, logit_ptr, q_row, q_first, NQ, EPS, FMAP, MIX, STORE)


@gluon.jit
def _ws_mix_fp8_kernel(q_desc, k_desc, vt_desc, qb_desc, h_desc, w_desc, o_ptr, lse_ptr, os_ptr, ol_ptr, z_ptr,
                       bias_ptr, logit_ptr, idx_ptr, qs_ptr, kd_ptr, vs_ptr, km_ptr, H, GROUP, NQ, NK, TQ, TK, TOPK,
                       logit_h, BLOCK_Q: gl.constexpr, BLOCK_K: gl.constexpr, Q_SPLIT: gl.constexpr,
                       SCALE: gl.constexpr, SCALE2: gl.constexpr, EPS: gl.constexpr, FMAP: gl.constexpr,
                       MIX: gl.constexpr, STORE: gl.constexpr, STAGES: gl.constexpr, FRESH_ACC: gl.constexpr,
                       DEFER_RESCALE: gl.constexpr, PERMUTED: gl.constexpr, PAIRS: gl.constexpr,
                       num_warps: gl.constexpr):
    BM: gl.constexpr = q_desc.block_type.shape[0]
    D: gl.constexpr = q_desc.block_type.shape[1]
    bh, h, qblk, q_first, q_row, kv_row = block_fwd_ws.program_tile(H, GROUP, NQ, NK, BLOCK_Q, Q_SPLIT, BM)
    hk = kv_row // NK                                           # flat (batch, KV head)
    state = bh.to(gl.int64) * TQ + qblk                         # the query block's row of H_i, Z_i and its Q scale
    idx = idx_ptr + state * TOPK
    q_scale = gl.load(qs_ptr + state)
    q_smem, k_bufs, v_bufs, q_bar, ready, empty = fwd_ws_fp8.allocate_ring(q_desc, k_desc, vt_desc, STAGES, BLOCK_K)
    qb_smem = gl.allocate_shared_memory(qb_desc.dtype, [BM, D], qb_desc.layout)

    gl.warp_specialize([
        (_mix_consumer, (q_smem, qb_smem, k_bufs, v_bufs, q_bar, ready, empty, o_ptr, lse_ptr, os_ptr, ol_ptr,
                         z_ptr + state * D, bias_ptr, logit_ptr + h * logit_h + qblk, idx, kd_ptr + hk * TK,
                         vs_ptr + hk * D, km_ptr + hk * D, q_scale, q_row, q_first, NQ, NK, TOPK, BLOCK_K, SCALE,
                         SCALE2, EPS, FMAP, MIX, STORE, FRESH_ACC, DEFER_RESCALE, PERMUTED, PAIRS, num_warps)),
        (_mix_producer, (q_desc, k_desc, vt_desc, qb_desc, h_desc, w_desc, q_smem, qb_smem, k_bufs, v_bufs, q_bar,
                         ready, empty, idx, q_row, kv_row, hk * D, (bh * TQ + qblk) * D, TOPK, BLOCK_K, MIX)),
    ], [1], [24])


def registers(d: int) -> int:
    """Register cap per thread (measured at D = 128, B2 H8 N65536, H200: the ``sla`` 95 % forward 5.12 ms at 128,
    6.77 at 144, 5.15 at 112; ``sla2`` 97 % 3.69 at 128, 4.85 at 144)."""
    return 128


def ring_stages(d: int) -> int:
    """Ring slots: ``fwd_ws_fp8``'s, and enough that the K8 slots hold ``H_i`` and the V8^T slots ``W^T`` in q's
    dtype (``(D, D)`` 16-bit values in slots of ``64 x D`` bytes: ``D / 32`` slots)."""
    return max(fwd_ws_fp8.default_tiles(d)["stages"], d // 32)


def supported(q: torch.Tensor, indices: torch.Tensor, block_q: int, block_k: int) -> bool:
    """Whether ``ws_sparse_linear_forward_fp8`` takes this call: bf16 q (the dense strategy's states are in q's
    dtype) on sm_90 with what ``fwd_ws_fp8.supported`` takes of its e4m3 copy (D = 128: at D = 64 the ``sla`` 95 %
    forward took 3.31 ms against 2.82 in bf16, B2 H8 N65536, H200)."""
    if q.dtype != torch.bfloat16 or q.device.type != "cuda" or torch.cuda.get_device_capability(q.device)[0] != 9:
        return False
    return q.shape[3] == 128 and block_k == 64 and block_q % 64 == 0 and indices.shape[3] > 0


def ws_sparse_linear_forward_fp8(q, k, v, indices, rows_h, rows_z, weight_t, bias, alpha_logit, block_q: int,
                                 block_k: int, scale: float, feature_map: str, eps: float, store: bool,
                                 k_mean: torch.Tensor | None = None, pooled: list[torch.Tensor] | None = None):
    """``mix_ws.ws_sparse_linear_forward`` with the FP8 sparse branch (``fp8_quant.quantize_qkv``'s pre-pass, with
    ``k_mean`` and ``pooled`` where given, then one kernel): ``(out, lse, o_s, o_l)``, o_s the FP8 branch's output
    in q's dtype.
    Arguments and ``store`` as there (see ``supported``)."""
    bsz, heads, nq, d = q.shape
    tq, topk = indices.shape[2], indices.shape[3]
    tiles = fwd_ws_fp8.default_tiles(d)
    fwd_ws_fp8.check_ring(tiles, ring_stages(d))
    q8, q_scales, k8, k_scales, k_mean, vt8, v_scales = quantize_qkv(q, k, v, block_q, block_k, k_mean, pooled)
    q_desc, k_desc, vt_desc = fwd_ws_fp8.descriptors(q8, k8, vt8, block_k)
    bm = fwd_ws_fp8.BM
    qb_desc = block_fwd_ws.descriptor(q.view(-1, d), [bm, d], block_fwd_ws.shared_layout(bm, d, gl.bfloat16))
    h_desc, w_desc, mix, out, lse, o_s, o_l = linear_operands(q, rows_h, weight_t, gl.bfloat16, store)
    # deferred rescale: with the projection (sla) the kernel spills (160-168 B of stack; forward 5.04 -> 6.38 ms)
    defer = tiles["defer_rescale"] and mix == MIX_ALPHA
    launcher(_ws_mix_fp8_kernel)[(tq * (block_q // fwd_ws_fp8.BM), bsz * heads)](
        q_desc, k_desc, vt_desc, qb_desc, h_desc, w_desc, out, lse, o_s if store else q, o_l if store else q, rows_z,
        q if bias is None else bias, q if alpha_logit is None else alpha_logit, indices, q_scales, 1.0 / k_scales,
        v_scales, k_mean, heads, heads // k.shape[1], nq, k.shape[2], tq, k_scales.shape[2], topk,
        tq if alpha_logit is not None and alpha_logit.shape[0] > 1 else 0, BLOCK_Q=block_q, BLOCK_K=block_k,
        Q_SPLIT=block_q // fwd_ws_fp8.BM, SCALE=float(scale), SCALE2=float(scale * block_fwd_ws.LOG2E),
        EPS=float(eps), FMAP=feature_code(feature_map), MIX=mix, STORE=store, STAGES=ring_stages(d),
        FRESH_ACC=tiles["fresh_acc"], DEFER_RESCALE=defer, PERMUTED=permutes_keys(block_k), PAIRS=tiles["pairs"],
        num_warps=fwd_ws_fp8.BM // 16, maxnreg=registers(d))
    return out, lse, o_s, o_l


@torch.library.custom_op("flexsparse::sparse_linear_fp8_ws", mutates_args=())
def sparse_linear_fp8_ws(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor,
                         rows_h: torch.Tensor, rows_z: torch.Tensor, weight_t: torch.Tensor | None,
                         bias: torch.Tensor | None, alpha_logit: torch.Tensor | None, block_q: int, block_k: int,
                         scale: float, feature_map: str, eps: float, store: bool,
                         pooled: list[torch.Tensor], k_mean: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``ws_sparse_linear_forward_fp8`` as an opaque custom op (``wrap_triton`` does not take Gluon kernels)."""
    return ws_sparse_linear_forward_fp8(q, k, v, indices, rows_h, rows_z, weight_t, bias, alpha_logit, block_q, block_k,
                                        scale, feature_map, eps, store, k_mean, pooled)


@sparse_linear_fp8_ws.register_fake
def _sparse_linear_fp8_ws_fake(q, k, v, indices, rows_h, rows_z, weight_t, bias, alpha_logit, block_q, block_k, scale,
                               feature_map, eps, store, pooled, k_mean=None):
    return mixed_outputs(q, store)
