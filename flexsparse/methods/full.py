"""``full``: dense softmax attention (the baseline every sparse method is compared with)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..masks import accumulation_dtype
from ..reference.dense import expand_kv_heads, masked_softmax_attention

BACKENDS = ("reference", "torch")
SELF_ATTENTION = False


def init_params(cfg, head_dim: int, num_heads: int, seq_len: int | None) -> dict[str, torch.Tensor]:
    return {}


def forward(q, k, v, cfg, *, backend: str, scale: float, params=None, need_lse: bool = True):
    """Dense attention. ``torch`` uses SDPA, and only when ``need_lse`` a separate, differentiable,
    row-chunked LSE pass (else ``lse`` is None); ``reference`` an explicit softmax."""
    heads = q.shape[1]
    if backend == "reference":
        return masked_softmax_attention(q, [expand_kv_heads(k, heads)], [expand_kv_heads(v, heads)], [None], [None],
                                        scale)
    out = F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=heads != k.shape[1])
    return out, (_chunked_lse(q, expand_kv_heads(k, heads), scale) if need_lse else None)


def _chunked_lse(q: torch.Tensor, k: torch.Tensor, scale: float, rows: int = 1024) -> torch.Tensor:
    """Natural-log LSE of dense attention, computed in row chunks (no N x N tensor)."""
    acc = accumulation_dtype(q.dtype)
    parts = [torch.logsumexp((q[:, :, s:s + rows].to(acc) @ k.to(acc).transpose(-1, -2)) * scale, dim=-1)
             for s in range(0, q.shape[2], rows)]
    return torch.cat(parts, dim=-1)
