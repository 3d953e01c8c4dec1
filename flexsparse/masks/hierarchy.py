"""Hierarchical (coarse-to-fine) top-K selection of LLSA.

Dense scores exist only at the top level; below it each query token scores just the children of
its parent's selection (``K_{l+1} * block`` candidates), so the work is O(N) per level.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .pooling import accumulation_dtype, pool_pyramid
from .selection import LLSASelection
from .topk import HAS_TRITON, block_topk, stable_topk


def kv_head_index(num_heads: int, num_kv_heads: int, device=None) -> torch.Tensor:
    """KV head of each query head under GQA: ``(H,)`` int64."""
    return torch.arange(num_heads, device=device) // (num_heads // num_kv_heads)


def children(parent: torch.Tensor, block: int) -> torch.Tensor:
    """Child ids of each selected parent: ``(..., K)`` -> ``(..., K * block)`` int64, in parent order."""
    offsets = torch.arange(block, device=parent.device)
    return (parent.long().unsqueeze(-1) * block + offsets).flatten(-2)


def children_topk(q_level: torch.Tensor, k_level: torch.Tensor, parent: torch.Tensor, topk: int, block: int,
                  max_elements: int = 1 << 26) -> torch.Tensor:
    """Top-K among the children of the parent's selection, for every query token of one level.

    q_level: ``(B, H, T, D)``, k_level: ``(B, Hk, T, D)`` pooled tokens of this level;
    parent: ``(B, H, ceil(T/block), Kp)`` ids at the next coarser level.
    Returns ``(B, H, T, topk)`` int32 ids at this level, ascending. Children past ``T`` are
    never chosen; ties go to the smallest id.
    """
    bsz, heads, t, d = q_level.shape
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
    pooled again). On CUDA, when triton is installed, q is pooled and the selection made by the Triton
    kernels (``flexsparse::llsa_pool``, ``flexsparse::llsa_select``: the same selection up to fp32 rounding of
    the scores). No gradient."""
    levels, n = len(topk), q.shape[2]
    with torch.no_grad():
        k_levels = k_levels if k_levels is not None else pool_pyramid(k, block, levels)
        if HAS_TRITON and q.is_cuda:
            from ..triton import ops
            from ..triton.layout import level_table
            packed = ops.llsa_select(ops.llsa_pool(q, block, levels), torch.cat(k_levels, dim=2), n, block,
                                     list(topk))
            return level_table(n, block, topk).unpack(packed)
        return hierarchical_topk(pool_pyramid(q, block, levels), k_levels, topk, block, n)
