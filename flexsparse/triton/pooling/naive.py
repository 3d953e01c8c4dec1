"""Pooling in PyTorch: block sums and means over token blocks, the pooling pyramid and the key mean of
smoothing (the ``torch`` and ``flex`` backends', and the CPU branch of the pooling ops).

Ragged tails are true means over the real tokens: padding never enters a pooled mean.
Sums are accumulated in fp32 (or fp64 for fp64 inputs) and the means are returned in that
accumulation dtype; callers cast where they need the input dtype.
"""
from __future__ import annotations

import torch

from ...masks import accumulation_dtype, level_span, token_counts


def block_sums(x: torch.Tensor, block: int) -> torch.Tensor:
    """Sums over consecutive blocks of ``block`` tokens along dim -2 (a ragged tail block sums its real tokens).

    x: ``(..., N, D)`` -> ``(..., ceil(N/block), D)`` in the accumulation dtype. Differentiable. One pass
    over x forward and one write of its gradient backward: no padded or widened copy of x (a padded copy
    cost two full passes over q and k at ragged lengths), and no zero-filled slice gradients.
    """
    if torch.is_grad_enabled() and x.requires_grad:
        return _BlockSums.apply(x, block)
    return _sums(x, block)     # no autograd node to record: apply alone costs ~3x the sum's host time


def _sums(x: torch.Tensor, block: int) -> torch.Tensor:
    acc = accumulation_dtype(x.dtype)
    whole = x.shape[-2] // block
    sums = x[..., :whole * block, :].unflatten(-2, (whole, block)).sum(-2, dtype=acc)
    if whole * block == x.shape[-2]:
        return sums
    return torch.cat([sums, x[..., whole * block:, :].sum(-2, keepdim=True, dtype=acc)], dim=-2)


class _BlockSums(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, block: int) -> torch.Tensor:
        ctx.block, ctx.n, ctx.dtype = block, x.shape[-2], x.dtype
        return _sums(x, block)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return block_sums_backward(grad, ctx.n, ctx.block, ctx.dtype), None


def block_sums_backward(grad: torch.Tensor, n: int, block: int, dtype: torch.dtype) -> torch.Tensor:
    """The gradient of ``block_sums`` of ``n`` tokens: each block's gradient ``(..., T, D)`` broadcast to its tokens,
    ``(..., n, D)``, cast to ``dtype`` in the same pass."""
    whole = n // block
    out = grad.new_empty(*grad.shape[:-2], n, grad.shape[-1], dtype=dtype)
    out[..., :whole * block, :].unflatten(-2, (whole, block)).copy_(grad[..., :whole, None, :])
    if whole * block < n:
        out[..., whole * block:, :].copy_(grad[..., whole:, :])
    return out


def mean_pool(x: torch.Tensor, block: int) -> torch.Tensor:
    """Block means over ``block`` consecutive tokens (true means on the ragged tail).

    x: ``(..., N, D)`` -> ``(..., ceil(N/block), D)`` in the accumulation dtype.
    """
    return block_means(block_sums(x, block), x.shape[-2], block)


def block_pooling(q: torch.Tensor, k: torch.Tensor, block_q: int,
                  block_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A block method's pooled q and k: ``(mean_pool(q, block_q), mean_pool(k, block_k), block_sums(k, block_k))``,
    ``(B, H, Tq, D)``, ``(B, Hk, Tk, D)`` twice, in the accumulation dtype (k's means from its sums: one pass)."""
    k_sums = block_sums(k, block_k)
    return mean_pool(q, block_q), block_means(k_sums, k.shape[-2], block_k), k_sums


def coarse_pooling(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_q: int, block_k: int):
    """VSA's pooled tiles: ``(q_means, k_means, q_tiles, k_tiles, v_tiles)``, q's ``(B, H, Tq, D)`` and k's
    ``(B, Hk, Tk, D)`` block means in the accumulation dtype (the router's inputs) and the block means of q, k and v
    rounded to their dtypes (the coarse branch's). Differentiable."""
    q_means, k_means = mean_pool(q, block_q), mean_pool(k, block_k)
    return q_means, k_means, q_means.to(q.dtype), k_means.to(k.dtype), mean_pool(v, block_k).to(v.dtype)


def block_means(sums: torch.Tensor, n: int, block: int) -> torch.Tensor:
    """``block_sums`` of ``n`` tokens -> block means (true means on the ragged tail): ``(..., T, D)``."""
    return sums / _divisors(n, block, sums)


def block_means_backward(grad: torch.Tensor, n: int, block: int, dtype: torch.dtype) -> torch.Tensor:
    """The gradient of ``mean_pool`` of ``n`` tokens, in ``dtype``, from the means' gradient ``(..., T, D)``."""
    return block_sums_backward(grad / _divisors(n, block, grad), n, block, dtype)


def _divisors(n: int, span: int, sums: torch.Tensor) -> torch.Tensor | int:
    """The divisor of the sums over spans of ``span`` of ``n`` tokens: ``span`` itself when it divides ``n`` (one
    operation, the same values), else the real tokens per span (``token_counts``) as a column in sums' dtype."""
    if n % span == 0:
        return span
    return token_counts(n, span, device=sums.device).to(sums.dtype).unsqueeze(-1)


def pool_pyramid(x: torch.Tensor, block: int, levels: int) -> list[torch.Tensor]:
    """Levels 1..L of the mean-pooling pyramid of ``x`` (level 0, ``x`` itself, is not included).

    Level l holds the mean of the real fine tokens under each span of ``block**l`` tokens (``level_span``: one
    token of all N past the sequence), computed recursively from block sums. x: ``(B, H, N, D)``; level l:
    ``(B, H, ceil(N/block**l), D)``, in the accumulation dtype (differentiable).
    """
    return pyramid_from_sums(block_sums(x, block), x.shape[-2], block, levels)


def pyramid_from_sums(sums: torch.Tensor, n: int, block: int, levels: int) -> list[torch.Tensor]:
    """Levels 1..L of ``pool_pyramid`` of ``n`` tokens from their ``block_sums`` ``(B, H, ceil(n/block), D)`` (a ring
    all-gathers these rows, the sequence's however it is chunked into whole blocks): the same operations, the same
    values."""
    out = []
    for level in range(1, levels + 1):
        if level > 1:
            sums = block_sums(sums, block)
        out.append(sums / _divisors(n, level_span(n, block, level), sums))
    return out


def key_mean(k: torch.Tensor, block: int = 64, sums: torch.Tensor | None = None) -> torch.Tensor:
    """``mean_N k``: ``(B, Hk, N, D)`` -> ``(B, Hk, 1, D)`` in the accumulation dtype, from the sums of ``block``
    tokens (``sums = block_sums(k, block)`` when the caller has them): one parallel pass over k (a single
    reduction over N keeps ~1000 outputs busy and ran at a third of the memory bandwidth)."""
    return (block_sums(k, block) if sums is None else sums).sum(2, keepdim=True) / k.shape[2]


def center(x: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """``x - mean`` computed in mean's dtype and rounded once to x's: x ``(B, H, N, D)``, mean ``(B, H, 1, D)``."""
    return torch.sub(x, mean, out=torch.empty_like(x))
