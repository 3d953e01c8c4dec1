"""Explicit backward of ``torch_sparse.llsa_attention`` in plain PyTorch (no autograd).

The CPU branch of ``flexsparse::llsa_attn_bwd`` when the Triton interpreter is off: op bodies run
below autograd (and under fake tensors when traced), so the gradients are written out. Computes in
fp32 (fp64 for fp64 inputs), gathers like the ``torch`` backend, no N x N tensor.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..masks import LLSASelection, children, kv_head_index, log_token_weights
from ..masks.pooling import accumulation_dtype


def _pad(x: torch.Tensor, length: int, dim: int, value: float = 0.0) -> torch.Tensor:
    extra = length - x.shape[dim]
    if extra <= 0:
        return x
    pad = [0, 0] * (x.dim() - 1 - dim % x.dim()) + [0, extra]
    return F.pad(x, pad, value=value)


def _groups(x: torch.Tensor, groups: int, size: int, value: float = 0.0) -> torch.Tensor:
    """``(B, H, N, ...)`` -> ``(B, H, groups, size, ...)``, padded with ``value``."""
    return _pad(x, groups * size, 2, value)[:, :, : groups * size].unflatten(2, (groups, size))


def _flat_ids(ids: torch.Tensor, block: int, kv_heads: int, tokens: int) -> torch.Tensor:
    """Row of every gathered key in a ``(B * Hk * tokens, D)`` view:
    ids ``(B, H, G, K)`` -> ``(B, H, G, K * block)``."""
    bsz, heads = ids.shape[:2]
    kv = kv_head_index(heads, kv_heads, ids.device).view(1, heads, 1, 1)
    batch = torch.arange(bsz, device=ids.device).view(bsz, 1, 1, 1)
    return (batch * kv_heads + kv) * tokens + children(ids, block)


def llsa_attention_backward(do, dlse, q, k_levels, v_levels, selection: LLSASelection, scale: float, o, lse):
    """Gradients of ``torch_sparse.llsa_attention``: ``(dq, [dk_0..dk_L], [dv_0..dv_L])`` in the input dtypes.

    do: ``(B, H, N, D)``; dlse: ``(B, H, N)`` or None; o, lse: the forward's outputs.
    """
    acc = accumulation_dtype(q.dtype)
    n, b, levels = selection.n, selection.block, selection.levels
    bsz, heads, _, d = q.shape
    kv_heads = k_levels[0].shape[1]
    qa, doa, lse = q.to(acc), do.to(acc), lse.to(acc)
    delta = (doa * o.to(acc)).sum(-1)
    if dlse is not None:
        delta = delta - dlse.to(acc)
    dq = torch.zeros_like(qa)
    dks, dvs = [], []
    for level in range(levels):
        ids = selection.indices[level]
        groups, span = ids.shape[2], b ** (level + 1)
        tokens = groups * b
        flat = _flat_ids(ids, b, kv_heads, tokens).flatten()
        keys = _pad(k_levels[level].to(acc), tokens, 2).reshape(-1, d)[flat].view(*ids.shape[:3], -1, d)
        vals = _pad(v_levels[level].to(acc), tokens, 2).reshape(-1, d)[flat].view(*ids.shape[:3], -1, d)
        bias = log_token_weights(n, b**level, tokens, q.device, acc)[children(ids, b)]
        qg, dog = _groups(qa, groups, span), _groups(doa, groups, span)
        s = (qg @ keys.transpose(-1, -2)) * scale + bias.unsqueeze(-2)
        p = torch.exp(s - _groups(lse, groups, span, float("inf")).unsqueeze(-1))
        ds = p * (dog @ vals.transpose(-1, -2) - _groups(delta, groups, span).unsqueeze(-1))
        dq = dq + (ds @ keys).flatten(2, 3)[:, :, :n] * scale
        dk = qa.new_zeros(bsz * kv_heads * tokens, d).index_add_(0, flat, (ds.transpose(-1, -2) @ qg).reshape(-1, d))
        dv = qa.new_zeros(bsz * kv_heads * tokens, d).index_add_(0, flat, (p.transpose(-1, -2) @ dog).reshape(-1, d))
        size = k_levels[level].shape[2]
        dks.append((dk.view(bsz, kv_heads, tokens, d)[:, :, :size] * scale).to(k_levels[level].dtype))
        dvs.append(dv.view(bsz, kv_heads, tokens, d)[:, :, :size].to(v_levels[level].dtype))
    kv = kv_head_index(heads, kv_heads, q.device)
    top_k, top_v = k_levels[levels].to(acc)[:, kv], v_levels[levels].to(acc)[:, kv]
    bias = log_token_weights(n, b**levels, None, q.device, acc)
    p = torch.exp((qa @ top_k.transpose(-1, -2)) * scale + bias - lse.unsqueeze(-1))
    ds = p * (doa @ top_v.transpose(-1, -2) - delta.unsqueeze(-1))
    dq = dq + (ds @ top_k) * scale
    group = heads // kv_heads
    dk_top = (ds.transpose(-1, -2) @ qa).unflatten(1, (kv_heads, group)).sum(2) * scale
    dv_top = (p.transpose(-1, -2) @ doa).unflatten(1, (kv_heads, group)).sum(2)
    dks.append(dk_top.to(k_levels[levels].dtype))
    dvs.append(dv_top.to(v_levels[levels].dtype))
    return dq.to(q.dtype), dks, dvs
