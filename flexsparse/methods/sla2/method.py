"""``sla2``: SLA2 (arXiv 2602.12675): learnable router and alpha-mixing of sparse and linear attention.

smooth: with ``smooth_k="all"`` (paper Alg. 2) both branches attend ``K - mean_N K``, which changes the linear
branch; ``"router"`` (default) gives the branches the keys as they come (as SLA). The router's selection is the same
on smoothed and raw keys (``Backend.router_inputs``), so it pools them raw.
select: pooled Q and K, shared ``proj_q``, ``proj_k`` (D x D, no bias, identity at init so an untrained
router equals SLA's), scores ``proj_q(Qbar) proj_k(Kbar)^T / sqrt(D)`` (softmax over the row with
``router_softmax``); ``router="hard"``: the top ``max(1, floor(topk_ratio * Tk))`` blocks (no gradient to
the router); ``router="soft"``: SoftTop-k with temperature ``tau`` (stage-1 calibration), with
``softtopk_standardize`` on the raw scores standardized per row (see ``flexsparse.training.calibrate``).
attend: softmax attention over the selected blocks and linear attention over the others (hard), or
``softmax(S + log M)`` over all keys and linear attention weighted by ``1 - M`` (soft); ``quant`` (hard
router only) fake-quantizes the sparse branch's forward in FP8.
combine: ``O = alpha * O_s + (1 - alpha) * O_l`` (``torch.lerp`` in the input dtype), ``alpha =
sigmoid(alpha_logit)`` per query block (and per head with ``alpha_per_head``); a backend may fuse it, sigmoid
included, into the linear branch (``mixed_linear_output``) or run both branches and the combine in one op
(``sparse_linear_output``): both take the logits.
The returned LSE is the sparse branch's.
lengths: ``alpha_logit`` holds ``T`` stored blocks (``seq_len``'s); a call with another number of query blocks ``Tq``
runs on ``alpha_logits_at``'s linear interpolation of them, made once in ``check_params``, so every backend and the
reference see the call's ``(1 or H, Tq)``.
"""
from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ...masks import BlockSelection, SoftBlockMask, accumulation_dtype, num_blocks
from ..base import Method, SeqLenRequired, require_params
from ..blocks import smoothing_mean
from . import reference
from .config import SLA2Config
from .router import route, smoothed_keys


class SLA2Selection(NamedTuple):
    """The router's mask and the keys both branches attend (smoothed with ``smooth_k="all"``)."""

    mask: BlockSelection | SoftBlockMask
    keys: torch.Tensor


