"""Gathers shared by the PyTorch implementations of the sparse ops (``block_sparse.naive``, ``llsa.naive``,
``linear.naive``): key blocks gathered per query head (GQA through the head index, no copy of K/V), per-key log
weights, query groups, and the written-out gradients of one gathered softmax term. Computes in the caller's
accumulation dtype; no N x N tensor."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...masks import children, kv_head_index
from ...quant import quantized_softmax


def pad_tokens(x: torch.Tensor, length: int) -> torch.Tensor:
    return F.pad(x, (0, 0, 0, length - x.shape[-2])) if length > x.shape[-2] else x


def gather_blocks(x: torch.Tensor, ids: torch.Tensor, block: int) -> torch.Tensor:
    """Blocks ``ids`` of ``x`` per query head: x ``(B, Hk, >=T*block, D)``, ids ``(B, H, R, K)``
    -> ``(B, H, R, K * block, D)`` (GQA through the head index, no copy of x)."""
    bsz, heads = ids.shape[:2]
    t = x.shape[2] // block
    blocks = x[:, :, : t * block].unflatten(2, (t, block))
    batch = torch.arange(bsz, device=x.device).view(bsz, 1, 1, 1)
    kv_heads = kv_head_index(heads, x.shape[1], x.device).view(1, heads, 1, 1)
    return blocks[batch, kv_heads, ids.long()].flatten(3, 4)


def key_bias(ids: torch.Tensor, log_weights: torch.Tensor, block: int) -> torch.Tensor:
    """Per-key log weight of the gathered keys: ``(B, H, R, K)`` -> ``(B, H, R, K * block)``."""
    return log_weights[children(ids, block)]


def query_groups(q: torch.Tensor, groups: int, size: int) -> torch.Tensor:
    """``(B, H, N, D)`` -> ``(B, H, groups, size, D)``, zero padded (padded rows are dropped later)."""
    return pad_tokens(q, groups * size)[:, :, : groups * size].unflatten(2, (groups, size))


def softmax_with_lse(logits: torch.Tensor, quantize_p: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax weights over the last dim and the LSE; ``quantize_p``: FP8 numerator (``quantized_softmax``)."""
    if quantize_p:
        return quantized_softmax(logits)
    lse = torch.logsumexp(logits, dim=-1)
    return torch.exp(logits - lse.unsqueeze(-1)), lse


def pad_to(x: torch.Tensor, length: int, dim: int, value: float = 0.0) -> torch.Tensor:
    extra = length - x.shape[dim]
    if extra <= 0:
        return x
    pad = [0, 0] * (x.dim() - 1 - dim % x.dim()) + [0, extra]
    return F.pad(x, pad, value=value)


def token_groups(x: torch.Tensor, groups: int, size: int, value: float = 0.0) -> torch.Tensor:
    """``(B, H, N, ...)`` -> ``(B, H, groups, size, ...)``, padded with ``value``."""
    return pad_to(x, groups * size, 2, value)[:, :, : groups * size].unflatten(2, (groups, size))


def flat_key_rows(ids: torch.Tensor, block: int, kv_heads: int, tokens: int) -> torch.Tensor:
    """Row of every gathered key in a ``(B * Hk * tokens, D)`` view:
    ids ``(B, H, G, K)`` -> ``(B, H, G, K * block)``."""
    bsz, heads = ids.shape[:2]
    kv = kv_head_index(heads, kv_heads, ids.device).view(1, heads, 1, 1)
    batch = torch.arange(bsz, device=ids.device).view(bsz, 1, 1, 1)
    return (batch * kv_heads + kv) * tokens + children(ids, block)


def gathered_grads(qa, doa, lse, delta, ids, k, v, span: int, block: int, log_weights, scale: float):
    """Gradients of one gathered sparse term: group g of ``span`` queries attends the blocks ``ids[..., g, :]``
    of ``block`` keys of ``k, v (B, Hk, T, D)``, key t with logit bias ``log_weights[t]`` (``-inf`` on padding;
    its length ``G * block`` covers T). qa, doa ``(B, H, N, D)``, lse, delta ``(B, H, N)`` in the accumulation
    dtype. Returns ``dq (B, H, N, D)``, ``dk, dv (B, Hk, T, D)`` in that dtype (scale applied)."""
    bsz, n, d = qa.shape[0], qa.shape[2], qa.shape[3]
    kv_heads, size = k.shape[1], k.shape[2]
    groups, tokens = ids.shape[2], log_weights.shape[0]
    flat = flat_key_rows(ids, block, kv_heads, tokens).flatten()
    keys = pad_to(k.to(qa.dtype), tokens, 2).reshape(-1, d)[flat].view(*ids.shape[:3], -1, d)
    vals = pad_to(v.to(qa.dtype), tokens, 2).reshape(-1, d)[flat].view(*ids.shape[:3], -1, d)
    bias = log_weights[children(ids, block)]
    qg, dog = token_groups(qa, groups, span), token_groups(doa, groups, span)
    s = (qg @ keys.transpose(-1, -2)) * scale + bias.unsqueeze(-2)
    p = torch.exp(s - token_groups(lse, groups, span, float("inf")).unsqueeze(-1))
    ds = p * (dog @ vals.transpose(-1, -2) - token_groups(delta, groups, span).unsqueeze(-1))
    dq = (ds @ keys).flatten(2, 3)[:, :, :n] * scale
    dk = qa.new_zeros(bsz * kv_heads * tokens, d).index_add_(0, flat, (ds.transpose(-1, -2) @ qg).reshape(-1, d))
    dv = qa.new_zeros(bsz * kv_heads * tokens, d).index_add_(0, flat, (p.transpose(-1, -2) @ dog).reshape(-1, d))
    return dq, dk.view(bsz, kv_heads, tokens, d)[:, :, :size] * scale, dv.view(bsz, kv_heads, tokens, d)[:, :, :size]


def softmax_delta(do, dlse, o, acc):
    """``Delta = rowsum(dO * O) - dLSE`` in ``acc``."""
    delta = (do.to(acc) * o.to(acc)).sum(-1)
    return delta if dlse is None else delta - dlse.to(acc)
