"""Block selection in PyTorch: raw-dot block scores and top-K with a deterministic tie-break, single-level (the
block routers) and hierarchical (LLSA). The ``torch`` and ``flex`` backends' selection and the CPU branch of the
selection ops.

Scores are raw dot products of pooled vectors in fp32 (fp64 for fp64 inputs): no scale and no softmax, which would
not change a row's order. Ties go to the smallest key index (stable sort). The dense block-score matrix is built in
row chunks so that at most ``max_elements`` scores exist at once. Hierarchical (coarse-to-fine): dense scores exist
only at the top level; below it each query token scores just the children of its parent's selection
(``K_{l+1} * block`` candidates), so the work is O(N) per level.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...masks import LLSASelection, accumulation_dtype, children, kv_head_index
from ..pooling.naive import pool_pyramid


def stable_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Positions of the ``k`` largest entries of each row, largest first; ties -> smallest position.

    scores: ``(..., C)``; returns ``(..., k)`` int64. Entries equal to ``-inf`` are never chosen
    ahead of finite ones.
    """
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]


def router_projections(q_bar: torch.Tensor, k_bar: torch.Tensor, proj_q: torch.Tensor,
                       proj_k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """SLA2's projected router inputs ``(q_bar P_q^T, k_bar P_k^T)`` in q_bar's dtype; differentiable."""
    return q_bar @ proj_q.to(q_bar.dtype).T, k_bar @ proj_k.to(k_bar.dtype).T


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
    The scores are sorted in row chunks of at most ``max_elements`` (``sorted_block_topk``).
    """
    tk = k_pooled.shape[2]
    if topk < 1 or bottomk < 0 or topk + bottomk > tk:
        raise ValueError(f"block_topk: topk={topk} (>= 1) plus bottomk={bottomk} (>= 0) must fit in the {tk} key "
                         "blocks of k_pooled")
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


def children_topk(q_level: torch.Tensor, k_level: torch.Tensor, parent: torch.Tensor, topk: int, block: int,
                  max_elements: int = 1 << 26) -> torch.Tensor:
    """Top-K among the children of the parent's selection, for every query token of one level.

    q_level: ``(B, H, T, D)``, k_level: ``(B, Hk, T, D)`` pooled tokens of this level;
    parent: ``(B, H, ceil(T/block), Kp)`` ids at the next coarser level.
    Returns ``(B, H, T, topk)`` int32 ids at this level, ascending. Children past ``T`` are
    never chosen; ties go to the smallest id. A level of fewer than ``block`` tokens has one parent, whose
    children are its T tokens (no block padded past them).
    """
    bsz, heads, t, d = q_level.shape
    block = min(block, t)
    tp, kp = parent.shape[2], parent.shape[3]
    cand_count = kp * block
    acc = accumulation_dtype(q_level.dtype)
    pad = tp * block - t
    q_blocks = F.pad(q_level.to(acc), (0, 0, 0, pad)).unflatten(2, (tp, block))
    k_padded = F.pad(k_level.to(acc), (0, 0, 0, pad))
    kv_heads = kv_head_index(heads, k_level.shape[1], q_level.device).view(1, heads, 1, 1)
    batch = torch.arange(bsz, device=q_level.device).view(bsz, 1, 1, 1)
    rows = max(1, max_elements // max(1, bsz * heads * cand_count * d))
    out = []
    for start in range(0, tp, rows):
        cand = children(parent[:, :, start:start + rows], block)                 # (B, H, r, C)
        keys = k_padded[batch, kv_heads, cand]                                    # (B, H, r, C, D)
        scores = q_blocks[:, :, start:start + rows] @ keys.transpose(-1, -2)      # (B, H, r, block, C)
        scores = scores.masked_fill((cand >= t).unsqueeze(-2), float("-inf"))
        pos = stable_topk(scores, topk)                                           # (B, H, r, block, K)
        out.append(cand.unsqueeze(-2).expand(-1, -1, -1, block, -1).gather(-1, pos))
    ids = torch.cat(out, dim=2).flatten(2, 3)[:, :, :t]
    return ids.sort(dim=-1).values.to(torch.int32)


def hierarchical_topk(q_levels: list[torch.Tensor], k_levels: list[torch.Tensor], topk: tuple[int, ...],
                      block: int, n: int) -> LLSASelection:
    """LLSA selection from pooled pyramids.

    q_levels[l-1]: ``(B, H, T_l, D)``, k_levels[l-1]: ``(B, Hk, T_l, D)`` for l = 1..L;
    topk: ``(K_1, ..., K_L)``. Top level: dense raw-dot top-K; each finer level: top-K among the
    children of the parent's selection. No gradient.
    """
    levels = len(topk)
    with torch.no_grad():
        selected = [None] * levels
        selected[-1] = block_topk(q_levels[-1], k_levels[-1], topk[-1])[0]
        for level in range(levels - 1, 0, -1):
            selected[level - 1] = children_topk(q_levels[level - 1], k_levels[level - 1], selected[level],
                                                topk[level - 1], block)
    return LLSASelection(indices=tuple(selected), block=block, n=n)


def llsa_topk(q: torch.Tensor, k: torch.Tensor, topk: tuple[int, ...], block: int, *,
              k_levels: list[torch.Tensor] | None = None) -> LLSASelection:
    """LLSA selection of q ``(B, H, N, D)`` against k ``(B, Hk, N, D)``: pooling pyramids (fp32, fp64 for
    fp64), then ``hierarchical_topk``. ``k_levels``: ``pool_pyramid(k)`` when the caller has it (k is not
    pooled again). No gradient."""
    levels, n = len(topk), q.shape[2]
    with torch.no_grad():
        k_levels = k_levels if k_levels is not None else pool_pyramid(k, block, levels)
        return hierarchical_topk(pool_pyramid(q, block, levels), k_levels, topk, block, n)
