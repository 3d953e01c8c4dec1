"""LLSA attention in PyTorch: the ``torch`` backend's attention over the enriched multi-level KV (autograd), its
written-out backward (the CPU branch of ``flexsparse::llsa_attn_bwd``) and the adjoint of the pooling pyramid.

Computes in fp32 (fp64 for fp64 inputs), gathers like the block-sparse branch, no N x N tensor; padding enters no
softmax (``-inf`` log weights). Spans past the sequence are ``level_span``'s (N) and a level of fewer than b tokens
is one block of them (``block_width``): query groups and key blocks are padded to their ragged lengths, never to
``b^l`` or b.
"""
from __future__ import annotations

import torch

from ...masks import LLSALayout, Levels, LLSASelection, accumulation_dtype, kv_head_index, level_span, log_token_weights
from ..common.gather import (gather_blocks, gathered_grads, key_bias, pad_tokens, query_groups, softmax_delta,
                             softmax_with_lse)


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
        groups, span, width = ids.shape[2], level_span(n, b, level + 1), block_width(k_levels[level], b)
        padded = groups * width
        keys = gather_blocks(pad_tokens(k_levels[level].to(acc), padded), ids, width)
        vals = gather_blocks(pad_tokens(v_levels[level].to(acc), padded), ids, width)
        bias = key_bias(ids, log_token_weights(n, level_span(n, b, level), padded, q.device, acc), width)
        scores = (query_groups(qa, groups, span) @ keys.transpose(-1, -2)) * scale + bias.unsqueeze(-2)
        logits.append(scores.flatten(2, 3)[:, :, :n])
        values.append(vals)
    top_k = k_levels[levels].to(acc)
    top_bias = log_token_weights(n, level_span(n, b, levels), None, q.device, acc)
    heads = q.shape[1]
    kv_heads = kv_head_index(heads, top_k.shape[1], q.device)
    top_k, top_v = top_k[:, kv_heads], v_levels[levels].to(acc)[:, kv_heads]
    logits.append((qa @ top_k.transpose(-1, -2)) * scale + top_bias)
    widths = [x.shape[-1] for x in logits]
    probs, lse = softmax_with_lse(torch.cat(logits, dim=-1), quantize_p)
    probs = probs.split(widths, dim=-1)
    out = probs[-1] @ top_v
    for level in range(levels):
        groups, span = values[level].shape[2], level_span(n, b, level + 1)
        p = pad_tokens(probs[level], groups * span).unflatten(2, (groups, span))
        out = out + (p @ values[level]).flatten(2, 3)[:, :, :n]
    return out.to(q.dtype), lse


