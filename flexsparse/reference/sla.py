"""Dense references of SLA and SLA2: token-level masks and weights, O(N^2), in the input dtype.

Both methods are a softmax branch plus a linear branch over the same keys:
  ``O_s = softmax(q k^T * scale + log W_s) v``           (W_s: 1 on selected keys, 0 elsewhere, or soft M)
  ``O_l = (A v) / (eps + rowsum A)``, ``A = phi(q) phi(k)^T * W_l``   (W_l: the linear branch's key weights)
SLA: ``O = O_s + O_l W^T + b``. SLA2: ``O = alpha * O_s + (1 - alpha) * O_l``, alpha per query block.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..config import QuantConfig
from ..masks.selection import BlockSelection, SoftBlockMask
from ..quant import qat_attention, quantize_kv, quantizes_p
from .dense import block_mask_dense, expand_kv_heads, masked_softmax_attention


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
    quant: FP8 fake-quantized softmax branch (straight-through backward) with Q, K scale blocks of
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


def _hard_weights(mask: torch.Tensor, skipped: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax log weights (0 on ``mask``, -inf elsewhere) and linear weights (1 off ``skipped``)."""
    return torch.where(mask, 0.0, float("-inf")).to(dtype), (~skipped).to(dtype)


def sla_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, selection: BlockSelection, scale: float, *,
              linear: str, feature_map: str, eps: float, proj_weight: torch.Tensor, proj_bias: torch.Tensor,
              quant: QuantConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """SLA: ``O = O_s + O_l proj_weight^T + proj_bias``; returns ``o (B, H, N, D)`` and the sparse LSE.

    Sparse branch: the selected blocks (FP8 fake-quantized with ``quant``). Linear branch:
    ``linear="masked"`` the blocks neither selected nor in ``selection.excluded`` (negligible);
    ``linear="full"`` every key.
    """
    dims = (selection.n_q, selection.n_k, selection.block_q, selection.block_k)
    selected = block_mask_dense(selection.indices, *dims)
    skipped = selected
    if selection.excluded is not None:
        skipped = selected | block_mask_dense(selection.excluded, *dims)
    log_w, linear_w = _hard_weights(selected, skipped, q.dtype)
    o_s, lse, o_l = sparse_linear_dense(q, k, v, log_w, linear_w if linear == "masked" else None, scale,
                                        feature_map, eps, quant, (selection.block_q, selection.block_k))
    return o_s + o_l @ proj_weight.to(q.dtype).T + proj_bias.to(q.dtype), lse


def sla2_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: BlockSelection | SoftBlockMask,
               scale: float, *, feature_map: str, eps: float, alpha_logit: torch.Tensor,
               quant: QuantConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """SLA2: ``O = alpha * O_s + (1 - alpha) * O_l``; returns ``o (B, H, N, D)`` and the sparse LSE.

    k: the keys both branches see (already smoothed for ``smooth_k="all"``).
    mask: hard selection (O_s over the selected blocks, O_l over the others) or a soft mask M
    (O_s = softmax(S + log M), O_l weighted by 1 - M), M expanded over each block's tokens.
    alpha_logit: ``(1 or H, Tq)``; ``alpha = sigmoid(alpha_logit)`` broadcast over each query block.
    quant: FP8 fake-quantized sparse branch (hard masks only).
    """
    n_q, n_k, bq, bk = mask.n_q, mask.n_k, mask.block_q, mask.block_k
    if isinstance(mask, SoftBlockMask):
        logits = mask.logits.to(q.dtype).repeat_interleave(bq, 2)[:, :, :n_q].repeat_interleave(bk, 3)[..., :n_k]
        log_w, linear_w = F.logsigmoid(logits), torch.sigmoid(-logits)
    else:
        selected = block_mask_dense(mask.indices, n_q, n_k, bq, bk)
        log_w, linear_w = _hard_weights(selected, selected, q.dtype)
    o_s, lse, o_l = sparse_linear_dense(q, k, v, log_w, linear_w, scale, feature_map, eps, quant, (bq, bk))
    alpha = torch.sigmoid(alpha_logit.to(q.dtype)).repeat_interleave(bq, -1)[:, :n_q]
    alpha = alpha.unsqueeze(0).unsqueeze(-1)
    return alpha * o_s + (1 - alpha) * o_l, lse
