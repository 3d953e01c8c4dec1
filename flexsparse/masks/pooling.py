"""Mean pooling over token blocks and the pooling pyramid.

Ragged tails are true means over the real tokens: padding never enters a pooled mean.
Sums are accumulated in fp32 (or fp64 for fp64 inputs) and the means are returned in that
accumulation dtype; callers cast where they need the input dtype.
"""
from __future__ import annotations

import torch


def num_blocks(n: int, block: int) -> int:
    """Number of blocks of ``block`` tokens covering ``n`` tokens (the last may be ragged)."""
    return -(-n // block)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp64 stays fp64; every other floating dtype accumulates in fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def token_counts(n: int, span: int, device=None) -> torch.Tensor:
    """Real fine tokens under each coarse token of ``span`` fine tokens: ``(ceil(n/span),)`` int64."""
    starts = torch.arange(num_blocks(n, span), device=device) * span
    return (n - starts).clamp(max=span)


def log_token_weights(n: int, span: int, length: int | None = None, device=None, dtype=torch.float32) -> torch.Tensor:
    """``ln(count)`` of each coarse token of ``span`` fine tokens, ``-inf`` for padding.

    Returns ``(length,)`` with ``length >= ceil(n/span)`` (default equal): entries past the
    real tokens are ``-inf`` so that padded tokens never enter a softmax. Built without
    in-place writes, so it is safe inside compiled graphs.
    """
    length = num_blocks(n, span) if length is None else length
    starts = torch.arange(length, device=device) * span
    return (n - starts).clamp(min=0, max=span).to(dtype).log()


def block_sums(x: torch.Tensor, block: int) -> torch.Tensor:
    """Sums over consecutive blocks of ``block`` tokens along dim -2 (a ragged tail block sums its real tokens).

    x: ``(..., N, D)`` -> ``(..., ceil(N/block), D)`` in the accumulation dtype. Differentiable. One pass
    over x forward and one write of its gradient backward: no padded or widened copy of x (a padded copy
    cost two full passes over q and k at ragged lengths), and no zero-filled slice gradients.
    """
    return _BlockSums.apply(x, block)


class _BlockSums(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, block: int) -> torch.Tensor:
        ctx.block, ctx.n, ctx.dtype = block, x.shape[-2], x.dtype
        acc = accumulation_dtype(x.dtype)
        whole = x.shape[-2] // block
        sums = x[..., :whole * block, :].unflatten(-2, (whole, block)).sum(-2, dtype=acc)
        if whole * block == x.shape[-2]:
            return sums
        return torch.cat([sums, x[..., whole * block:, :].sum(-2, keepdim=True, dtype=acc)], dim=-2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        """Each block's gradient broadcast to its tokens, cast to x's dtype in the same pass."""
        n, block = ctx.n, ctx.block
        whole = n // block
        out = grad.new_empty(*grad.shape[:-2], n, grad.shape[-1], dtype=ctx.dtype)
        out[..., :whole * block, :].unflatten(-2, (whole, block)).copy_(grad[..., :whole, None, :])
        if whole * block < n:
            out[..., whole * block:, :].copy_(grad[..., whole:, :])
        return out, None


def mean_pool(x: torch.Tensor, block: int) -> torch.Tensor:
    """Block means over ``block`` consecutive tokens (true means on the ragged tail).

    x: ``(..., N, D)`` -> ``(..., ceil(N/block), D)`` in the accumulation dtype.
    """
    return block_means(block_sums(x, block), x.shape[-2], block)


def block_means(sums: torch.Tensor, n: int, block: int) -> torch.Tensor:
    """``block_sums`` of ``n`` tokens -> block means (true means on the ragged tail): ``(..., T, D)``."""
    return sums / _divisors(n, block, sums)


def _divisors(n: int, span: int, sums: torch.Tensor) -> torch.Tensor | int:
    """The divisor of the sums over spans of ``span`` of ``n`` tokens: ``span`` itself when it divides ``n`` (one
    operation, the same values), else the real tokens per span (``token_counts``) as a column in sums' dtype."""
    if n % span == 0:
        return span
    return token_counts(n, span, device=sums.device).to(sums.dtype).unsqueeze(-1)


def pool_pyramid(x: torch.Tensor, block: int, levels: int) -> list[torch.Tensor]:
    """Levels 1..L of the mean-pooling pyramid of ``x`` (level 0, ``x`` itself, is not included).

    Level l holds the mean of the real fine tokens under each span of ``block**l`` tokens,
    computed recursively from block sums. x: ``(B, H, N, D)``; level l: ``(B, H, ceil(N/block**l), D)``,
    in the accumulation dtype (differentiable).
    """
    n = x.shape[-2]
    out = []
    sums = x
    for level in range(1, levels + 1):
        sums = block_sums(sums, block)
        out.append(sums / _divisors(n, block**level, sums))
    return out


def auto_levels(n: int, block: int, topk: int | tuple[int, ...], max_top_tokens: int = 256) -> int:
    """Levels L for LLSA at length ``n``: the fewest with at most ``max_top_tokens`` top-level tokens,
    reduced while the top level has fewer tokens than its top-K. At least 1."""
    levels = 1
    while num_blocks(n, block**levels) > max_top_tokens:
        levels += 1
    top_k = topk if isinstance(topk, int) else max(topk)
    while levels > 1 and num_blocks(n, block**levels) < top_k:
        levels -= 1
    return levels
