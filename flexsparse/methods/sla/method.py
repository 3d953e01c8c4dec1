"""``sla``: sparse-linear attention (SLA, arXiv 2509.24006).

select: mean-pooled Q and K per block (the paper's smoothed K selects the same blocks), raw-dot scores in fp32, the top
``max(1, floor(topk_ratio * Tk))`` key blocks per query block ("critical") and, with
``negligible_ratio``, the bottom ``floor(negligible_ratio * Tk)`` ("negligible", skipped by both branches).
attend: softmax attention over the critical blocks (FP8 fake-quantized with ``quant``); linear attention
(feature map phi over the head dim) over the remaining ("marginal") blocks with ``linear="masked"`` (paper,
SLA-1) or over every key with ``linear="full"`` (the official main branch).
combine: ``O = O_s + O_l W^T + b`` in the input dtype (W and b, fp32 parameters, cast to it; bf16 / fp16
matmuls accumulate in fp32, as autocast's ``Linear`` does), W and b zero-initialised, so a fresh module
returns the sparse branch. A backend may fuse the combine into its linear branch (``mixed_linear_output``) or run
both branches and the combine in one op (``sparse_linear_output``). The returned LSE is the sparse branch's.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...masks import BlockSelection, num_blocks, sla_block_counts
from ..base import Method, require_params
from ..blocks import smoothing_mean
from . import reference
from .config import SLAConfig


class SLA(Method):
    name = "sla"
    config = SLAConfig
    example = {"method": "sla", "block_size": 64, "topk_ratio": 0.05}

    def init_params(self, cfg, head_dim, num_heads, seq_len):
        """The output projection of the linear branch, ``nn.Linear(D, D)`` layout, zero, fp32."""
        return {"proj_weight": torch.zeros(head_dim, head_dim), "proj_bias": torch.zeros(head_dim)}

    def check_params(self, cfg, q, params):
        d = q.shape[-1]
        return require_params("sla", params, {"proj_weight": (d, d), "proj_bias": (d,)})

    def select(self, q, k, v, cfg, backend, params) -> BlockSelection:
        """Critical blocks ``indices (B, H, Tq, K)``, negligible blocks ``excluded`` (or None) and with ``quant``
        the keys' mean or the backend's FP8 operands, no grad."""
        topk, bottomk = sla_block_counts(cfg.topk_ratio, cfg.negligible_ratio, num_blocks(k.shape[2], cfg.block_k))
        with torch.no_grad():
            pooled, prepared = backend.quantizing_pooling(q, k, v, cfg.block_q, cfg.block_k, cfg.quant)
            q_bar, k_bar = backend.router_inputs(q, k, cfg.block_q, cfg.block_k, pooled)
            top, bottom = backend.block_topk(q_bar, k_bar, topk, bottomk)
        return BlockSelection(top, cfg.block_q, cfg.block_k, q.shape[2], k.shape[2], excluded=bottom,
                              key_mean=smoothing_mean(k, cfg, backend, pooled[2]), prepared=prepared)

    def attend(self, q, k, v, selection, cfg, backend, *, scale, params, need_lse):
        weight, bias = params["proj_weight"], params["proj_bias"]
        linear = dict(feature_map=cfg.feature_map, eps=cfg.eps)
        if cfg.linear == "masked":
            both = backend.sparse_linear_output(q, k, v, selection, scale, deterministic=cfg.deterministic,
                                                quant=cfg.quant, weight=weight, bias=bias, **linear)
            if both is not None:
                return both
        o_s, lse = backend.block_sparse_attention(q, k, v, selection, scale, deterministic=cfg.deterministic,
                                                  quant=cfg.quant)
        if cfg.linear == "full":
            return combine(o_s, backend.linear_attention(q, k, v, **linear), weight, bias), lse
        mixed = backend.mixed_linear_output(q, k, v, selection, o_s, weight=weight, bias=bias, **linear)
        if mixed is not None:
            return mixed, lse
        return combine(o_s, backend.masked_linear_attention(q, k, v, selection, **linear), weight, bias), lse

    def reference(self, q, k, v, selection, cfg, *, scale, params):
        return reference.sla_dense(q, k, v, selection, scale, linear=cfg.linear, feature_map=cfg.feature_map,
                                   eps=cfg.eps, proj_weight=params["proj_weight"], proj_bias=params["proj_bias"],
                                   quant=cfg.quant)


def combine(o_s: torch.Tensor, o_l: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``o_s + o_l W^T + b`` in the branches' dtype: for bf16 / fp16 one matmul with fp32 accumulation, like
    autocast's ``Linear``."""
    return o_s + F.linear(o_l, weight.to(o_s.dtype), bias.to(o_s.dtype))
