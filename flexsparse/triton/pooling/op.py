"""``torch.library`` ops of the pooling kernels (namespace ``flexsparse``): ``llsa_pool`` (the pooling pyramid),
``llsa_pool_qkv`` (LLSA's pyramids of q, k and v in one pass over them), ``block_means_pair`` (the block routers'
pooled q and k in one launch), ``coarse_means`` (VSA's pooled q, k and v in one launch) and ``center_tokens``
(``x - mean``).

Registered with ``triton_op`` (``torch.compile(fullgraph=True)`` sees the kernels; the bodies are their own fake
implementations; plain eager calls skip the dispatcher). Where the kernels do not run (``common.inputs.use_kernels``:
CPU without the interpreter, fp64) the bodies run the PyTorch implementation, ``naive``. Pyramids are
``(B, H, T_1 + ... + T_L, D)`` (``flexsparse.masks.levels``).
"""
from __future__ import annotations

import torch
from torch import Tensor

from ...masks import accumulation_dtype, level_table
from .._runtime.registry import triton_op
from ..common.inputs import row_views, use_kernels
from . import naive


@triton_op("flexsparse::llsa_pool")
def llsa_pool(x: Tensor, block: int, levels: int) -> Tensor:
    """Levels 1..L of the mean-pooling pyramid of ``x (B, H, N, D)``, concatenated: ``(B, H, sum T_l, D)``,
    fp32 (fp64 for fp64). Not differentiable (the attention backward pools the gradients itself)."""
    if not use_kernels(x):
        return torch.cat(naive.pool_pyramid(x, block, levels), dim=2)
    from .pool import pool_pyramid
    return pool_pyramid(*row_views(x), level_table(x.shape[2], block, [1] * levels))


