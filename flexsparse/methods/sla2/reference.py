"""Dense reference of ``sla2``: token-level masks and weights, O(N^2), in the input dtype.

SLA2 mixes a softmax branch and a linear branch over the same keys, ``O = alpha * O_s + (1 - alpha) * O_l`` with
alpha per query block; the hard router's selected blocks go to the softmax branch and the others to the linear one,
the soft router's mask M weights both (``log M`` and ``1 - M``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...config import QuantConfig
from ...masks import BlockSelection, SoftBlockMask
from ..dense import block_mask_dense, hard_weights, sparse_linear_dense


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
        log_w, linear_w = hard_weights(selected, selected, q.dtype)
    o_s, lse, o_l = sparse_linear_dense(q, k, v, log_w, linear_w, scale, feature_map, eps, quant, (bq, bk))
    alpha = torch.sigmoid(alpha_logit.to(q.dtype)).repeat_interleave(bq, -1)[:, :n_q]
    alpha = alpha.unsqueeze(0).unsqueeze(-1)
    return alpha * o_s + (1 - alpha) * o_l, lse
