"""``torch.library`` ops of SLA's and SLA2's linear branch (namespace ``flexsparse``).

``masked_linear`` (differentiable) and ``masked_linear_bwd``: the masked linear branch
``O_l = phi(Q_i) H_i / (eps + phi(Q_i) . Z_i)`` with ``[H_i | Z_i] = [H | Z] - sum_{j skipped by i} [h_j | z_j]``,
``h_j = phi(K_j)^T V_j``, ``z_j = colsum phi(K_j)`` (fp32 sums, fp64 for fp64 inputs). Kernels: ``fwd``
(key-block states, fused gather-subtract + output) and ``bwd`` (query-major dq and state gradients,
key-major dk / dv over the CSC of ``skipped``), or with many skipped blocks the sums as block matmuls
(``dense``, ``fwd.dense``); phi and its gradient run in-kernel. ``masked_linear_mix``
(differentiable, kernels only): the branch with the methods' combine in its output kernel (SLA's
``O_s + O_l W^T + b``, SLA2's ``alpha`` lerp from alpha's logits, whose backward is ``lerp_mix_bwd``: kernel
``lerp_bwd``).

Memory: the op returns the query-block states ``H_i (B, H, Tq, D, D)`` and ``Z_i (B, H, Tq, D)`` (saved for
backward; H_i bf16 for bf16 inputs on the kernels, about ``D / block_q`` times the size of q, else fp32; Z_i
fp32); the kernels hold the key-block states ``(B, Hk, Tk, D (D + 1))`` (forward) and the query-block state
gradients ``(B, H, Tq, D (D + 1))`` (backward), both bf16 for bf16 inputs, else fp32 (the dense strategy adds the
``(B, H, Tq, Tk)`` keep map). Everything else is O(N D) (no fp32 copy of phi(Q), phi(K) or V).

CUDA runs the kernels; CPU runs them through the Triton interpreter when ``TRITON_INTERPRET=1`` is set, else
the PyTorch implementation runs (``naive``, fp32 matmuls); fp64 and head dims above ``MAX_KERNEL_D`` always take
the PyTorch path. ``sparse_linear_mix`` runs the block-sparse branch (``block_sparse.op``) and this one in one op.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .._runtime.registry import launching_directly, triton_op
from .._runtime.sizes import static
from .._runtime.tiles import overrides
from ..common.inputs import contiguous, use_kernels
from . import naive

MAX_KERNEL_D = 128  # head dims above keep the PyTorch path (a (D, D) fp32 state per program in registers)
# SLA's dO W in the query-gradient kernel up to this head dim, 16-bit inputs only: fp32 at D = 128 needs 270 KB of
# shared memory (sm_90 has 227 KB), bf16 at D = 128 ran 2% slower at B2 H8 N65536 than a separate matmul (H200)
PROJECTED_MAX_D = 64
SUMS_BY_MATMUL = 1 << 18  # rows from which SLA's bias gradient is a matmul (column_sums)
# SLA2's lerp in the Triton FP8 forward's epilogue up to this head dim (measured at D = 64; at D = 128 the (D, D)
# state and phi(Q) tiles would sit beside the kernel's own in one program, unmeasured)
MIXED_FP8_MAX_D = 64


def linear_kernels(q: Tensor) -> bool:
    """Whether the masked linear ops on ``q`` run the Triton kernels (``use_kernels`` and D <= ``MAX_KERNEL_D``)."""
    return use_kernels(q) and q.shape[-1] <= MAX_KERNEL_D


@triton_op("flexsparse::masked_linear")
def masked_linear(q: Tensor, k: Tensor, v: Tensor, skipped: Tensor, block_q: int, block_k: int, feature_map: str,
                  eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """Masked linear branch: ``o (B, H, Nq, D)`` in q's dtype and the query-block states (for the backward)
    ``H_i (B, H, Tq, D, D)`` (bf16 for bf16 inputs on the kernels, else fp32; fp64 for fp64) and ``Z_i (B, H, Tq,
    D)`` (fp32, fp64 for fp64). q ``(B, H, Nq, D)``; k, v ``(B, Hk, Nk, D)``; skipped ``(B, H, Tq, S)`` int32: the
    key blocks each query block leaves out, S < Tk."""
    if linear_kernels(q):
        from .fwd import linear_forward
        return linear_forward(*contiguous(q, k, v, skipped), block_q, block_k, feature_map, eps)
    return naive.masked_linear_with_states(q, k, v, skipped, block_q, block_k, feature_map, eps)


@triton_op("flexsparse::masked_linear_bwd")
def masked_linear_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, skipped: Tensor, rows_h: Tensor, rows_z: Tensor,
                      block_q: int, block_k: int, feature_map: str, eps: float, dq_add: Optional[Tensor] = None,
                      dk_add: Optional[Tensor] = None, dv_add: Optional[Tensor] = None,
                      o_l: Optional[Tensor] = None, weight: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients ``(dq, dk, dv)`` of ``masked_linear`` from ``do`` and its saved query-block states ``rows_h``,
    ``rows_z`` (``H_i``, ``Z_i``), plus ``dq_add``, ``dk_add``, ``dv_add`` (another branch's gradients of q, k, v,
    all three or none; the kernels add them before their one rounding). ``o_l``: the forward's output O_l (q's
    dtype), which the kernels read instead of recomputing it (the PyTorch path recomputes it). ``weight``: SLA's
    ``W (D, D)``; ``do`` is then the gradient of the combine ``O_s + O_l W^T + b`` and the branch's is ``do W`` in
    q's dtype: made in the query-gradient kernel for 16-bit inputs with D <= ``PROJECTED_MAX_D`` (a cast and a
    matmul fewer), else by a matmul first.

    With ``y = phi(Q_i) [H_i | Z_i] = [num | den]``: ``dy = [dO, -rowsum(dO . O)] / (eps + den)``,
    ``dphi(Q_i) = dy [H_i | Z_i]^T``, ``d[H_i | Z_i] = phi(Q_i)^T dy``; the key-block states get
    ``sum_i d[H_i | Z_i]`` minus the query blocks that skipped them; then ``dphi(K_j) = [V_j | 1] d[h_j | z_j]^T``,
    ``d[V_j | 1] = phi(K_j) d[h_j | z_j]``, and phi's gradient."""
    adds = None if dq_add is None else (dq_add, dk_add, dv_add)
    kernels = linear_kernels(q)
    if weight is not None and not (kernels and q.element_size() == 2 and q.shape[-1] <= PROJECTED_MAX_D):
        do, weight = do @ weight.to(do.dtype), None
    if kernels:
        from .bwd import linear_backward
        return linear_backward(*contiguous(do, q, k, v, skipped, rows_h, rows_z), block_q, block_k, feature_map,
                               eps, add=None if adds is None else contiguous(*adds),
                               o_l=None if o_l is None else o_l.contiguous(),
                               weight=None if weight is None else weight.contiguous())
    grads = naive.masked_linear_backward(do, q, k, v, skipped, rows_h, rows_z, block_q, block_k, feature_map, eps)
    return grads if adds is None else tuple(g + a for g, a in zip(grads, adds))


