"""SLA2 forward with the FP8 sparse branch in Triton: ``block_sparse.fwd_fp8``'s walk over the selected key blocks
with the masked linear branch's output and the alpha lerp in its epilogue (``fwd.linear_output``, ``fwd.combine``),
so that the quantized forward does not run the separate output kernel that reads q and O_s again. The calls the
Gluon kernel (``mix_ws_fp8``, D = 128 on sm_90) does not take run it up to ``op.MIXED_FP8_MAX_D`` (D = 64 on sm_90,
other GPUs, the interpreter), on the dense strategy (the query-block states come summed,
``fwd.dense_query_states``).

Per program, after the loop: O_s rounded to q's dtype (what the two-op path stores and mixes), the Q tile in q's
dtype, ``O_l = phi(Q) H_i / (eps + phi(Q) . Z_i)`` rounded to q's dtype, then ``O_l + alpha (O_s - O_l)``; O_s and
O_l are stored only with ``STORE`` (the backward reads them). Measured (B2 H8 N65536 D64, 5 % of 64-key blocks,
H200): SLA2's kernel 1915 µs against 1781 + 187 for the FP8 kernel and the output kernel apart; SLA's projection
``O_s + O_l W^T + b`` in the same epilogue took 2135 µs against 1779 + 171 apart, so SLA keeps the two kernels.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._runtime.registry import directly
from ..block_sparse.fp8_quant import quantize_kv
from ..block_sparse.fwd_fp8 import attend_fp8, forward_tiles, launch_attention
from ..common.jit import load_tile, store_row_values, store_tile
from .fwd import combine, feature_code, linear_output, mix_operands, mixed_outputs

# Registers per thread of a direct launch that stores O_s and O_l (training; sm_90, triton 3.6, D = 64): uncapped
# 165-167 (3 programs of 4 warps per SM), capped 128 and no spill (4 per SM). SLA2 97 % D = 64 training step, B2 H8
# N65536, H200, two rounds: 7.862 / 8.049 ms capped, 8.011 / 8.066 uncapped (bf16 7.880 / 7.967); the forward alone
# took 1.858 / 1.943 capped, 1.841 / 1.851 uncapped, so it stays uncapped. Traced graphs run the storing variant
# through ``sparse_linear_fp8_stored`` for the cap (``wrap_triton`` takes no ``maxnreg``).
STORE_MAXNREG = 128


@triton.jit
def _mix_fp8_kernel(Q, Q8, QS, K8, VT8, KD, VS, KMEAN, IDX, O, LSE, H, GROUP, NQ, NK, NP16, TQ, TK, TOPK, OS, OL,
                    ROWS_H, ROWS_Z, LOGIT, logit_h, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
                    D: tl.constexpr, BD: tl.constexpr, SCALE: tl.constexpr, SCALE2: tl.constexpr, BM: tl.constexpr,
                    BN: tl.constexpr, TILE_Q: tl.constexpr, TILE_K: tl.constexpr, Q_SPLIT: tl.constexpr,
                    K_SPLIT: tl.constexpr, Q_GROUP: tl.constexpr, K_GROUP: tl.constexpr, PAIRS: tl.constexpr,
                    MASK_Q: tl.constexpr, MASK_K: tl.constexpr, STAGES: tl.constexpr, FRESH_ACC: tl.constexpr,
                    EMULATE: tl.constexpr, PERMUTED: tl.constexpr, EPS: tl.constexpr, FMAP: tl.constexpr,
                    BF16: tl.constexpr, STORE: tl.constexpr, Q_READY: tl.constexpr):
    o_s, lse, bh, qblk, rows, row_ok, dim = attend_fp8(
        Q, Q8, QS, K8, VT8, KD, VS, KMEAN, IDX, H, GROUP, NQ, NK, NP16, TQ, TK, TOPK, BLOCK_Q, BLOCK_K, D, BD, SCALE,
        SCALE2, BM, BN, TILE_Q, TILE_K, Q_SPLIT, K_SPLIT, K_GROUP, PAIRS, MASK_Q, MASK_K, STAGES, FRESH_ACC, EMULATE,
        PERMUTED, Q_READY)
    store_row_values(LSE + bh.to(tl.int64) * NQ, lse, rows, row_ok, MASK_Q)
    q_head = bh.to(tl.int64) * NQ * D
    o_s = o_s.to(Q.dtype.element_ty)
    # the epilogue's operands, loaded after the loop: loaded before it (held across it) they made the kernel slower,
    # 2059 against 1915 µs (B2 H8 N65536 D64, H200)
    state = bh.to(tl.int64) * TQ + qblk                               # the query block's row of H_i, Z_i
    dim_ok = dim < D
    state_h = tl.load(ROWS_H + state * D * D + dim[:, None] * D + dim[None, :],
                      mask=dim_ok[:, None] & dim_ok[None, :], other=0.0)
    state_z = tl.load(ROWS_Z + state * D + dim, mask=dim_ok, other=0.0)
    _, _, alpha = mix_operands(Q, Q, Q, LOGIT, logit_h, bh % H, qblk, D, BD, 2)   # the lerp reads no W, bias
    q = load_tile(Q + q_head, rows, D, dim, row_ok, D, BD, MASK_Q)
    o_l = linear_output(q, row_ok[:, None] & dim_ok[None, :], state_h, state_z, EPS, FMAP, BF16)
    o_l = o_l.to(Q.dtype.element_ty)
    out = combine(o_s.to(tl.float32), o_l, 0.0, 0.0, alpha, BF16, 2)
    store_tile(O + q_head, out, rows, D, dim, row_ok, D, BD, MASK_Q)
    if STORE:
        store_tile(OS + q_head, o_s, rows, D, dim, row_ok, D, BD, MASK_Q)
        store_tile(OL + q_head, o_l, rows, D, dim, row_ok, D, BD, MASK_Q)


def sparse_linear_forward_fp8(q, k, v, indices, rows_h, rows_z, weight_t, bias, alpha_logit, block_q: int,
                              block_k: int, scale: float, feature_map: str, eps: float, store: bool,
                              k_mean: torch.Tensor | None = None, pooled: list[torch.Tensor] | None = None):
    """``(out, lse, o_s, o_l)``: the FP8 sparse branch over ``indices`` (``fp8_quant.quantize_kv``'s pre-pass, then one
    kernel that quantizes Q itself) mixed with the masked linear branch of the query-block states
    ``rows_h (B, H, Tq, D, D)`` (``fwd.state_dtype``) and ``rows_z (B, H, Tq, D)`` fp32 as SLA2's
    ``O_l + alpha (O_s - O_l)``, ``alpha = sigmoid(alpha_logit)`` (``alpha_logit (1 or H, Tq)`` in any float dtype;
    alpha rounded to q's dtype in the kernel). o_s (the FP8 branch's output in q's dtype) and o_l ``(B, H, Nq, D)`` when
    ``store``, else empty. The arguments of ``mix_ws_fp8.ws_sparse_linear_forward_fp8`` (``k_mean``, ``pooled`` the
    pre-pass's); weight_t and bias must be None (no projection).

    q: ``(B, H, Nq, D)``; k, v: ``(B, Hk, Nk, D)``; indices ``(B, H, Tq, K)`` int32; all contiguous."""
    if weight_t is not None or bias is not None or alpha_logit is None:
        raise ValueError("sparse_linear_forward_fp8 mixes by alpha_logit only (weight_t and bias None)")
    out, lse, o_s, o_l = mixed_outputs(q, store)
    logit_h = indices.shape[2] if alpha_logit.shape[0] > 1 else 0
    extra = (o_s if store else q, o_l if store else q, rows_h, rows_z, alpha_logit, logit_h)  # q: unused slots
    tiles = {"maxnreg": STORE_MAXNREG if store and q.is_cuda else None, **forward_tiles(q.device, q.shape[-1])}
    launch_attention(_mix_fp8_kernel, q, quantize_kv(k, v, block_k, k_mean, pooled), indices, out, lse, block_q,
                     block_k, scale, tiles, extra=extra, q_part=pooled[:2] if pooled else None, EPS=float(eps),
                     FMAP=feature_code(feature_map), BF16=q.dtype == torch.bfloat16, STORE=store)
    return out, lse, o_s, o_l


@torch.library.custom_op("flexsparse::sparse_linear_fp8_stored", mutates_args=())
def sparse_linear_fp8_stored(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor,
                             rows_h: torch.Tensor, rows_z: torch.Tensor, weight_t: torch.Tensor | None,
                             bias: torch.Tensor | None, alpha_logit: torch.Tensor | None, block_q: int, block_k: int,
                             scale: float, feature_map: str, eps: float, store: bool,
                             pooled: list[torch.Tensor], k_mean: torch.Tensor | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``sparse_linear_forward_fp8`` as an opaque custom op launching its kernels directly: what a traced graph
    runs for the variant that stores O_s and O_l, so that it keeps ``STORE_MAXNREG``."""
    return directly(sparse_linear_forward_fp8, q, k, v, indices, rows_h, rows_z, weight_t, bias, alpha_logit, block_q,
                    block_k, scale, feature_map, eps, store, k_mean, pooled)


@sparse_linear_fp8_stored.register_fake
def _sparse_linear_fp8_stored_fake(q, k, v, indices, rows_h, rows_z, weight_t, bias, alpha_logit, block_q, block_k,
                                   scale, feature_map, eps, store, pooled, k_mean=None):
    return mixed_outputs(q, store)
