"""Dense reference of ``vsa``."""
from __future__ import annotations

import torch

from ...masks import BlockSelection
from ..dense import block_sparse_dense, expand_kv_heads, masked_softmax_attention, span_means


def vsa_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, selection: BlockSelection, scale: float,
              gate: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """VSA: tile-level attention of pooled q over pooled k, v, broadcast to every token of the query
    tile, plus the fine block-sparse attention; ``o = o_fine + gate * o_coarse`` (gate 1 if None).
    Returns the output and the fine branch's LSE."""
    heads, bq = q.shape[1], selection.block_q
    kc = span_means(expand_kv_heads(k, heads), selection.block_k)
    vc = span_means(expand_kv_heads(v, heads), selection.block_k)
    coarse, _ = masked_softmax_attention(span_means(q, bq), [kc], [vc], [None], [None], scale)
    coarse = coarse.repeat_interleave(bq, dim=2)[:, :, : q.shape[2]]
    fine, lse = block_sparse_dense(q, k, v, selection, scale)
    return fine + (coarse if gate is None else gate * coarse), lse
