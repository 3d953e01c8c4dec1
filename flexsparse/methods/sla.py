"""``sla``: sparse-linear attention (SLA, arXiv 2509.24006).

select: mean-pooled Q and smoothed K (``k - mean_N k``) per block, raw-dot scores in fp32, the top
``max(1, floor(topk_ratio * Tk))`` key blocks per query block ("critical") and, with
``negligible_ratio``, the bottom ``floor(negligible_ratio * Tk)`` ("negligible", skipped by both branches).
attend: softmax attention over the critical blocks (FP8 fake-quantized with ``quant``); linear attention
(feature map phi over the head dim) over the remaining ("marginal") blocks with ``linear="masked"`` (paper,
SLA-1) or over every key with ``linear="full"`` (the official main branch).
combine: ``O = O_s + O_l W^T + b`` in the input dtype (W and b, fp32 parameters, cast to it; bf16 / fp16
matmuls accumulate in fp32, as autocast's ``Linear`` does), W and b zero-initialised, so a fresh module
returns the sparse branch. On ``triton`` with ``linear="masked"`` the combine runs in the linear branch's
output kernel (``backends.triton_linear.mixed_output``), without ``quant`` both branches in one op
(``sparse_linear_output``). The returned LSE is the sparse branch's.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..backends import torch_linear
from ..masks import BlockSelection, block_topk, num_blocks, pooled_qk, sla_block_counts
from ..reference import sla_dense
from ._blocks import block_attention
from ._params import require_params

BACKENDS = ("reference", "torch", "flex", "triton")
SELF_ATTENTION = True


def init_params(cfg, head_dim: int, num_heads: int, seq_len: int | None) -> dict[str, torch.Tensor]:
    """The output projection of the linear branch, ``nn.Linear(D, D)`` layout, zero, fp32."""
    return {"proj_weight": torch.zeros(head_dim, head_dim), "proj_bias": torch.zeros(head_dim)}


def select(q: torch.Tensor, k: torch.Tensor, cfg) -> BlockSelection:
    """Critical blocks ``indices (B, H, Tq, K)`` and negligible blocks ``excluded`` (or None), no grad."""
    topk, bottomk = sla_block_counts(cfg.topk_ratio, cfg.negligible_ratio, num_blocks(k.shape[2], cfg.block_k))
    with torch.no_grad():
        q_bar, k_bar = pooled_qk(q, k, cfg.block_q, cfg.block_k, smooth_k=True)
        top, bottom = block_topk(q_bar, k_bar, topk, bottomk=bottomk)
    return BlockSelection(top, cfg.block_q, cfg.block_k, q.shape[2], k.shape[2], excluded=bottom)


def forward(q, k, v, cfg, *, backend: str, scale: float, params=None, need_lse: bool = True):
    d = q.shape[-1]
    p = require_params("sla", params, {"proj_weight": (d, d), "proj_bias": (d,)})
    selection = select(q, k, cfg)
    if backend == "reference":
        return sla_dense(q, k, v, selection, scale, linear=cfg.linear, feature_map=cfg.feature_map, eps=cfg.eps,
                         proj_weight=p["proj_weight"], proj_bias=p["proj_bias"], quant=cfg.quant)
    fused = backend == "triton" and cfg.linear == "masked"  # the combine inside the linear branch's output kernel
    if fused and cfg.quant is None:                            # and both branches in one op
        from ..backends.triton_linear import sparse_linear_output
        both = sparse_linear_output(q, k, v, selection, scale, deterministic=cfg.deterministic,
                                    feature_map=cfg.feature_map, eps=cfg.eps, weight=p["proj_weight"],
                                    bias=p["proj_bias"])
        if both is not None:
            return both
    o_s, lse = block_attention(q, k, v, selection, scale, backend=backend, deterministic=cfg.deterministic,
                               quant=cfg.quant)
    if fused:
        from ..backends.triton_linear import mixed_output
        out = mixed_output(q, k, v, selection, o_s, feature_map=cfg.feature_map, eps=cfg.eps,
                           weight=p["proj_weight"], bias=p["proj_bias"])
        if out is not None:
            return out, lse
    if cfg.linear == "masked":
        o_l = torch_linear.masked_linear_for(backend)(q, k, v, selection, feature_map=cfg.feature_map, eps=cfg.eps)
    else:
        o_l = torch_linear.linear_attention(q, k, v, feature_map=cfg.feature_map, eps=cfg.eps)
    dtype = q.dtype                # bf16 / fp16: one matmul with fp32 accumulation, like autocast's Linear
    return o_s + F.linear(o_l, p["proj_weight"].to(dtype), p["proj_bias"].to(dtype)), lse
