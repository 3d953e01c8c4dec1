"""Dense reference of ``full``: an explicit softmax."""
from __future__ import annotations

import torch

from ..dense import expand_kv_heads, masked_softmax_attention


def full_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``softmax(scale * q k^T) v`` and its LSE: q ``(B, H, N, D)``, k, v ``(B, Hk, M, D)``."""
    heads = q.shape[1]
    return masked_softmax_attention(q, [expand_kv_heads(k, heads)], [expand_kv_heads(v, heads)], [None], [None], scale)
