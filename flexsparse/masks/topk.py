"""Block scores and top-K with a deterministic tie-break.

Scores are raw dot products of pooled vectors in fp32 (fp64 for fp64 inputs): no scale and no
softmax, which would not change a row's order. Ties go to the smallest key index (stable sort).
The dense block-score matrix is built in row chunks so that at most ``max_elements`` scores
exist at once.
"""
from __future__ import annotations

import importlib.util

import torch

from .pooling import accumulation_dtype

HAS_TRITON = importlib.util.find_spec("triton") is not None


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
    CUDA tensors go to the Triton kernels (``flexsparse::block_topk``: fp32 scores in 32 MB row chunks, an exact
    selection per row) when triton is installed; otherwise the scores are sorted in row chunks of at most
    ``max_elements`` (``sorted_block_topk``).
    """
    tk = k_pooled.shape[2]
    if topk < 1 or bottomk < 0 or topk + bottomk > tk:
        raise ValueError(f"block_topk: topk={topk} (>= 1) plus bottomk={bottomk} (>= 0) must fit in the {tk} key "
                         "blocks of k_pooled")
    if HAS_TRITON and q_pooled.is_cuda:
        from ..triton.sla_ops import block_topk as block_topk_op
        top, bottom = block_topk_op(q_pooled, k_pooled, topk, bottomk)
        return top, (bottom if bottomk else None)
    return sorted_block_topk(q_pooled, k_pooled, topk, bottomk=bottomk, max_elements=max_elements)


def sorted_block_topk(q_pooled: torch.Tensor, k_pooled: torch.Tensor, topk: int, *, bottomk: int = 0,
                      max_elements: int = 1 << 26) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``block_topk`` by a stable sort of the fp32 (fp64) scores, ``max_elements`` scores at a time."""
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
