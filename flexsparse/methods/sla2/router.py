"""SLA2's router: router scores over pooled blocks, the hard top-k or SoftTop-k mask; the smoothed keys.

All in fp32 (fp64 for fp64 inputs); the pooling and the hard selection run on the call's backend.
"""
from __future__ import annotations

import math

import torch

from ...masks import BlockSelection, SoftBlockMask, kv_head_index, num_blocks, ratio_count
from .softtopk import soft_topk_logits


def route(q: torch.Tensor, k: torch.Tensor, cfg, backend, proj_q: torch.Tensor, proj_k: torch.Tensor,
          pooled: tuple | None = None) -> BlockSelection | SoftBlockMask:
    """Hard selection ``(B, H, Tq, K)`` or SoftTop-k mask ``(B, H, Tq, Tk)`` from the projected pooled Q and
    K (``Backend.router_inputs``; ``pooled``: ``backend.block_pooling(q, k, block_q, block_k)`` when the caller
    has it)."""
    count = ratio_count(cfg.topk_ratio, num_blocks(k.shape[2], cfg.block_k), minimum=1)
    soft = cfg.router == "soft"
    with torch.set_grad_enabled(soft and torch.is_grad_enabled()):
        q_bar, k_bar = backend.router_inputs(q, k, cfg.block_q, cfg.block_k, pooled)
        q_bar, k_bar = backend.router_projections(q_bar, k_bar, proj_q, proj_k)
        if not soft:
            top, _ = backend.block_topk(q_bar, k_bar, count)
            return BlockSelection(top, cfg.block_q, cfg.block_k, q.shape[2], k.shape[2])
        if cfg.softtopk_standardize:           # raw logits, one std per row (scale-free SoftTop-k)
            scores = standardize_rows(router_scores(q_bar, k_bar, softmax=False))
        else:
            scores = router_scores(q_bar, k_bar, softmax=cfg.router_softmax)
        logits = soft_topk_logits(scores, count, cfg.tau, cfg.softtopk_iters)
    return SoftBlockMask(logits, cfg.block_q, cfg.block_k, q.shape[2], k.shape[2])


class _SmoothedKeys(torch.autograd.Function):
    """``k - k_mean`` computed in ``k_mean``'s dtype and rounded once to ``k``'s (``backend.center``). The backward is
    the derivative of the whole map ``k -> k - mean_N k`` (``g - mean_N g``), so ``k_mean``, which must be the key
    mean of ``k``, gets no gradient from here."""

    @staticmethod
    def forward(ctx, k, k_mean, backend):
        ctx.backend = backend
        return backend.center(k, k_mean)

    @staticmethod
    def backward(ctx, grad):
        return ctx.backend.center(grad, ctx.backend.key_mean(grad, 64)), None, None


def smoothed_keys(k: torch.Tensor, k_mean: torch.Tensor, backend) -> torch.Tensor:
    """SLA2's smoothed keys ``k - mean_N k`` in k's dtype (one rounding of the fp32 difference for bf16 / fp16),
    differentiable. k: ``(B, Hk, N, D)``; k_mean: ``backend.key_mean(k)``, detached here (the backward already
    differentiates the whole map; a k_mean left in the graph cost a zero-filled block-sum gradient pass and
    its accumulation into k's gradient, ~0.27 ms per step at B2 H8 N65536 D64 on an H100)."""
    if torch.is_grad_enabled() and k.requires_grad:
        return _SmoothedKeys.apply(k, k_mean.detach(), backend)
    return backend.center(k, k_mean)


def router_scores(q_bar: torch.Tensor, k_bar: torch.Tensor, *, softmax: bool) -> torch.Tensor:
    """``q_bar k_bar^T / sqrt(D)`` per query head (GQA), softmax over each row when ``softmax``.

    q_bar: ``(B, H, Tq, D)``; k_bar: ``(B, Hk, Tk, D)`` -> ``(B, H, Tq, Tk)`` (differentiable).
    """
    k_rows = k_bar[:, kv_head_index(q_bar.shape[1], k_bar.shape[1], k_bar.device)]
    scores = (q_bar @ k_rows.to(q_bar.dtype).transpose(-1, -2)) / math.sqrt(q_bar.shape[-1])
    return scores.softmax(-1) if softmax else scores


def standardize_rows(scores: torch.Tensor) -> torch.Tensor:
    """``(s - mean) / std`` over the last dim (population std; a constant row gives zeros).

    A positive affine map per row: the row's order, so its top-k, is unchanged; what changes is the
    scale SoftTop-k's temperature sees (one std of the row instead of the router's own scale).
    """
    centred = scores - scores.mean(-1, keepdim=True)
    std = centred.square().mean(-1, keepdim=True).sqrt()
    return centred / std.clamp_min(torch.finfo(scores.dtype).tiny)
