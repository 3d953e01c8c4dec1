"""Block selection and the sparse branch shared by the single-level block methods (``topk``, ``vsa``, ``sla``,
``sla2``)."""
from __future__ import annotations

import torch

from .._checks import check_topk_fits
from ..backends import sparse_primitives
from ..masks import BlockSelection, block_topk, mean_pool, num_blocks


def select_blocks(q: torch.Tensor, k: torch.Tensor, cfg) -> BlockSelection:
    """Top ``cfg.topk`` key blocks per query block from raw-dot pooled scores (fp32, no grad)."""
    check_topk_fits("topk", cfg.topk, num_blocks(k.shape[2], cfg.block_k), "key blocks")
    with torch.no_grad():
        top, _ = block_topk(mean_pool(q, cfg.block_q), mean_pool(k, cfg.block_k), cfg.topk)
    return BlockSelection(top, cfg.block_q, cfg.block_k, q.shape[2], k.shape[2])


def sparse_branch(backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, selection: BlockSelection,
                  scale: float, deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``block_sparse_attention`` of ``backend``: ``o (B, H, Nq, D)``, ``lse (B, H, Nq)``. ``deterministic``
    (the config key) makes the ``triton`` backward bitwise reproducible; the other backends ignore it."""
    primitives = sparse_primitives(backend)
    if backend == "triton":
        return primitives.block_sparse_attention(q, k, v, selection, scale, deterministic=deterministic)
    return primitives.block_sparse_attention(q, k, v, selection, scale)
