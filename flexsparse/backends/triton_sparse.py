"""The ``triton`` backend of LLSA: pooling, selection and attention through the ``flexsparse::`` ops.

``llsa`` is the whole method (pool, select, attend; gradients of k and v include the pooling).
``llsa_attention`` has the signature of ``torch_sparse.llsa_attention`` (pooled levels as their own
inputs, with their own gradients), for comparisons on identical selections.
"""
from __future__ import annotations

import torch

from ..masks import LLSASelection
from ..masks.pooling import accumulation_dtype
from ..triton import ops
from ..triton.layout import level_table, pack


def llsa_select(q: torch.Tensor, k: torch.Tensor, block: int, topk: tuple[int, ...]) -> LLSASelection:
    """Hierarchical top-K selection of LLSA from q ``(B, H, N, D)`` and k ``(B, Hk, N, D)`` (no gradient)."""
    n, levels = q.shape[2], len(topk)
    with torch.no_grad():
        q_pyr = ops.llsa_pool(q.detach(), block, levels)
        k_pyr = ops.llsa_pool(k.detach(), block, levels)
        sel = ops.llsa_select(q_pyr, k_pyr, n, block, list(topk))
    return level_table(n, block, topk).unpack(sel)


def llsa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: int, topk: tuple[int, ...], scale: float,
         deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """LLSA with ``L = len(topk)`` levels: ``o (B, H, N, D)`` in q's dtype, LSE ``(B, H, N)`` fp32.

    Selection scores use fp32 pyramids; the attended pooled K/V are those means in q's dtype (what
    the tensor cores read anyway)."""
    n, levels = q.shape[2], len(topk)
    with torch.no_grad():
        k_pyr = ops.llsa_pool(k.detach(), block, levels)
        v_pyr = ops.llsa_pool(v.detach(), block, levels, True)
        sel = ops.llsa_select(ops.llsa_pool(q.detach(), block, levels), k_pyr, n, block, list(topk))
        k_pyr = k_pyr.to(q.dtype)
    return ops.llsa_attn(q, k, v, k_pyr, v_pyr, sel, block, list(topk), scale, True, deterministic)


def llsa_attention(q: torch.Tensor, k_levels: list[torch.Tensor], v_levels: list[torch.Tensor],
                   selection: LLSASelection, scale: float,
                   deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """LLSA attention over given levels, as ``torch_sparse.llsa_attention``: k_levels[l], v_levels[l]
    ``(B, Hk, T_l, D)`` for l = 0..L, each with its own gradient. Returns ``o``, ``lse``."""
    acc = accumulation_dtype(q.dtype)
    k_pyr = torch.cat([x.to(acc) for x in k_levels[1:]], dim=2)
    v_pyr = torch.cat([x.to(acc) for x in v_levels[1:]], dim=2)
    topk = [s.shape[-1] for s in selection.indices]
    return ops.llsa_attn(q, k_levels[0], v_levels[0], k_pyr, v_pyr, pack(selection), selection.block, topk, scale,
                         False, deterministic)
