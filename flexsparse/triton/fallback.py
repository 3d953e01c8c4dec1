"""Explicit backwards of ``torch_sparse.llsa_attention`` and ``torch_sparse.block_sparse_attention`` in plain
PyTorch (no autograd).

The CPU branches of ``flexsparse::llsa_attn_bwd`` and ``flexsparse::block_attn_bwd`` when the Triton
interpreter is off: op bodies run below autograd (and under fake tensors when traced), so the gradients
are written out. Computes in fp32 (fp64 for fp64 inputs), gathers like the ``torch`` backend, no N x N tensor.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..masks import BlockSelection, LLSASelection, children, kv_head_index, log_token_weights
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


def _gathered_grads(qa, doa, lse, delta, ids, k, v, span: int, block: int, log_weights, scale: float):
    """Gradients of one gathered sparse term: group g of ``span`` queries attends the blocks ``ids[..., g, :]``
    of ``block`` keys of ``k, v (B, Hk, T, D)``, key t with logit bias ``log_weights[t]`` (``-inf`` on padding;
    its length ``G * block`` covers T). qa, doa ``(B, H, N, D)``, lse, delta ``(B, H, N)`` in the accumulation
    dtype. Returns ``dq (B, H, N, D)``, ``dk, dv (B, Hk, T, D)`` in that dtype (scale applied)."""
    bsz, n, d = qa.shape[0], qa.shape[2], qa.shape[3]
    kv_heads, size = k.shape[1], k.shape[2]
    groups, tokens = ids.shape[2], log_weights.shape[0]
    flat = _flat_ids(ids, block, kv_heads, tokens).flatten()
    keys = _pad(k.to(qa.dtype), tokens, 2).reshape(-1, d)[flat].view(*ids.shape[:3], -1, d)
    vals = _pad(v.to(qa.dtype), tokens, 2).reshape(-1, d)[flat].view(*ids.shape[:3], -1, d)
    bias = log_weights[children(ids, block)]
    qg, dog = _groups(qa, groups, span), _groups(doa, groups, span)
    s = (qg @ keys.transpose(-1, -2)) * scale + bias.unsqueeze(-2)
    p = torch.exp(s - _groups(lse, groups, span, float("inf")).unsqueeze(-1))
    ds = p * (dog @ vals.transpose(-1, -2) - _groups(delta, groups, span).unsqueeze(-1))
    dq = (ds @ keys).flatten(2, 3)[:, :, :n] * scale
    dk = qa.new_zeros(bsz * kv_heads * tokens, d).index_add_(0, flat, (ds.transpose(-1, -2) @ qg).reshape(-1, d))
    dv = qa.new_zeros(bsz * kv_heads * tokens, d).index_add_(0, flat, (p.transpose(-1, -2) @ dog).reshape(-1, d))
    return dq, dk.view(bsz, kv_heads, tokens, d)[:, :, :size] * scale, dv.view(bsz, kv_heads, tokens, d)[:, :, :size]


def _delta(do, dlse, o, acc):
    """``Delta = rowsum(dO * O) - dLSE`` in ``acc``."""
    delta = (do.to(acc) * o.to(acc)).sum(-1)
    return delta if dlse is None else delta - dlse.to(acc)


def block_sparse_attention_backward(do, dlse, q, k, v, selection: BlockSelection, scale: float, o, lse):
    """Gradients of ``torch_sparse.block_sparse_attention``: ``(dq, dk, dv)`` in the input dtypes.

    do: ``(B, H, Nq, D)``; dlse: ``(B, H, Nq)`` or None; o, lse: the forward's outputs.
    """
    acc = accumulation_dtype(q.dtype)
    log_weights = log_token_weights(selection.n_k, 1, selection.num_k_blocks * selection.block_k, q.device, acc)
    dq, dk, dv = _gathered_grads(q.to(acc), do.to(acc), lse.to(acc), _delta(do, dlse, o, acc), selection.indices, k, v,
                                 selection.block_q, selection.block_k, log_weights, scale)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def llsa_attention_backward(do, dlse, q, k_levels, v_levels, selection: LLSASelection, scale: float, o, lse):
    """Gradients of ``torch_sparse.llsa_attention``: ``(dq, [dk_0..dk_L], [dv_0..dv_L])`` in the input dtypes.

    do: ``(B, H, N, D)``; dlse: ``(B, H, N)`` or None; o, lse: the forward's outputs.
    """
    acc = accumulation_dtype(q.dtype)
    n, b, levels = selection.n, selection.block, selection.levels
    heads, kv_heads = q.shape[1], k_levels[0].shape[1]
    qa, doa, lse = q.to(acc), do.to(acc), lse.to(acc)
    delta = _delta(do, dlse, o, acc)
    dq = torch.zeros_like(qa)
    dks, dvs = [], []
    for level in range(levels):
        ids = selection.indices[level]
        log_weights = log_token_weights(n, b**level, ids.shape[2] * b, q.device, acc)
        dq_l, dk, dv = _gathered_grads(qa, doa, lse, delta, ids, k_levels[level], v_levels[level], b ** (level + 1), b,
                                       log_weights, scale)
        dq = dq + dq_l
        dks.append(dk.to(k_levels[level].dtype))
        dvs.append(dv.to(v_levels[level].dtype))
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
