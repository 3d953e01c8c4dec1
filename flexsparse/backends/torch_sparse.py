"""The ``torch`` backend: gather-based sparse attention in plain PyTorch, with autograd.

No N x N tensor is built. Every function computes in fp32 (fp64 for fp64 inputs), returns the
output in the input dtype and the natural-log LSE in fp32 (fp64), and handles ragged lengths by
padding with ``-inf`` logits, so padding never enters a softmax.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..masks import BlockSelection, LLSASelection, children, kv_head_index, log_token_weights
from ..masks.pooling import accumulation_dtype
from ..quant.attention import quantized_softmax


def _pad_tokens(x: torch.Tensor, length: int) -> torch.Tensor:
    return F.pad(x, (0, 0, 0, length - x.shape[-2])) if length > x.shape[-2] else x


def _gather_blocks(x: torch.Tensor, ids: torch.Tensor, block: int) -> torch.Tensor:
    """Blocks ``ids`` of ``x`` per query head: x ``(B, Hk, >=T*block, D)``, ids ``(B, H, R, K)``
    -> ``(B, H, R, K * block, D)`` (GQA through the head index, no copy of x)."""
    bsz, heads = ids.shape[:2]
    t = x.shape[2] // block
    blocks = x[:, :, : t * block].unflatten(2, (t, block))
    batch = torch.arange(bsz, device=x.device).view(bsz, 1, 1, 1)
    kv_heads = kv_head_index(heads, x.shape[1], x.device).view(1, heads, 1, 1)
    return blocks[batch, kv_heads, ids.long()].flatten(3, 4)


def _key_bias(ids: torch.Tensor, log_weights: torch.Tensor, block: int) -> torch.Tensor:
    """Per-key log weight of the gathered keys: ``(B, H, R, K)`` -> ``(B, H, R, K * block)``."""
    return log_weights[children(ids, block)]


def _query_groups(q: torch.Tensor, groups: int, size: int) -> torch.Tensor:
    """``(B, H, N, D)`` -> ``(B, H, groups, size, D)``, zero padded (padded rows are dropped later)."""
    return _pad_tokens(q, groups * size)[:, :, : groups * size].unflatten(2, (groups, size))


def _softmax(logits: torch.Tensor, quantize_p: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax weights over the last dim and the LSE; ``quantize_p``: FP8 numerator (``quantized_softmax``)."""
    if quantize_p:
        return quantized_softmax(logits)
    lse = torch.logsumexp(logits, dim=-1)
    return torch.exp(logits - lse.unsqueeze(-1)), lse


def block_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, selection: BlockSelection,
                           scale: float, *, quantize_p: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of each query block over its selected key blocks.

    q: ``(B, H, Nq, D)``; k, v: ``(B, Hk, Nk, D)``; selection.indices ``(B, H, Tq, K)``.
    ``quantize_p``: FP8 fake quantization of the softmax numerator (``flexsparse.quant``).
    Returns ``o (B, H, Nq, D)`` in q's dtype and ``lse (B, H, Nq)``.
    """
    acc = accumulation_dtype(q.dtype)
    bq, bk = selection.block_q, selection.block_k
    tq, tk = selection.num_q_blocks, selection.num_k_blocks
    ids = selection.indices
    keys = _gather_blocks(_pad_tokens(k.to(acc), tk * bk), ids, bk)
    values = _gather_blocks(_pad_tokens(v.to(acc), tk * bk), ids, bk)
    bias = _key_bias(ids, log_token_weights(selection.n_k, 1, tk * bk, q.device, acc), bk)
    logits = (_query_groups(q.to(acc), tq, bq) @ keys.transpose(-1, -2)) * scale + bias.unsqueeze(-2)
    probs, lse = _softmax(logits, quantize_p)
    out = probs @ values
    n = q.shape[2]
    return out.flatten(2, 3)[:, :, :n].to(q.dtype), lse.flatten(2, 3)[:, :, :n]


def llsa_attention(q: torch.Tensor, k_levels: list[torch.Tensor], v_levels: list[torch.Tensor],
                   selection: LLSASelection, scale: float, *,
                   quantize_p: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """LLSA attention over the enriched multi-level KV, one softmax.

    q: ``(B, H, N, D)``; k_levels[l], v_levels[l]: ``(B, Hk, T_l, D)`` for l = 0..L (level 0 is the
    input). A fine query n attends, at each level l < L, the level-l children of
    ``S_{l+1}[n // b^{l+1}]``, and at level L every token; a level-l token adds ``ln(count)`` to
    its logit (``count = b^l`` for full spans). ``quantize_p``: FP8 fake quantization of the softmax
    numerator (``flexsparse.quant``). Returns ``o (B, H, N, D)``, ``lse (B, H, N)``.
    """
    acc = accumulation_dtype(q.dtype)
    n, b, levels = selection.n, selection.block, selection.levels
    qa = q.to(acc)
    logits, values = [], []
    for level in range(levels):
        ids = selection.indices[level]                         # S_{level+1}: (B, H, G, K)
        groups, span = ids.shape[2], b ** (level + 1)
        padded = groups * b
        keys = _gather_blocks(_pad_tokens(k_levels[level].to(acc), padded), ids, b)
        vals = _gather_blocks(_pad_tokens(v_levels[level].to(acc), padded), ids, b)
        bias = _key_bias(ids, log_token_weights(n, b ** level, padded, q.device, acc), b)
        scores = (_query_groups(qa, groups, span) @ keys.transpose(-1, -2)) * scale + bias.unsqueeze(-2)
        logits.append(scores.flatten(2, 3)[:, :, :n])
        values.append(vals)
    top_k = k_levels[levels].to(acc)
    top_bias = log_token_weights(n, b ** levels, None, q.device, acc)
    heads = q.shape[1]
    kv_heads = kv_head_index(heads, top_k.shape[1], q.device)
    top_k, top_v = top_k[:, kv_heads], v_levels[levels].to(acc)[:, kv_heads]
    logits.append((qa @ top_k.transpose(-1, -2)) * scale + top_bias)
    widths = [x.shape[-1] for x in logits]
    probs, lse = _softmax(torch.cat(logits, dim=-1), quantize_p)
    probs = probs.split(widths, dim=-1)
    out = probs[-1] @ top_v
    for level in range(levels):
        groups, span = values[level].shape[2], b ** (level + 1)
        p = _pad_tokens(probs[level], groups * span).unflatten(2, (groups, span))
        out = out + (p @ values[level]).flatten(2, 3)[:, :, :n]
    return out.to(q.dtype), lse
