"""Block selection shared by the single-level block methods (``topk``, ``vsa``): top-K key blocks per query block
from raw-dot pooled scores."""
from __future__ import annotations

import torch

from .._checks import clamp_topk
from ..masks import BlockSelection, num_blocks


def select_blocks(q: torch.Tensor, k: torch.Tensor, cfg, backend,
                  pooled: tuple[torch.Tensor, torch.Tensor] | None = None) -> BlockSelection:
    """Top ``cfg.topk`` key blocks per query block (all of them where there are fewer, ``clamp_topk``) from raw-dot
    pooled scores (fp32, no grad) on ``backend``.
    ``pooled``: ``(mean_pool(q, block_q), mean_pool(k, block_k))`` when the caller has them."""
    topk = clamp_topk("topk", cfg.topk, num_blocks(k.shape[2], cfg.block_k), "key blocks")
    with torch.no_grad():
        if pooled is None:
            pooled = backend.block_pooling(q, k, cfg.block_q, cfg.block_k)[:2]
        top, _ = backend.block_topk(pooled[0].detach(), pooled[1].detach(), topk)
    return BlockSelection(top, cfg.block_q, cfg.block_k, q.shape[2], k.shape[2])
