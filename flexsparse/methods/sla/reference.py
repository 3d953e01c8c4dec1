"""Dense reference of ``sla``: token-level masks and weights, O(N^2), in the input dtype.

SLA is a softmax branch plus a linear branch over the same keys:
  ``O_s = softmax(q k^T * scale + log W_s) v``           (W_s: 1 on selected keys, 0 elsewhere)
  ``O_l = (A v) / (eps + rowsum A)``, ``A = phi(q) phi(k)^T * W_l``   (W_l: the linear branch's key weights)
  ``O = O_s + O_l W^T + b``.
"""
from __future__ import annotations

import torch

from ...config import QuantConfig
from ...masks import BlockSelection
from ..dense import block_mask_dense, hard_weights, sparse_linear_dense


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
    log_w, linear_w = hard_weights(selected, skipped, q.dtype)
    o_s, lse, o_l = sparse_linear_dense(q, k, v, log_w, linear_w if linear == "masked" else None, scale,
                                        feature_map, eps, quant, (selection.block_q, selection.block_k))
    return o_s + o_l @ proj_weight.to(q.dtype).T + proj_bias.to(q.dtype), lse
