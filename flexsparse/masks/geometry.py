"""Block arithmetic shared by every layer: block counts, the blocks and level spans a sequence runs with,
accumulation dtypes, the real tokens under coarse tokens, head maps of grouped-query attention and block counts from
ratios. Plain integers and small index tensors only."""
from __future__ import annotations

import torch

RATIO_DIGITS = 10**9   # ratios count to 9 decimals


def num_blocks(n: int, block: int) -> int:
    """Number of blocks of ``block`` tokens covering ``n`` tokens (the last may be ragged)."""
    return -(-n // block)


def fit_block(block: int, n: int) -> int:
    """The block size a sequence of ``n`` tokens runs with for a configured ``block``: ``block`` itself, or for a block
    longer than the sequence the smallest power of two >= max(n, 16) where that is smaller. Either way one block
    covers the whole sequence (the same pooled means, selections and attention), and the padding of a block, hence
    memory, stays below ``n`` tokens (or 16) whatever the config. Powers of two >= 16 keep every backend's block
    constraints (multiples of 16 for FlexAttention on CUDA, the Triton tiles)."""
    fit = 16
    while fit < n:
        fit *= 2
    return min(block, fit)


def level_span(n: int, block: int, level: int) -> int:
    """Fine tokens under one level-``level`` token of a pyramid of ``block``-token blocks over ``n`` tokens:
    ``block**level``, or ``n`` where that reaches past the sequence (the level then has one, ragged, token). Spans,
    groups and padding bounded by ``n`` at any level; no power past ``n * block`` is formed."""
    span = 1
    for _ in range(level):
        span *= block
        if span >= n:
            return n
    return span


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


def kv_head_index(num_heads: int, num_kv_heads: int, device=None) -> torch.Tensor:
    """KV head of each query head under GQA: ``(H,)`` int64."""
    return torch.arange(num_heads, device=device) // (num_heads // num_kv_heads)


def children(parent: torch.Tensor, block: int) -> torch.Tensor:
    """Child ids of each selected parent: ``(..., K)`` -> ``(..., K * block)`` int64, in parent order."""
    offsets = torch.arange(block, device=parent.device)
    return (parent.long().unsqueeze(-1) * block + offsets).flatten(-2)


def ratio_count(ratio: float, available: int, *, minimum: int = 0) -> int:
    """``max(minimum, floor(ratio * available))`` with ``ratio`` taken to 9 decimals, in integer arithmetic: exact
    (``0.29 * 100`` counts 29 blocks, not the float product's 28) and traceable when ``available`` is a symbolic
    size (``torch.compile`` with dynamic shapes; ``round`` of a symbolic float broke the graph)."""
    return max(minimum, (round(ratio * RATIO_DIGITS) * available) // RATIO_DIGITS)


def sla_block_counts(topk_ratio: float, negligible_ratio: float, num_k_blocks: int) -> tuple[int, int]:
    """``(topk, bottomk)`` per query block: ``max(1, floor(topk_ratio * Tk))`` critical blocks and
    ``floor(negligible_ratio * Tk)`` negligible ones. Raises if they do not fit in ``Tk`` blocks."""
    topk = ratio_count(topk_ratio, num_k_blocks, minimum=1)
    bottomk = ratio_count(negligible_ratio, num_k_blocks)
    if topk + bottomk > num_k_blocks:
        raise ValueError(f"config keys 'topk_ratio'={topk_ratio} and 'negligible_ratio'={negligible_ratio} ask for "
                         f"{topk} + {bottomk} blocks but there are only {num_k_blocks} key blocks; lower them")
    return topk, bottomk
