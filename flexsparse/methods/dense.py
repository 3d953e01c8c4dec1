"""Dense building blocks of the methods' references: explicit token-level masks and weights, O(N^2), in the input
dtype (use fp64 on CPU for tests). Written independently of the sparse implementations: they share no code with
the backends."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..config import QuantConfig
from ..masks import BlockSelection
from ..quant import qat_attention, quantize_kv, quantized_softmax, quantizes_p


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


def block_select_bruteforce(q: torch.Tensor, k: torch.Tensor, topk: int, block_q: int, block_k: int,
                            smooth_k: bool = False) -> BlockSelection:
    """Top-K key blocks per query block from full raw-dot pooled scores; ties -> smallest id.
    ``smooth_k`` subtracts the per-head key mean first (SLA's router)."""
    k = expand_kv_heads(k, q.shape[1])
    if smooth_k:
        k = k - k.mean(2, keepdim=True)
    scores = span_means(q, block_q) @ span_means(k, block_k).transpose(-1, -2)
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :topk]
    return BlockSelection(order.sort(-1).values.to(torch.int32), block_q, block_k, q.shape[2], k.shape[2])


def block_sparse_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, selection: BlockSelection, scale: float,
               quant: QuantConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-sparse softmax attention through an explicit token mask: ``o (B,H,N,D)``, ``lse (B,H,N)``.
    ``quant``: FP8 fake-quantized forward, QAT backward (``flexsparse.quant.qat_attention``)."""
    heads = q.shape[1]
    mask = block_mask_dense(selection.indices, selection.n_q, selection.n_k, selection.block_q, selection.block_k)

    def attend(q, k, v, quant):
        if quant is not None:
            k, v = quantize_kv(k, v, quant, selection.block_k)
        return masked_softmax_attention(q, [expand_kv_heads(k, heads)], [expand_kv_heads(v, heads)], [mask], [None],
                                        scale, quantize_p=quantizes_p(quant))

    return qat_attention(attend, q, k, v, quant, block_q=selection.block_q, scale=scale)


def feature_map_dense(x: torch.Tensor, name: str) -> torch.Tensor:
    """phi over the head dim: ``softmax``, ``elu`` (elu + 1) or ``relu``."""
    if name == "softmax":
        return torch.softmax(x, dim=-1)
    if name == "elu":
        return F.elu(x) + 1
    if name == "relu":
        return torch.relu(x)
    raise ValueError(f"unknown feature map {name!r}; valid: ['softmax', 'elu', 'relu']")


def sparse_linear_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_weights: torch.Tensor,
                        linear_weights: torch.Tensor | None, scale: float, feature_map: str, eps: float,
                        quant: QuantConfig | None = None,
                        blocks: tuple[int, int] = (1, 1)) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Both branches with token-level key weights.

    q: ``(B, H, N, D)``; k, v: ``(B, Hk, N, D)``; log_weights: ``(B, H, N, N)`` added to the logits
    (``-inf`` removes a key); linear_weights: ``(B, H, N, N)`` or None (every key, weight 1).
    quant: FP8 fake-quantized softmax branch (QAT backward) with Q, K scale blocks of
    ``blocks = (block_q, block_k)`` tokens; the linear branch is never quantized.
    Returns ``o_s``, ``lse`` (natural log, ``(B, H, N)``) and ``o_l``, all ``(B, H, N, ...)``.
    """
    heads = q.shape[1]

    def attend(q, k, v, quant):
        if quant is not None:
            k, v = quantize_kv(k, v, quant, blocks[1])
        return masked_softmax_attention(q, [expand_kv_heads(k, heads)], [expand_kv_heads(v, heads)], [None],
                                        [log_weights], scale, quantize_p=quantizes_p(quant))

    o_s, lse = qat_attention(attend, q, k, v, quant, block_q=blocks[0], scale=scale)
    k, v = expand_kv_heads(k, heads), expand_kv_heads(v, heads)
    a = feature_map_dense(q, feature_map) @ feature_map_dense(k, feature_map).transpose(-1, -2)
    if linear_weights is not None:
        a = a * linear_weights
    o_l = (a @ v) / (eps + a.sum(-1, keepdim=True))
    return o_s, lse, o_l


def hard_weights(mask: torch.Tensor, skipped: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax log weights (0 on ``mask``, -inf elsewhere) and linear weights (1 off ``skipped``)."""
    return torch.where(mask, 0.0, float("-inf")).to(dtype), (~skipped).to(dtype)
