"""Block selection shared by the single-level block methods (``topk``, ``vsa``): top-K key blocks per query block
from raw-dot pooled scores; the FP8 smoothing mean from the pooled key sums (also ``sla``'s and ``sla2``'s)."""
from __future__ import annotations

import torch

from .._checks import clamp_topk
from ..masks import BlockSelection, num_blocks


def select_blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg, backend,
                  pooled: tuple[torch.Tensor, ...] | None = None) -> BlockSelection:
    """Top ``cfg.topk`` key blocks per query block (all of them where there are fewer, ``clamp_topk``) from raw-dot
    pooled scores (fp32, no grad) on ``backend``, with ``smoothing_mean`` and the operands the backend's pooling
    pass made for ``cfg.quant`` (``Backend.quantizing_pooling``).
    ``pooled``: ``(mean_pool(q, block_q), mean_pool(k, block_k))`` when the caller has them (then no key mean)."""
    topk = clamp_topk("topk", cfg.topk, num_blocks(k.shape[2], cfg.block_k), "key blocks")
    prepared = None
    with torch.no_grad():
        if pooled is None:
            pooled, prepared = backend.quantizing_pooling(q, k, v, cfg.block_q, cfg.block_k, cfg.quant)
        top, _ = backend.block_topk(pooled[0].detach(), pooled[1].detach(), topk)
    key_mean = smoothing_mean(k, cfg, backend, pooled[2]) if len(pooled) > 2 else None
    return BlockSelection(top, cfg.block_q, cfg.block_k, q.shape[2], k.shape[2], key_mean=key_mean,
                          prepared=prepared)


def smoothing_mean(k: torch.Tensor, cfg, backend, k_sums: torch.Tensor) -> torch.Tensor | None:
    """``BlockSelection.key_mean``: ``mean_N k`` ``(B, Hk, 1, D)`` from the key block sums ``k_sums`` the selection
    pooled (``backend.key_mean``, no pass over k) where ``cfg.quant`` smooths the keys, else None (no op)."""
    if cfg.quant is None or not cfg.quant.smooth_keys:
        return None
    with torch.no_grad():
        return backend.key_mean(k, cfg.block_k, k_sums.detach())
