"""Block selection shared by the single-level block methods (``topk``, ``vsa``)."""
from __future__ import annotations

import torch

from .._checks import check_topk_fits
from ..masks import BlockSelection, block_topk, mean_pool, num_blocks


def select_blocks(q: torch.Tensor, k: torch.Tensor, cfg) -> BlockSelection:
    """Top ``cfg.topk`` key blocks per query block from raw-dot pooled scores (fp32, no grad)."""
    check_topk_fits("topk", cfg.topk, num_blocks(k.shape[2], cfg.block_k), "key blocks")
    with torch.no_grad():
        top, _ = block_topk(mean_pool(q, cfg.block_q), mean_pool(k, cfg.block_k), cfg.topk)
    return BlockSelection(top, cfg.block_q, cfg.block_k, q.shape[2], k.shape[2])
