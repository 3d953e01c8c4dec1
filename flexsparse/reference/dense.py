"""Dense building blocks of the references."""
from __future__ import annotations

import torch

from ..quant.attention import quantized_softmax


def expand_kv_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """GQA: repeat each KV head for its query heads, ``(B, Hk, N, D)`` -> ``(B, H, N, D)``."""
    return x.repeat_interleave(heads // x.shape[1], dim=1)


def span_means(x: torch.Tensor, span: int) -> torch.Tensor:
    """Mean of the real tokens under each span of ``span`` tokens: ``(B, H, N, D)`` -> ``(B, H, ceil(N/span), D)``."""
    n = x.shape[2]
    return torch.stack([x[:, :, s:s + span].mean(2) for s in range(0, n, span)], dim=2)


def block_mask_dense(indices: torch.Tensor, n_q: int, n_k: int, block_q: int, block_k: int) -> torch.Tensor:
    """Token-level boolean mask ``(B, H, n_q, n_k)`` of a block selection ``(B, H, Tq, K)``."""
    bsz, heads, tq, _ = indices.shape
    tk = -(-n_k // block_k)
    blocks = torch.zeros(bsz, heads, tq, tk, dtype=torch.bool, device=indices.device)
    blocks.scatter_(-1, indices.long(), True)
    rows = torch.arange(n_q, device=indices.device) // block_q
    cols = torch.arange(n_k, device=indices.device) // block_k
    return blocks[:, :, rows][:, :, :, cols]


def masked_softmax_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                             masks: list[torch.Tensor | None], biases: list[torch.Tensor | None],
                             scale: float, quantize_p: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One softmax over several key sets: for each set, logits ``scale * q k^T + bias`` where ``mask``.

    q: ``(B, H, N, D)``; keys[i], values[i]: ``(B, H, M_i, D)``; masks[i]: ``(B, H, N, M_i)`` bool
    or None (all); biases[i]: broadcastable to ``(B, H, N, M_i)`` (e.g. ``(M_i,)``) or None.
    ``quantize_p``: FP8 numerator ``q(exp(S - m)) / rowsum(exp(S - m))`` (``flexsparse.quant``).
    Returns ``o (B, H, N, D)`` and ``lse (B, H, N)``.
    """
    logits = []
    for key, mask, bias in zip(keys, masks, biases):
        s = (q @ key.transpose(-1, -2)) * scale
        if bias is not None:
            s = s + bias
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))
        logits.append(s)
    s = torch.cat(logits, dim=-1)
    if quantize_p:
        p, lse = quantized_softmax(s)
    else:
        lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - lse.unsqueeze(-1))
    return p @ torch.cat(values, dim=2), lse