@triton_op("flexsparse::llsa_pool_qkv")
def llsa_pool_qkv(q: Tensor, k: Tensor, v: Tensor, block: int, levels: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """LLSA's pyramids (``llsa_pool``'s layout) of q, k and v from one pass over them: q's and k's in fp32
    (selection scores) and k's and v's means rounded to their dtype (what the attention reads): ``(q_pyr, k_scores,
    k_pyr, v_pyr)``. Not differentiable."""
    if not use_kernels(q):
        q_pyr, k_scores, v_scores = (torch.cat(naive.pool_pyramid(x, block, levels), dim=2) for x in (q, k, v))
        return q_pyr, k_scores, k_scores.to(k.dtype, copy=True), v_scores.to(v.dtype, copy=True)
    from .pool import pool_qkv
    return pool_qkv(*row_views(q, k, v), level_table(q.shape[2], block, [1] * levels))


@triton_op("flexsparse::block_means_pair")
def block_means_pair(q: Tensor, k: Tensor, block_q: int, block_k: int) -> tuple[Tensor, Tensor, Tensor]:
    """Block means of q ``(B, H, Nq, D)`` over ``block_q`` tokens and of k ``(B, Hk, Nk, D)`` over ``block_k`` in the
    accumulation dtype (true means on ragged tails), and k's block sums (``naive.block_sums``). Differentiable: the
    gradients of the means and sums broadcast to their tokens (``naive.block_sums_backward``). One launch
    (``pair.pair_means``) where ``pair.pair_runs``, else the PyTorch path."""
    from .pair import pair_means, pair_runs
    if use_kernels(q) and pair_runs(q, k):
        return pair_means(*row_views(q, k), block_q, block_k)
    return naive.block_pooling(q, k, block_q, block_k)


def _pair_setup(ctx, inputs, output):
    q, k, block_q, block_k = inputs
    ctx.q, ctx.k = (q.shape[2], block_q, q.dtype), (k.shape[2], block_k, k.dtype)
    ctx.set_materialize_grads(False)


def _pair_backward(ctx, d_q_means, d_k_means, d_k_sums):
    (nq, block_q, q_dtype), (nk, block_k, k_dtype) = ctx.q, ctx.k
    need_q, need_k = ctx.needs_input_grad[:2]
    dq = None if d_q_means is None or not need_q else naive.block_means_backward(d_q_means, nq, block_q, q_dtype)
    if d_k_means is not None:                     # d sum = d mean / token count
        d_k_sums = naive.block_means(d_k_means, nk, block_k) + (0 if d_k_sums is None else d_k_sums)
    dk = None if d_k_sums is None or not need_k else naive.block_sums_backward(d_k_sums, nk, block_k, k_dtype)
    return dq, dk, None, None


block_means_pair.register_autograd(_pair_backward, setup_context=_pair_setup)


def _coarse_kernels(q: Tensor, k: Tensor) -> bool:
    """Whether ``coarse_means`` and its backward run their kernels (``pair.pair_runs``)."""
    from .pair import pair_runs
    return use_kernels(q) and pair_runs(q, k)


@triton_op("flexsparse::coarse_means")
def coarse_means(q: Tensor, k: Tensor, v: Tensor, block_q: int,
                 block_k: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``naive.coarse_pooling``'s five results (q's and k's block means in the accumulation dtype, the means of q, k
    and v rounded to their dtypes), each its own tensor. Differentiable: the gradients of the means broadcast to
    their tokens (a rounded mean's gradient as its mean's). One launch each way (``pair.coarse_means``,
    ``pair.coarse_grads``) where ``_coarse_kernels``, else the PyTorch path."""
    if _coarse_kernels(q, k):
        from .pair import coarse_means as coarse_kernel
        return coarse_kernel(*row_views(q, k, v), block_q, block_k)
    q_means, k_means = naive.mean_pool(q, block_q), naive.mean_pool(k, block_k)
    return (q_means, k_means, q_means.to(q.dtype, copy=True), k_means.to(k.dtype, copy=True),
            naive.mean_pool(v, block_k).to(v.dtype, copy=True))


def _coarse_setup(ctx, inputs, output):
    q, k, v, block_q, block_k = inputs
    ctx.shapes, ctx.dtypes, ctx.blocks = (q.shape, k.shape, v.shape), (q.dtype, k.dtype, v.dtype), (block_q, block_k)
    ctx.kernel = _coarse_kernels(q, k)
    ctx.set_materialize_grads(False)


def _coarse_backward(ctx, *grads):
    """``grads``: of ``(q_means, k_means, q_tiles, k_tiles, v_tiles)``, ``None`` where absent."""
    needed, (block_q, block_k) = ctx.needs_input_grad[:3], ctx.blocks
    if ctx.kernel and any(g is not None for g in grads):
        from .pair import coarse_grads
        grads = [g if g is None else g.contiguous() for g in grads]
        return *coarse_grads(ctx.shapes[0], ctx.shapes[1], ctx.dtypes, grads, needed, block_q, block_k), None, None
    d_q_means, d_k_means, d_q_tiles, d_k_tiles, d_v_tiles = grads
    out = []
    for means, tiles, shape, dtype, block, need in zip((d_q_means, d_k_means, None), (d_q_tiles, d_k_tiles, d_v_tiles),
                                                       ctx.shapes, ctx.dtypes, (block_q, block_k, block_k), needed):
        tiles = None if tiles is None else tiles.to(accumulation_dtype(dtype))     # the rounding's gradient
        total = tiles if means is None else means if tiles is None else means + tiles
        out.append(None if total is None or not need else naive.block_means_backward(total, shape[2], block, dtype))
    return *out, None, None


coarse_means.register_autograd(_coarse_backward, setup_context=_coarse_setup)


@triton_op("flexsparse::center_tokens")
def center_tokens(x: Tensor, mean: Tensor) -> Tensor:
    """``x - mean``: x ``(B, H, N, D)``, mean ``(B, H, 1, D)`` in the accumulation dtype; the difference in that
    dtype rounded once to x's (SLA2's smoothed keys and their gradient). Kernel ``center`` (one pass)."""
    if not use_kernels(x):
        return naive.center(x, mean)
    from .center import center
    return center(x if x.stride(-1) == 1 else x.contiguous(), mean)
