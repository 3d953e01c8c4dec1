"""Softmax with a log weight per (query block, key block), in plain PyTorch: SLA2's stage-1 soft router.

Every key carries weight, so the work is O(N^2 D) (calibration only). No N x N mask is built: the
block weights are broadcast onto the logits of one chunk of query blocks at a time, and with grad
enabled each chunk is recomputed in backward (``torch.utils.checkpoint``), so at most about
``max_elements`` logits are alive at once. fp32 (fp64 for fp64 inputs); output in q's dtype.
"""
from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from ..masks import kv_head_index, log_token_weights
from ..masks.pooling import accumulation_dtype
from .torch_sparse import _pad_tokens, _query_groups


def soft_block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_weights: torch.Tensor,
                         block_q: int, block_k: int, scale: float,
                         max_elements: int = 1 << 26) -> tuple[torch.Tensor, torch.Tensor]:
    """``softmax(scale * q k^T + log_weights[i // block_q, j // block_k]) v`` over all keys.

    q: ``(B, H, Nq, D)``; k, v: ``(B, Hk, Nk, D)``; log_weights: ``(B, H, Tq, Tk)`` (differentiable,
    e.g. ``logsigmoid`` of SoftTop-k logits). Returns ``o (B, H, Nq, D)`` and ``lse (B, H, Nq)``.
    """
    acc = accumulation_dtype(q.dtype)
    bsz, heads, tq, tk = log_weights.shape
    kv_heads = kv_head_index(heads, k.shape[1], q.device)
    keys = _pad_tokens(k.to(acc), tk * block_k)[:, kv_heads]
    values = _pad_tokens(v.to(acc), tk * block_k)[:, kv_heads]
    key_bias = log_token_weights(k.shape[2], 1, tk * block_k, q.device, acc).view(tk, block_k)
    groups = _query_groups(q.to(acc), tq, block_q)
    rows = max(1, max_elements // max(1, bsz * heads * block_q * tk * block_k))
    outs, lses = [], []
    for start in range(0, tq, rows):
        args = (groups[:, :, start:start + rows], keys, values, log_weights[:, :, start:start + rows].to(acc),
                key_bias, scale)
        out, lse = checkpoint(_rows, *args, use_reentrant=False) if torch.is_grad_enabled() else _rows(*args)
        outs.append(out)
        lses.append(lse)
    n = q.shape[2]
    return torch.cat(outs, 2).flatten(2, 3)[:, :, :n].to(q.dtype), torch.cat(lses, 2).flatten(2, 3)[:, :, :n]


def _rows(q_rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, log_weights: torch.Tensor,
          key_bias: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk: q_rows ``(B, H, R, bq, D)``, keys/values ``(B, H, Tk*bk, D)``, log_weights ``(B, H, R, Tk)``."""
    tk, bk = key_bias.shape
    logits = (q_rows @ keys.unsqueeze(2).transpose(-1, -2)) * scale                  # (B, H, R, bq, Tk*bk)
    logits = (logits.unflatten(-1, (tk, bk)) + log_weights[:, :, :, None, :, None] + key_bias).flatten(-2)
    lse = torch.logsumexp(logits, dim=-1)
    return torch.exp(logits - lse.unsqueeze(-1)) @ values.unsqueeze(2), lse
