"""``torch.library`` ops of the LLSA attention kernels (namespace ``flexsparse``): ``llsa_attn`` (O, LSE;
differentiable) and ``llsa_attn_bwd``.

``triton_op`` + ``wrap_triton`` make the kernels visible to ``torch.compile(fullgraph=True)``
(forward and backward, no graph breaks); the fake implementations are the op bodies themselves. Plain
eager calls skip the dispatcher (``_runtime.registry``).
Every body branches on the device: CUDA runs the kernels; CPU runs them through the Triton
interpreter when ``TRITON_INTERPRET=1`` is set (eager only), else the PyTorch implementation (``naive``).
fp64 always takes the PyTorch path. Pyramids are ``(B, H, T_1 + ... + T_L, D)`` and selections packed
``(B, H, sum_l T_l K_l)`` int32 (``flexsparse.masks.levels``).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ...masks import Levels, level_table
from .._runtime.registry import triton_op
from ..common.inputs import contiguous, row_views, use_kernels
from . import naive


def _torch_attention(q, k, v, kc, vc, sel, levels: Levels, scale: float):
    return naive.llsa_attention(q, [k, *levels.split_pyramid(kc)], [v, *levels.split_pyramid(vc)], levels.unpack(sel),
                                scale)


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
    from .fwd import llsa_forward
    return llsa_forward(*row_views(q, k, v), *contiguous(kc, vc, sel), levels, scale)


def _torch_backward(do, dlse, q, k, v, kc, vc, sel, o, lse, levels: Levels, scale: float, fuse_pool: bool):
    dq, dks, dvs = naive.llsa_attention_backward(do, dlse, q, [k, *levels.split_pyramid(kc)],
                                                 [v, *levels.split_pyramid(vc)], levels.unpack(sel), scale, o, lse)
    dk, dkc, dv, dvc = dks[0], torch.cat(dks[1:], dim=2), dvs[0], torch.cat(dvs[1:], dim=2)
    if fuse_pool:
        dk = dk + naive.unpool(dkc, levels).to(dk.dtype)
        dv = dv + naive.unpool(dvc, levels).to(dv.dtype)
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
        from ..common.csc import selection_csc
        from .bwd import llsa_backward
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
    ctx.set_materialize_grads(False)  # an unused LSE gets no zero-filled gradient (dlse=None skips it)


def _backward(ctx, do, dlse):
    q, k, v, kc, vc, sel, o, lse = ctx.saved_tensors
    block, topk, scale, fuse_pool, deterministic = ctx.args
    if do is None:                                  # only the LSE reaches the loss
        do = torch.zeros_like(o)
    dq, dk, dv, dkc, dvc = llsa_attn_bwd(do, dlse, q, k, v, kc, vc, sel, o, lse, block, topk, scale, fuse_pool,
                                         deterministic)
    if fuse_pool:
        dkc = dvc = None
    return dq, dk, dv, dkc, dvc, None, None, None, None, None, None


llsa_attn.register_autograd(_backward, setup_context=_setup)
