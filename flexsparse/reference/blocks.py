"""Dense references of the single-level block methods: ``topk`` and ``vsa``."""
from __future__ import annotations

import torch

from ..config import QuantConfig
from ..masks.selection import BlockSelection
from ..quant import qat_attention, quantize_kv, quantizes_p
from .dense import block_mask_dense, expand_kv_heads, masked_softmax_attention, span_means


def block_select_bruteforce(q: torch.Tensor, k: torch.Tensor, topk: int, block_q: int, block_k: int,
                            smooth_k: bool = False) -> BlockSelection:
    """Top-K key blocks per query block from full raw-dot pooled scores; ties -> smallest id.
    ``smooth_k`` subtracts the per-head key mean first (SLA's router)."""
    k = expand_kv_heads(k, q.shape[1])
    if smooth_k:
        k = k - k.mean(2, keepdim=True)
    scores = span_means(q, block_q) @ span_means(k, block_k).transpose(-1, -2)
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :topk]
    return BlockSelection(order.sort(-1).values.to(torch.int32), block_q, block_k, q.shape[2], k.shape[2])


def topk_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, selection: BlockSelection, scale: float,
               quant: QuantConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-sparse softmax attention through an explicit token mask: ``o (B,H,N,D)``, ``lse (B,H,N)``.
    ``quant``: FP8 fake-quantized forward, straight-through backward (``flexsparse.quant.qat_attention``)."""
    heads = q.shape[1]
    mask = block_mask_dense(selection.indices, selection.n_q, selection.n_k, selection.block_q, selection.block_k)

    def attend(q, k, v, quant):
        if quant is not None:
            k, v = quantize_kv(k, v, quant, selection.block_k)
        return masked_softmax_attention(q, [expand_kv_heads(k, heads)], [expand_kv_heads(v, heads)], [mask], [None],
                                        scale, quantize_p=quantizes_p(quant))

    return qat_attention(attend, q, k, v, quant, block_q=selection.block_q, scale=scale)


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
    fine, lse = topk_dense(q, k, v, selection, scale)
    return fine + (coarse if gate is None else gate * coarse), lse
