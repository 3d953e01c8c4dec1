"""``torch.library`` ops of the LLSA Triton kernels (namespace ``flexsparse``).

``triton_op`` + ``wrap_triton`` make the kernels visible to ``torch.compile(fullgraph=True)``
(forward and backward, no graph breaks); the fake implementations are the op bodies themselves. Plain
eager calls skip the dispatcher (``registry``).
Every body branches on the device: CUDA runs the kernels; CPU runs them through the Triton
interpreter when ``TRITON_INTERPRET=1`` is set (eager only), else falls back to the ``torch``
backend. fp64 always takes the fallback.

Ops: ``contiguous_rows`` (a contiguous copy of a ``(B, H, N, D)`` view with strided token rows; differentiable),
``llsa_pool`` (pooling pyramid), ``llsa_pool_qkv`` (LLSA's pyramids of q, k and v in one pass),
``llsa_select`` (packed hierarchical selection), ``llsa_attn`` (O, LSE; differentiable) and ``llsa_attn_bwd``.
Pyramids are ``(B, H, T_1 + ... + T_L, D)`` fp32 and selections packed ``(B, H, sum_l T_l K_l)`` int32
(``flexsparse.triton.layout``).
"""
from __future__ import annotations

import os
from typing import Optional

import torch
from torch import Tensor

from ..backends import torch_sparse
from ..masks import hierarchical_topk, pool_pyramid
from .layout import Levels, level_table, pack
from .registry import triton_op


def interpreting() -> bool:
    """Whether the Triton interpreter is on (it must be set before the kernel modules are imported)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def use_kernels(x: Tensor) -> bool:
    """Whether an op on ``x`` runs the Triton kernels (else the torch fallback): CUDA, or CPU with the
    interpreter; fp16/bf16/fp32 only."""
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return False
    return x.device.type == "cuda" or (x.device.type == "cpu" and interpreting())


def contiguous(*tensors: Tensor) -> list[Tensor]:
    """The tensors made contiguous (the kernels take strides of the leading dims only). A ``(B, H, N, D)`` view with
    contiguous rows, e.g. an upstream gradient through a model's ``out.transpose(1, 2).reshape(B, N, H * D)``, is
    copied by the row-copy kernel (``rows``), twice as fast as PyTorch's strided copy."""
    return [t if t.is_contiguous() else _copied(t) for t in tensors]


def row_views(*tensors: Tensor) -> list[Tensor]:
    """The tensors as they are where their last dim is contiguous (kernels that take the other strides read such
    views in place, e.g. q, k, v of one fused projection), else contiguous copies (``contiguous``)."""
    return [t if t.stride(-1) == 1 else _copied(t) for t in tensors]


def _copied(t: Tensor) -> Tensor:
    """A contiguous copy of the non-contiguous ``t`` (``contiguous``)."""
    if t.dim() == 4 and t.stride(-1) == 1 and use_kernels(t):
        from .rows import copy_rows
        return copy_rows(t)
    return t.contiguous()


@triton_op("flexsparse::contiguous_rows")
def contiguous_rows(x: Tensor) -> Tensor:
    """A new contiguous tensor with the values of ``x (B, H, N, D)``: kernel ``rows`` where x's last dim is contiguous
    (the speed of a contiguous clone), else PyTorch's copy (``contiguous``). The gradient passes through unchanged."""
    return x.clone() if x.is_contiguous() else _copied(x)


contiguous_rows.register_autograd(lambda ctx, grad: grad, setup_context=lambda ctx, inputs, output: None)


@triton_op("flexsparse::llsa_pool")
def llsa_pool(x: Tensor, block: int, levels: int) -> Tensor:
    """Levels 1..L of the mean-pooling pyramid of ``x (B, H, N, D)``, concatenated: ``(B, H, sum T_l, D)``,
    fp32 (fp64 for fp64). Not differentiable (the attention backward pools the gradients itself)."""
    if not use_kernels(x):
        return torch.cat(pool_pyramid(x, block, levels), dim=2)
    from .pool import pool_pyramid as pool_kernel
    return pool_kernel(*row_views(x), level_table(x.shape[2], block, [1] * levels))