def extended_attention(q: torch.Tensor, k_levels: list[torch.Tensor], v_levels: list[torch.Tensor], ids: torch.Tensor,
                       layout: LLSALayout, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query block (``layout.block`` rows) of q ``(B, H, Nq, D)`` over the blocks ``ids (B, H, ceil(Nq / b), K)``
    of the extended KV ``[level 0 | ... | level L]`` (k_levels[l], v_levels[l] ``(B, Hk, T_l, D)``, each padded to
    its segment), a token's logit plus its ``ln(count)`` (``layout.log_weights``); one softmax per query. The same
    softmax as ``llsa_attention`` for ids listing the blocks it reads (``flexsparse.masks.llsa_block_ids``), for any
    rows of queries and any level 0 (a ring rank's fetched fine blocks). Autograd; memory ``B H Nq K b D``.
    Returns ``o (B, H, Nq, D)``, ``lse (B, H, Nq)`` (fp32, fp64 for fp64)."""
    acc, b, n_q = accumulation_dtype(q.dtype), layout.block, q.shape[2]
    k, v = extended_kv(k_levels, layout, acc), extended_kv(v_levels, layout, acc)
    groups = ids.shape[2]
    bias = key_bias(ids, layout.log_weights(q.device, acc), b)
    scores = query_groups(q.to(acc), groups, b) @ gather_blocks(k, ids, b).transpose(-1, -2) * scale
    probs, lse = softmax_with_lse(scores + bias.unsqueeze(-2), False)
    out = (probs @ gather_blocks(v, ids, b)).flatten(2, 3)[:, :, :n_q]
    return out.to(q.dtype), lse.flatten(2, 3)[:, :, :n_q]


def extended_kv(levels: list[torch.Tensor], layout: LLSALayout, dtype: torch.dtype) -> torch.Tensor:
    """``[level 0 | ... | level L]`` along the tokens in ``dtype``, level l zero padded to its segment of
    ``layout``: levels[l] ``(B, Hk, T_l, D)`` -> ``(B, Hk, layout.length, D)``."""
    return torch.cat([pad_tokens(x.to(dtype), blocks * layout.block)
                      for x, blocks in zip(levels, layout.segment_blocks)], dim=2)


def llsa_attention_backward(do, dlse, q, k_levels, v_levels, selection: LLSASelection, scale: float, o, lse):
    """Gradients of ``llsa_attention``: ``(dq, [dk_0..dk_L], [dv_0..dv_L])`` in the input dtypes.

    do: ``(B, H, N, D)``; dlse: ``(B, H, N)`` or None; o, lse: the forward's outputs.
    """
    acc = accumulation_dtype(q.dtype)
    n, b, levels = selection.n, selection.block, selection.levels
    heads, kv_heads = q.shape[1], k_levels[0].shape[1]
    qa, doa, lse = q.to(acc), do.to(acc), lse.to(acc)
    delta = softmax_delta(do, dlse, o, acc)
    dq = torch.zeros_like(qa)
    dks, dvs = [], []
    for level in range(levels):
        ids, width = selection.indices[level], block_width(k_levels[level], b)
        log_weights = log_token_weights(n, level_span(n, b, level), ids.shape[2] * width, q.device, acc)
        dq_l, dk, dv = gathered_grads(qa, doa, lse, delta, ids, k_levels[level], v_levels[level],
                                       level_span(n, b, level + 1), width, log_weights, scale)
        dq = dq + dq_l
        dks.append(dk.to(k_levels[level].dtype))
        dvs.append(dv.to(v_levels[level].dtype))
    kv = kv_head_index(heads, kv_heads, q.device)
    top_k, top_v = k_levels[levels].to(acc)[:, kv], v_levels[levels].to(acc)[:, kv]
    bias = log_token_weights(n, level_span(n, b, levels), None, q.device, acc)
    p = torch.exp((qa @ top_k.transpose(-1, -2)) * scale + bias - lse.unsqueeze(-1))
    ds = p * (doa @ top_v.transpose(-1, -2) - delta.unsqueeze(-1))
    dq = dq + (ds @ top_k) * scale
    group = heads // kv_heads
    dk_top = (ds.transpose(-1, -2) @ qa).unflatten(1, (kv_heads, group)).sum(2) * scale
    dv_top = (p.transpose(-1, -2) @ doa).unflatten(1, (kv_heads, group)).sum(2)
    dks.append(dk_top.to(k_levels[levels].dtype))
    dvs.append(dv_top.to(v_levels[levels].dtype))
    return dq.to(q.dtype), dks, dvs


def block_width(level: torch.Tensor, block: int) -> int:
    """Keys per selected block of a level ``(B, Hk, T, D)``: ``block``, or T for a level of fewer tokens (its one
    parent's children are all of them), so that no block is padded past the level."""
    return min(block, level.shape[2])


def unpool(grad_pyr: torch.Tensor, levels: Levels) -> torch.Tensor:
    """Backward of the pooling pyramid: ``(B, H, sum T_l, D)`` -> ``(B, H, N, D)``."""
    out = 0
    for level, grad in enumerate(levels.split_pyramid(grad_pyr), start=1):
        span = level_span(levels.n, levels.block, level)
        counts = (levels.n - torch.arange(grad.shape[2], device=grad.device) * span).clamp(max=span)
        out = out + (grad / counts.to(grad.dtype)[:, None]).repeat_interleave(span, dim=2)[:, :, :levels.n]
    return out
