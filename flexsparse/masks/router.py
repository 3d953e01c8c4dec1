"""Block router inputs of SLA / SLA2: block counts from ratios, pooled Q and smoothed pooled K, scores.

All in fp32 (fp64 for fp64 inputs). Selection itself is ``block_topk`` (hard) or ``soft_topk_logits``.
"""
from __future__ import annotations

import math

import torch

from .pooling import block_means, block_sums, mean_pool
from .topk import HAS_TRITON, grouped_scores


RATIO_DIGITS = 10**9   # ratios count to 9 decimals


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


def pooled_qk(q: torch.Tensor, k: torch.Tensor, block_q: int, block_k: int, *, smooth_k: bool,
              k_sums: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Block means of q ``(B, H, Tq, D)`` and k ``(B, Hk, Tk, D)``; with ``smooth_k`` the per-head
    key mean over all N tokens is subtracted (pool(k - mean k) = pool(k) - mean k, the mean from the
    block sums). ``k_sums``: ``block_sums(k, block_k)`` when the caller has them."""
    k_sums = block_sums(k, block_k) if k_sums is None else k_sums
    q_bar, k_bar = mean_pool(q, block_q), block_means(k_sums, k.shape[2], block_k)
    if smooth_k:
        k_bar = k_bar - key_mean(k, block_k, k_sums)
    return q_bar, k_bar


def key_mean(k: torch.Tensor, block: int = 64, sums: torch.Tensor | None = None) -> torch.Tensor:
    """``mean_N k``: ``(B, Hk, N, D)`` -> ``(B, Hk, 1, D)`` in the accumulation dtype, from the sums of ``block``
    tokens (``sums = block_sums(k, block)`` when the caller has them): one parallel pass over k (a single
    reduction over N keeps ~1000 outputs busy and ran at a third of the memory bandwidth)."""
    return (block_sums(k, block) if sums is None else sums).sum(2, keepdim=True) / k.shape[2]


def _center(x: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """``x - mean`` in mean's dtype, rounded once to x's, one pass: the Triton op on CUDA in eager mode; compiled,
    the PyTorch expression, which inductor fuses into one pass itself. Two torch 2.11 bugs shape the compiled form
    (an autograd.Function's forward returns it, SLA2's key smoothing, and both zeroed k's gradient there):
    ``torch.sub(..., out=empty)`` gave zeros in a traced backward on CUDA, and a no-op ``.to(x.dtype)`` (fp32 x)
    made dynamo drop the gradient (``tests/test_sla2.py::test_smoothed_keys_compile_fullgraph_with_backward``)."""
    if torch.compiler.is_compiling():
        diff = x - mean
        return diff if diff.dtype == x.dtype else diff.to(x.dtype)
    if HAS_TRITON and x.is_cuda:
        from ..triton.sla_ops import center_tokens
        return center_tokens(x, mean)
    return torch.sub(x, mean, out=torch.empty_like(x))


class _SmoothedKeys(torch.autograd.Function):
    """``k - k_mean`` computed in ``k_mean``'s dtype and rounded once to ``k``'s (``_center``). The backward is the
    derivative of the whole map ``k -> k - mean_N k`` (``g - mean_N g``), so ``k_mean``, which must be
    ``key_mean(k)``, gets no gradient from here."""

    @staticmethod
    def forward(ctx, k, k_mean):
        return _center(k, k_mean)

    @staticmethod
    def backward(ctx, grad):
        return _center(grad, key_mean(grad)), None


def smoothed_keys(k: torch.Tensor, k_mean: torch.Tensor) -> torch.Tensor:
    """SLA2's smoothed keys ``k - mean_N k`` in k's dtype (one rounding of the fp32 difference for bf16 / fp16),
    differentiable. k: ``(B, Hk, N, D)``; k_mean: ``key_mean(k)``, detached here (the backward already
    differentiates the whole map; a k_mean left in the graph cost a zero-filled block-sum gradient pass and
    its accumulation into k's gradient, ~0.27 ms per step at B2 H8 N65536 D64 on an H100)."""
    return _SmoothedKeys.apply(k, k_mean.detach())


def router_scores(q_bar: torch.Tensor, k_bar: torch.Tensor, *, softmax: bool) -> torch.Tensor:
    """``q_bar k_bar^T / sqrt(D)`` per query head (GQA), softmax over each row when ``softmax``.

    q_bar: ``(B, H, Tq, D)``; k_bar: ``(B, Hk, Tk, D)`` -> ``(B, H, Tq, Tk)`` (differentiable).
    """
    scores = grouped_scores(q_bar, k_bar) / math.sqrt(q_bar.shape[-1])
    return scores.softmax(-1) if softmax else scores


def standardize_rows(scores: torch.Tensor) -> torch.Tensor:
    """``(s - mean) / std`` over the last dim (population std; a constant row gives zeros).

    A positive affine map per row: the row's order, so its top-k, is unchanged; what changes is the
    scale SoftTop-k's temperature sees (one std of the row instead of the router's own scale).
    """
    centred = scores - scores.mean(-1, keepdim=True)
    std = centred.square().mean(-1, keepdim=True).sqrt()
    return centred / std.clamp_min(torch.finfo(scores.dtype).tiny)

