"""Block-sparse attention in PyTorch: the ``torch`` backend's sparse branch (autograd), its written-out backward
(the CPU branch of ``flexsparse::block_attn_bwd``) and SLA2's stage-1 softmax with a log weight per
(query block, key block).

No N x N tensor is built. Every function computes in fp32 (fp64 for fp64 inputs), returns the output in the input
dtype and the natural-log LSE in fp32 (fp64), and handles ragged lengths by padding with ``-inf`` logits, so padding
never enters a softmax.
"""
from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from ...masks import BlockSelection, accumulation_dtype, kv_head_index, log_token_weights
from ..common.gather import (gather_blocks, gathered_grads, key_bias, pad_tokens, query_groups, softmax_delta,
                             softmax_with_lse)


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
    keys = gather_blocks(pad_tokens(k.to(acc), tk * bk), ids, bk)
    values = gather_blocks(pad_tokens(v.to(acc), tk * bk), ids, bk)
    bias = key_bias(ids, log_token_weights(selection.n_k, 1, tk * bk, q.device, acc), bk)
    logits = (query_groups(q.to(acc), tq, bq) @ keys.transpose(-1, -2)) * scale + bias.unsqueeze(-2)
    probs, lse = softmax_with_lse(logits, quantize_p)
    out = probs @ values
    n = q.shape[2]
    return out.flatten(2, 3)[:, :, :n].to(q.dtype), lse.flatten(2, 3)[:, :, :n]


def block_sparse_attention_backward(do, dlse, q, k, v, selection: BlockSelection, scale: float, o, lse):
    """Gradients of ``block_sparse_attention``: ``(dq, dk, dv)`` in the input dtypes.

    do: ``(B, H, Nq, D)``; dlse: ``(B, H, Nq)`` or None; o, lse: the forward's outputs.
    """
    acc = accumulation_dtype(q.dtype)
    log_weights = log_token_weights(selection.n_k, 1, selection.num_k_blocks * selection.block_k, q.device, acc)
    dq, dk, dv = gathered_grads(q.to(acc), do.to(acc), lse.to(acc), softmax_delta(do, dlse, o, acc), selection.indices,
                                k, v, selection.block_q, selection.block_k, log_weights, scale)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


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
    keys = pad_tokens(k.to(acc), tk * block_k)[:, kv_heads]
    values = pad_tokens(v.to(acc), tk * block_k)[:, kv_heads]
    key_bias = log_token_weights(k.shape[2], 1, tk * block_k, q.device, acc).view(tk, block_k)
    groups = query_groups(q.to(acc), tq, block_q)
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
    """One chunk: q_rows ``(B, H, R, bq, D)``, keys/values ``(B, H, Tk*bk, D)``, log_weights ``(B, H, R, Tk)``.
    The products take the chunk's ``R * bq`` rows at once: the gradients of keys and values are ``(B, H, Tk*bk, D)``,
    not one per query block (a product broadcast over R materialises ``R`` of them, ``D / bq`` times the scores)."""
    bsz, heads, rows, bq, _ = q_rows.shape
    tk, bk = key_bias.shape
    logits = (q_rows.flatten(2, 3) @ keys.transpose(-1, -2)).view(bsz, heads, rows, bq, tk, bk) * scale
    logits = (logits + log_weights[:, :, :, None, :, None] + key_bias).flatten(-2)   # (B, H, R, bq, Tk*bk)
    lse = torch.logsumexp(logits, dim=-1)
    out = torch.exp(logits - lse.unsqueeze(-1)).flatten(2, 3) @ values
    return out.view(bsz, heads, rows, bq, -1), lse