def _setup(ctx, inputs, output):
    q, k, v, skipped, block_q, block_k, feature_map, eps = inputs
    ctx.save_for_backward(q, k, v, skipped, output[1], output[2], output[0])
    ctx.mark_non_differentiable(output[1], output[2])
    ctx.set_materialize_grads(False)  # no zero-filled gradients of the (B, H, Tq, D, D) and (B, H, Tq, D) states
    ctx.args = (block_q, block_k, feature_map, eps)


def _backward(ctx, do, _rows_h, _rows_z):
    q, k, v, skipped, rows_h, rows_z, o_l = ctx.saved_tensors
    dq, dk, dv = masked_linear_bwd(do, q, k, v, skipped, rows_h, rows_z, *ctx.args, o_l=o_l)
    return dq, dk, dv, None, None, None, None, None


masked_linear.register_autograd(_backward, setup_context=_setup)


@triton_op("flexsparse::masked_linear_mix")
def masked_linear_mix(q: Tensor, k: Tensor, v: Tensor, skipped: Tensor, o_s: Tensor, weight: Optional[Tensor],
                      bias: Optional[Tensor], alpha_logit: Optional[Tensor], block_q: int, block_k: int,
                      feature_map: str, eps: float, store_linear: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The masked linear branch O_l (``masked_linear``) combined with the sparse output ``o_s (B, H, Nq, D)`` in
    the branch's output kernel: ``out = o_s + O_l W^T + bias`` (SLA: ``weight (D, D)``, ``bias (D,)``,
    alpha_logit None) or ``out = O_l + alpha (o_s - O_l)`` (SLA2: ``alpha = sigmoid(alpha_logit)``, ``alpha_logit
    (1 or H, Tq)`` per query block; weight and bias None). weight is cast to q's dtype; bias and alpha (an fp32
    sigmoid in the kernel) are rounded to it in the kernel, O_l is rounded to it before mixing (as the unfused
    methods do). Returns ``(out, o_l, rows_h, rows_z)``: o_l ``(B, H, Nq, D)`` when
    ``store_linear`` (the backward needs it) else empty, and the query-block states (``masked_linear``). Runs the
    kernels only (``linear_kernels(q)``)."""
    if not linear_kernels(q):
        raise ValueError("flexsparse::masked_linear_mix runs the Triton kernels only (CUDA, or CPU with "
                         f"TRITON_INTERPRET=1; fp16 / bf16 / fp32; D <= {MAX_KERNEL_D}), got {q.dtype} q of head dim "
                         f"{q.shape[-1]} on {q.device.type}; use masked_linear and combine in PyTorch")
    if (weight is None) == (alpha_logit is None):
        raise ValueError("masked_linear_mix takes either weight (and bias) or alpha_logit")
    from .fwd import Mix, linear_forward
    weight = None if weight is None else weight.to(q.dtype).contiguous()
    bias, alpha_logit = _mix_scalars(q, weight, bias, alpha_logit)
    out, rows_h, rows_z, o_l = linear_forward(*contiguous(q, k, v, skipped), block_q, block_k, feature_map, eps,
                                              mix=Mix(o_s.contiguous(), weight, bias, alpha_logit, store_linear))
    return out, (q.new_empty(0) if o_l is None else o_l), rows_h, rows_z


def _mix_scalars(q: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], alpha_logit: Optional[Tensor]):
    """``(bias, alpha_logit)`` as the mix kernels take them: contiguous, uncast (the kernels round the bias and
    alpha to q's dtype); SLA's missing bias as zeros, None where the mix has none."""
    bias = None if weight is None else q.new_zeros(q.shape[-1]) if bias is None else bias.contiguous()
    return bias, None if alpha_logit is None else alpha_logit.contiguous()


def _mix_setup(ctx, inputs, output):
    q, k, v, skipped, o_s, weight, bias, alpha_logit, block_q, block_k, feature_map, eps, _ = inputs
    _, o_l, rows_h, rows_z = output
    ctx.save_for_backward(q, k, v, skipped, rows_h, rows_z, o_l, o_s if alpha_logit is not None else None, weight,
                          alpha_logit)
    ctx.mark_non_differentiable(o_l, rows_h, rows_z)
    ctx.set_materialize_grads(False)  # no zero-filled gradients of o_l and the query-block states
    ctx.args = (block_q, block_k, feature_map, eps)
    ctx.bias_dtype = None if bias is None else bias.dtype


@triton_op("flexsparse::lerp_mix_bwd")
def lerp_mix_bwd(dout: Tensor, o_s: Tensor, o_l: Tensor, alpha_logit: Tensor,
                 block_q: int) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of SLA2's combine ``out = O_l + alpha (o_s - O_l)``, ``alpha = sigmoid(alpha_logit)``: ``(d o_s,
    d O_l, d alpha_logit)``. dout, o_s, o_l ``(B, H, Nq, D)`` one dtype; alpha_logit ``(1 or H, Tq)`` in any float
    dtype (alpha, its fp32 sigmoid, rounded to theirs as the forward mixed); ``d o_s = alpha dout`` and ``d O_l =
    (1 - alpha) dout`` in fp32, rounded once; d alpha_logit fp32: ``dout . (o_s - O_l)`` summed over each query
    block's tokens and the head dim, times ``alpha (1 - alpha)``, then summed over the batch (and the heads for one
    logit row). Kernel ``lerp_bwd`` (one pass); the PyTorch path is the same math in several passes."""
    if use_kernels(dout):
        from .lerp_bwd import lerp_backward
        d_os, d_ol, part = lerp_backward(*contiguous(dout, o_s, o_l, alpha_logit), block_q)
    else:
        d_os, d_ol, part = naive.lerp_mix_backward(dout, o_s, o_l, alpha_logit, block_q)
    return d_os, d_ol, part.sum(0) if alpha_logit.shape[0] > 1 else part.sum((0, 1)).unsqueeze(0)   # part (B, H, Tq)


def column_sums(x: Tensor, dtype: torch.dtype) -> Tensor:
    """``x (R, D)`` summed over its rows, in ``dtype`` with fp32 (or wider) accumulation: ``(D,)``. From
    ``SUMS_BY_MATMUL`` rows, a matmul with a column of ones: torch's sum over dim 0 of a few columns took 75.8 us
    against 23 at 262144 x 64 bf16 rows and 248 against 80 at 2^20 x 128 (H200); at 4096 rows 11 against 9, less
    than the host time of the ones' fill. A symbolic row count takes the sum (``sizes.static``)."""
    if not static(x.shape[0]) or x.shape[0] < SUMS_BY_MATMUL:
        return x.sum(0, dtype=dtype)
    from .dense import matmul
    return matmul(x.T.unsqueeze(0), x.new_ones(1, x.shape[0], 1), dtype).view(-1)


def _combine_grads(dout: Tensor, o_s: Optional[Tensor], o_l: Tensor, weight: Optional[Tensor],
                   alpha_logit: Optional[Tensor], block_q: int, bias_dtype: Optional[torch.dtype]):
    """Gradients of the combine: ``(d o_s, upstream, d weight, d bias, d alpha_logit)`` (None where absent),
    ``upstream`` the linear branch's gradient as ``masked_linear_bwd`` takes it with the combine's ``weight``: SLA's
    ``dout`` (its kernel makes ``d O_l = dout W``), SLA2's ``d O_l``."""
    if o_l.numel() == 0:
        raise RuntimeError("the linear branch was mixed with store_linear=False; pass True when gradients are needed")
    d_weight = d_bias = d_logit = None
    if weight is not None:                          # out = o_s + O_l W^T + b
        from .dense import matmul
        d_os, upstream = dout, dout
        flat = dout.flatten(0, 2)
        d_weight = matmul(flat.T.unsqueeze(0), o_l.flatten(0, 2).unsqueeze(0), weight.dtype)[0]  # one rounding
        d_bias = None if bias_dtype is None else column_sums(flat, bias_dtype)
    else:                                           # out = O_l + alpha (o_s - O_l)
        d_os, upstream, d_logit = lerp_mix_bwd(dout, o_s, o_l, alpha_logit, block_q)
        d_logit = d_logit.to(alpha_logit.dtype)
    return d_os, upstream, d_weight, d_bias, d_logit


def _mix_backward(ctx, dout, _do_l, _drows_h, _drows_z):
    q, k, v, skipped, rows_h, rows_z, o_l, o_s, weight, alpha_logit = ctx.saved_tensors
    d_os, upstream, d_weight, d_bias, d_logit = _combine_grads(dout, o_s, o_l, weight, alpha_logit, ctx.args[0],
                                                               ctx.bias_dtype)
    dq, dk, dv = masked_linear_bwd(upstream, q, k, v, skipped, rows_h, rows_z, *ctx.args, o_l=o_l, weight=weight)
    return dq, dk, dv, None, d_os, d_weight, d_bias, d_logit, None, None, None, None, None


masked_linear_mix.register_autograd(_mix_backward, setup_context=_mix_setup)


@triton_op("flexsparse::sparse_linear_mix")
def sparse_linear_mix(q: Tensor, k: Tensor, v: Tensor, indices: Tensor, skipped: Tensor, weight: Optional[Tensor],
                      bias: Optional[Tensor], alpha_logit: Optional[Tensor], block_q: int, block_k: int, scale: float,
                      deterministic: bool, feature_map: str, eps: float, store_linear: bool, fp8: bool,
                      k_mean: Optional[Tensor] = None, smooth_keys: bool = True, q8: Optional[Tensor] = None,
                      q_scales: Optional[Tensor] = None, k8: Optional[Tensor] = None, k_scales: Optional[Tensor] = None,
                      v_amax: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """SLA's and SLA2's two branches in one op: the block-sparse branch (``block_sparse.op.block_attn``: ``o_s``, LSE
    over the selected blocks ``indices``; with ``fp8`` the FP8 forward ``block_attn_fp8`` of the QAT branch) and
    ``masked_linear_mix`` of it. One op so that its backward runs the sparse branch's gradients first (at the o_s and
    LSE it stored: for ``fp8`` the QAT gradients) and the linear kernels add theirs to them (one pass fewer over dq,
    dk and dv than two ops whose gradients autograd sums). On the dense strategy the sparse forward and the output
    kernel are one kernel (``_mixed_in_sparse_epilogue``; o_s empty without ``store_linear``): bf16 on sm_90 in Gluon,
    FP8 after its pre-pass in Gluon at D = 128 on sm_90 and in Triton otherwise. Returns ``(out, lse, o_s, o_l, rows_h,
    rows_z)``; arguments as the two ops (kernels only: ``linear_kernels(q)``; ``k_mean``, ``smooth_keys`` and
    ``q8 ... v_amax`` as ``block_attn_fp8``'s)."""
    from ..block_sparse.op import block_attn, block_attn_fp8, checked_pooled
    q, k, v, indices, skipped = contiguous(q, k, v, indices, skipped)  # once, before the Gluon kernels' checks
    pooled = checked_pooled(smooth_keys, q8, q_scales, k8, k_scales, v_amax)
    mixed = _mixed_in_sparse_epilogue(q, k, v, indices, skipped, weight, bias, alpha_logit, block_q, block_k, scale,
                                      feature_map, eps, store_linear, fp8, k_mean, smooth_keys, pooled)
    if mixed is not None:
        return mixed
    if fp8:
        o_s, lse = block_attn_fp8.body(q, k, v, indices, block_q, block_k, scale, deterministic, k_mean, smooth_keys,
                                       q8, q_scales, k8, k_scales, v_amax)
    else:
        o_s, lse = block_attn.body(q, k, v, indices, block_q, block_k, scale, deterministic)
    out, o_l, rows_h, rows_z = masked_linear_mix.body(q, k, v, skipped, o_s, weight, bias, alpha_logit, block_q,
                                                      block_k, feature_map, eps, store_linear)
    return out, lse, o_s, o_l, rows_h, rows_z


def _mixed_in_sparse_epilogue(q, k, v, indices, skipped, weight, bias, alpha_logit, block_q, block_k, scale,
                              feature_map, eps, store_linear, fp8=False, k_mean=None, smooth_keys=True,
                              pooled=None):
    """``sparse_linear_mix``'s results from a kernel that mixes the linear branch in the sparse forward's epilogue,
    or ``None`` where none runs. bf16: the Gluon ``mix_ws`` where the sparse forward would run its Gluon kernel
    (``block_sparse.fwd.gluon_runs``); with ``fp8`` the Gluon ``mix_ws_fp8`` where ``mix_ws_fp8.supported`` and no
    ``block_fwd_fp8`` tile override, else for SLA2's lerp the Triton ``mix_fp8`` (any float dtype, D <=
    ``MIXED_FP8_MAX_D``; SLA's projection was slower there, see its docstring). All on the dense strategy (the
    gather strategy sums the states in the output kernel). O_s is not stored without ``store_linear``. q, k, v,
    indices and skipped: contiguous; ``k_mean``, ``smooth_keys`` and ``pooled`` for ``fp8`` (``block_attn_fp8``'s)."""
    from ..block_sparse.fwd import gluon_runs
    from ..block_sparse.op import fp8_key_shift
    from .gluon import mix_ws, mix_ws_fp8
    from .fwd import dense_query_states
    if fp8:
        from .mix_fp8 import sparse_linear_forward_fp8, sparse_linear_fp8_stored
        if mix_ws_fp8 is not None and not overrides("block_fwd_fp8") and mix_ws_fp8.supported(q, indices, block_q,
                                                                                              block_k):
            run = mix_ws_fp8.ws_sparse_linear_forward_fp8 if launching_directly() else mix_ws_fp8.sparse_linear_fp8_ws
        elif alpha_logit is not None and q.shape[-1] <= MIXED_FP8_MAX_D:
            run = sparse_linear_forward_fp8 if launching_directly() or not store_linear else sparse_linear_fp8_stored
        else:
            return None
    elif q.dtype == torch.bfloat16 and gluon_runs(q, k, v, indices, block_q, block_k):
        run = mix_ws.ws_sparse_linear_forward if launching_directly() else mix_ws.sparse_linear_ws
    else:
        return None
    states = dense_query_states(q, k, v, skipped, block_k, feature_map)
    if states is None:
        return None
    weight_t = None if weight is None else weight.t().to(q.dtype, memory_format=torch.contiguous_format)  # one copy
    bias, alpha_logit = _mix_scalars(q, weight, bias, alpha_logit)
    fp8_args = {"k_mean": fp8_key_shift(k, k_mean, smooth_keys), "pooled": pooled or []} if fp8 else {}
    out, lse, o_s, o_l = run(q, k, v, indices, *states, weight_t, bias, alpha_logit, block_q, block_k, scale,
                             feature_map, eps, store_linear, **fp8_args)
    return out, lse, o_s, o_l, *states


def _sparse_mix_setup(ctx, inputs, output):
    q, k, v, indices, skipped, weight, bias, alpha_logit = inputs[:8]
    block_q, block_k, scale, deterministic, feature_map, eps = inputs[8:14]
    _, lse, o_s, o_l, rows_h, rows_z = output
    ctx.save_for_backward(q, k, v, indices, skipped, rows_h, rows_z, o_s, lse, o_l, weight, alpha_logit)
    ctx.mark_non_differentiable(o_s, o_l, rows_h, rows_z)
    ctx.set_materialize_grads(False)  # no zero-filled gradients of the internal outputs
    ctx.args = (block_q, block_k, scale, deterministic, feature_map, eps)
    ctx.bias_dtype = None if bias is None else bias.dtype


def _sparse_mix_backward(ctx, dout, dlse, _do_s, _do_l, _drows_h, _drows_z):
    from ..block_sparse.op import block_attn_bwd
    q, k, v, indices, skipped, rows_h, rows_z, o_s, lse, o_l, weight, alpha_logit = ctx.saved_tensors
    block_q, block_k, scale, deterministic, feature_map, eps = ctx.args
    if dout is None:                                # only the LSE reaches the loss
        dout = torch.zeros_like(o_s)
    d_os, upstream, d_weight, d_bias, d_logit = _combine_grads(dout, o_s, o_l, weight, alpha_logit, block_q,
                                                               ctx.bias_dtype)
    dq, dk, dv = block_attn_bwd(d_os, dlse, q, k, v, indices, o_s, lse, block_q, block_k, scale, deterministic)
    dq, dk, dv = masked_linear_bwd(upstream, q, k, v, skipped, rows_h, rows_z, block_q, block_k, feature_map, eps, dq,
                                   dk, dv, o_l, weight)
    return (dq, dk, dv, None, None, d_weight, d_bias, d_logit) + (None,) * 15


sparse_linear_mix.register_autograd(_sparse_mix_backward, setup_context=_sparse_mix_setup)
