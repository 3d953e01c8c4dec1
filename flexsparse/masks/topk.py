"""Block scores and top-K with a deterministic tie-break.

Scores are raw dot products of pooled vectors in fp32 (fp64 for fp64 inputs): no scale and no
softmax, which would not change a row's order. Ties go to the smallest key index (stable sort).
The dense block-score matrix is built in row chunks so that at most ``max_elements`` scores
exist at once.
"""
from __future__ import annotations

import torch

from .pooling import accumulation_dtype


def stable_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Positions of the ``k`` largest entries of each row, largest first; ties -> smallest position.

    scores: ``(..., C)``; returns ``(..., k)`` int64. Entries equal to ``-inf`` are never chosen
    ahead of finite ones.
    """
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]


def grouped_scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Raw dot products with GQA: q ``(B, H, M, D)``, k ``(B, Hk, N, D)`` -> ``(B, H, M, N)``."""
    b, h, m, d = q.shape
    hk = k.shape[1]
    acc = accumulation_dtype(q.dtype)
    qg = q.to(acc).reshape(b, hk, h // hk, m, d)
    return (qg @ k.to(acc).transpose(-1, -2).unsqueeze(2)).reshape(b, h, m, k.shape[2])


def block_topk(q_pooled: torch.Tensor, k_pooled: torch.Tensor, topk: int, *, bottomk: int = 0,
               max_elements: int = 1 << 26) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Top-K (and optionally bottom-K) key blocks per query block.

    q_pooled: ``(B, H, Tq, D)``; k_pooled: ``(B, Hk, Tk, D)``.
    Returns ``(top, bottom)``: ``(B, H, Tq, topk)`` and ``(B, H, Tq, bottomk)`` (or ``None``)
    int32 block ids sorted ascending. The bottom set never overlaps the top set.
    """
    b, h, tq, _ = q_pooled.shape
    tk = k_pooled.shape[2]
    rows = max(1, max_elements // max(1, b * h * tk))
    tops, bottoms = [], []
    for start in range(0, tq, rows):
        scores = grouped_scores(q_pooled[:, :, start:start + rows], k_pooled)
        order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
        tops.append(order[..., :topk])
        if bottomk:
            bottoms.append(order[..., tk - bottomk:])
    top = torch.cat(tops, dim=2).sort(dim=-1).values.to(torch.int32)
    bottom = torch.cat(bottoms, dim=2).sort(dim=-1).values.to(torch.int32) if bottomk else None
    return top, bottom