@triton_op("flexsparse::llsa_pool_qkv")
def llsa_pool_qkv(q: Tensor, k: Tensor, v: Tensor, block: int, levels: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """LLSA's pyramids (``llsa_pool``'s layout) of q, k and v from one pass over them: q's and k's in fp32
    (selection scores) and k's and v's means rounded to their dtype (what the attention reads): ``(q_pyr, k_scores,
    k_pyr, v_pyr)``. Not differentiable."""
    if not use_kernels(q):
        q_pyr, k_scores, v_scores = (torch.cat(pool_pyramid(x, block, levels), dim=2) for x in (q, k, v))
        return q_pyr, k_scores, k_scores.to(k.dtype, copy=True), v_scores.to(v.dtype, copy=True)
    from .pool import pool_qkv
    return pool_qkv(*row_views(q, k, v), level_table(q.shape[2], block, [1] * levels))


@triton_op("flexsparse::llsa_select")
def llsa_select(q_pyr: Tensor, k_pyr: Tensor, n: int, block: int, topk: list[int]) -> Tensor:
    """Packed hierarchical top-K ``(B, H, S)`` int32 from pooled pyramids (``llsa_pool`` of q and k)."""
    levels = level_table(n, block, topk)
    if not use_kernels(q_pyr):
        sel = hierarchical_topk(levels.split_pyramid(q_pyr), levels.split_pyramid(k_pyr), tuple(topk), block, n)
        return pack(sel)
    from .select import hierarchical_topk as select_kernel
    return select_kernel(q_pyr.contiguous(), k_pyr.contiguous(), levels)


def _torch_attention(q, k, v, kc, vc, sel, levels: Levels, scale: float):
    return torch_sparse.llsa_attention(q, [k, *levels.split_pyramid(kc)], [v, *levels.split_pyramid(vc)],
                                       levels.unpack(sel), scale)


@triton_op("flexsparse::llsa_attn")
def llsa_attn(q: Tensor, k: Tensor, v: Tensor, kc: Tensor, vc: Tensor, sel: Tensor, block: int, topk: list[int],
              scale: float, fuse_pool: bool, deterministic: bool) -> tuple[Tensor, Tensor]:
    """LLSA output ``(B, H, N, D)`` and natural-log LSE ``(B, H, N)`` fp32.

    kc, vc: pooled pyramids of k and v; sel: packed selection. With ``fuse_pool`` the gradients of
    k and v include the paths through the pyramids and kc, vc get none (pass them detached);
    without it kc and vc get their own gradients. ``deterministic`` makes dK/dV bitwise reproducible.
    """
    levels = level_table(q.shape[2], block, topk)
    if not use_kernels(q):
        return _torch_attention(q, k, v, kc, vc, sel, levels, scale)
    from .llsa_fwd import llsa_forward
    return llsa_forward(*row_views(q, k, v), *contiguous(kc, vc, sel), levels, scale)


def _unpool(grad_pyr: Tensor, levels: Levels) -> Tensor:
    """Backward of the pooling pyramid: ``(B, H, sum T_l, D)`` -> ``(B, H, N, D)``."""
    out = 0
    for level, grad in enumerate(levels.split_pyramid(grad_pyr), start=1):
        span = levels.block**level
        counts = (levels.n - torch.arange(grad.shape[2], device=grad.device) * span).clamp(max=span)
        out = out + (grad / counts.to(grad.dtype)[:, None]).repeat_interleave(span, dim=2)[:, :, :levels.n]
    return out


def _torch_backward(do, dlse, q, k, v, kc, vc, sel, o, lse, levels: Levels, scale: float, fuse_pool: bool):
    from .fallback import llsa_attention_backward
    dq, dks, dvs = llsa_attention_backward(do, dlse, q, [k, *levels.split_pyramid(kc)], [v, *levels.split_pyramid(vc)],
                                           levels.unpack(sel), scale, o, lse)
    dk, dkc, dv, dvc = dks[0], torch.cat(dks[1:], dim=2), dvs[0], torch.cat(dvs[1:], dim=2)
    if fuse_pool:
        dk = dk + _unpool(dkc, levels).to(dk.dtype)
        dv = dv + _unpool(dvc, levels).to(dv.dtype)
    return dq, dk, dv, dkc, dvc


@triton_op("flexsparse::llsa_attn_bwd")
def llsa_attn_bwd(do: Tensor, dlse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, kc: Tensor, vc: Tensor,
                  sel: Tensor, o: Tensor, lse: Tensor, block: int, topk: list[int], scale: float, fuse_pool: bool,
                  deterministic: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients ``(dq, dk, dv, dkc, dvc)`` of ``llsa_attn`` (see there for ``fuse_pool``; with it dk and dv hold the
    pyramids' share and dkc, dvc are empty)."""
    levels = level_table(q.shape[2], block, topk)
    if not use_kernels(q):
        dq, dk, dv, dkc, dvc = _torch_backward(do, dlse, q, k, v, kc, vc, sel, o, lse, levels, scale, fuse_pool)
    else:
        from .csc import selection_csc
        from .llsa_bwd import llsa_backward
        q, k, v, o, do = row_views(q, k, v, o, do)
        kc, vc, sel, lse = contiguous(kc, vc, sel, lse)
        offsets, rows = selection_csc(sel, levels, deterministic)
        dlse = None if dlse is None else dlse.contiguous()
        dq, dk, dv, dkc, dvc = llsa_backward(do, dlse, q, k, v, kc, vc, sel, offsets, rows, o, lse, levels, scale,
                                             fuse_pool)
    if fuse_pool:       # no cast of the pyramids' gradients nobody reads (two passes, ~19 us at B2 H8 N65536 D64)
        return dq, dk, dv, kc.new_empty(0), vc.new_empty(0)
    return dq, dk, dv, dkc.to(kc.dtype), dvc.to(vc.dtype)


def _setup(ctx, inputs, output):
    q, k, v, kc, vc, sel, block, topk, scale, fuse_pool, deterministic = inputs
    ctx.save_for_backward(q, k, v, kc, vc, sel, *output)
    ctx.args = (block, topk, scale, fuse_pool, deterministic)


def _backward(ctx, do, dlse):
    q, k, v, kc, vc, sel, o, lse = ctx.saved_tensors
    block, topk, scale, fuse_pool, deterministic = ctx.args
    dq, dk, dv, dkc, dvc = llsa_attn_bwd(do, dlse, q, k, v, kc, vc, sel, o, lse, block, topk, scale, fuse_pool,
                                         deterministic)
    if fuse_pool:
        dkc = dvc = None
    return dq, dk, dv, dkc, dvc, None, None, None, None, None, None


llsa_attn.register_autograd(_backward, setup_context=_setup)