class SLA2(Method):
    name = "sla2"
    config = SLA2Config
    example = {"method": "sla2", "block_q": 128, "block_k": 64, "topk_ratio": 0.05}

    def init_params(self, cfg, head_dim, num_heads, seq_len):
        """Router projections ``proj_q``, ``proj_k`` (identity, ``(D, D)``) and ``alpha_logit``
        ``(1 or H, T)`` with ``sigmoid = alpha_init``, ``T = ceil(seq_len / block_q)``: the resolution alpha is
        stored and learned at; calls at other lengths interpolate it (``alpha_logits_at``). fp32."""
        if seq_len is None:
            raise SeqLenRequired("method 'sla2' stores one alpha per query block of seq_len tokens (other lengths "
                             "interpolate them), so it needs seq_len: "
                             "flexsparse.SparseAttention(config, head_dim=..., num_heads=..., seq_len=N)")
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
        rows = num_heads if cfg.alpha_per_head else 1
        logit = math.log(cfg.alpha_init / (1.0 - cfg.alpha_init))
        return {"proj_q": torch.eye(head_dim), "proj_k": torch.eye(head_dim),
                "alpha_logit": torch.full((rows, num_blocks(seq_len, cfg.block_q)), logit)}

    def frozen_params(self, cfg):
        """The router's projections under the hard top-k router, which passes them no gradient (``prepare_stage2``
        sets them trainable for ``router="soft"``)."""
        return ("proj_q", "proj_k") if cfg.router == "hard" else ()

    def head_params(self, cfg):
        return ("alpha_logit",) if cfg.alpha_per_head else ()

    def check_params(self, cfg, q, params):
        """The checked parameters, ``alpha_logit`` ``(rows, T)`` (any ``T >= 1``) returned as the call's
        ``(rows, Tq)`` by ``alpha_logits_at`` (the stored tensor itself when ``T == Tq``)."""
        heads, n, d = q.shape[1], q.shape[2], q.shape[3]
        rows, tq = heads if cfg.alpha_per_head else 1, num_blocks(n, cfg.block_q)
        alpha = (params or {}).get("alpha_logit")
        if isinstance(alpha, torch.Tensor):
            if alpha.dim() != 2 or alpha.shape[0] != rows or alpha.shape[1] < 1:
                per = f"one row per head (alpha_per_head, H={heads})" if cfg.alpha_per_head else "one row"
                raise ValueError(f"params['alpha_logit'] must have shape ({rows}, T): {per} of T >= 1 stored query "
                                 f"blocks (interpolated to the call's {tq}), got {tuple(alpha.shape)}")
            if not alpha.is_floating_point():
                raise TypeError(f"params['alpha_logit'] must be a floating-point tensor, got {alpha.dtype}")
        stored = alpha.shape[1] if isinstance(alpha, torch.Tensor) else tq
        checked = require_params("sla2", params, {"proj_q": (d, d), "proj_k": (d, d), "alpha_logit": (rows, stored)})
        checked["alpha_logit"] = alpha_logits_at(checked["alpha_logit"], tq)
        return checked

    def select(self, q, k, v, cfg, backend, params) -> SLA2Selection:
        # the FP8 operands of the pooling pass serve the hard router's branch on the keys as they come
        quant = cfg.quant if cfg.router == "hard" and cfg.smooth_k == "router" else None
        with torch.set_grad_enabled(cfg.router == "soft" and torch.is_grad_enabled()):   # the soft router trains
            # for the router and the smoothing mean
            pooled, prepared = backend.quantizing_pooling(q, k, v, cfg.block_q, cfg.block_k, quant)
        mask = route(q, k, cfg, backend, params["proj_q"], params["proj_k"], pooled)  # keys never rounded
        if cfg.smooth_k == "all":                      # both branches attend the smoothed keys, one rounding
            k = smoothed_keys(k, backend.key_mean(k, cfg.block_k, pooled[2]), backend)
        elif isinstance(mask, BlockSelection) and cfg.quant is not None:     # the raw keys' mean: FP8 smoothing
            mask = dataclasses.replace(mask, key_mean=smoothing_mean(k, cfg, backend, pooled[2]), prepared=prepared)
        return SLA2Selection(mask, k)

    def attend(self, q, k, v, selection, cfg, backend, *, scale, params, need_lse):
        mask, k = selection
        logit = params["alpha_logit"].to(accumulation_dtype(q.dtype))                               # (rows, Tq)
        linear = dict(feature_map=cfg.feature_map, eps=cfg.eps)
        if isinstance(mask, SoftBlockMask):            # calibration: soft weights on every block
            o_s, lse = backend.soft_block_attention(q, k, v, F.logsigmoid(mask.logits), mask.block_q, mask.block_k,
                                                    scale)
            o_l = backend.weighted_linear_attention(q, k, v, torch.sigmoid(-mask.logits), mask.block_q,
                                                    mask.block_k, **linear)
            return combine(o_s, o_l, torch.sigmoid(logit), cfg.block_q), lse
        both = backend.sparse_linear_output(q, k, v, mask, scale, deterministic=cfg.deterministic, quant=cfg.quant,
                                            alpha_logit=logit, **linear)
        if both is not None:
            return both
        o_s, lse = backend.block_sparse_attention(q, k, v, mask, scale, deterministic=cfg.deterministic,
                                                  quant=cfg.quant)
        mixed = backend.mixed_linear_output(q, k, v, mask, o_s, alpha_logit=logit, **linear)
        if mixed is not None:
            return mixed, lse
        o_l = backend.masked_linear_attention(q, k, v, mask, **linear)
        return combine(o_s, o_l, torch.sigmoid(logit), cfg.block_q), lse

    def reference(self, q, k, v, selection, cfg, *, scale, params):
        return reference.sla2_dense(q, selection.keys, v, selection.mask, scale, feature_map=cfg.feature_map,
                                    eps=cfg.eps, alpha_logit=params["alpha_logit"], quant=cfg.quant)


def alpha_logits_at(alpha_logit: torch.Tensor, blocks: int) -> torch.Tensor:
    """The stored per-block logits ``(rows, T)`` at a call's ``blocks`` query blocks: ``(rows, blocks)``.

    ``alpha_logit`` itself when ``T == blocks`` (no op, bit-identical). Otherwise the logits are a function of the
    normalised position, block ``j`` of ``T`` at its centre ``(j + 0.5) / T`` (by block index: a ragged last block
    counts whole), linearly interpolated between neighbouring centres and constant past the outer ones, read at the
    call's centres ``(i + 0.5) / blocks`` (``F.interpolate``, ``mode="linear"``, ``align_corners=False``), in
    ``alpha_logit``'s dtype and differentiable, so a call at any length trains the stored parameter.
    """
    if alpha_logit.shape[-1] == blocks:
        return alpha_logit
    return F.interpolate(alpha_logit.unsqueeze(0), size=blocks, mode="linear", align_corners=False).squeeze(0)


def combine(o_s: torch.Tensor, o_l: torch.Tensor, alpha: torch.Tensor, block_q: int) -> torch.Tensor:
    """``O_l + alpha (o_s - O_l)`` with ``alpha (1 or H, Tq)`` per query block, one ``torch.lerp`` pass in the
    branches' dtype (fp32 math inside for bf16 / fp16)."""
    token_block = torch.arange(o_s.shape[2], device=o_s.device) // block_q
    per_token = alpha[:, token_block].unsqueeze(0).unsqueeze(-1)                                  # (1, rows, N, 1)
    return torch.lerp(o_l, o_s, per_token.to(o_s.dtype))
