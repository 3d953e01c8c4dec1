"""``sla2``: SLA2 (arXiv 2602.12675): learnable router and alpha-mixing of sparse and linear attention.

smooth: with ``smooth_k="all"`` (paper Alg. 2) ``K <- K - mean_N K`` before everything, which changes
the linear branch; with ``"router"`` only the router sees the smoothed K (as SLA).
select: pooled Q and K, shared ``proj_q``, ``proj_k`` (D x D, no bias, identity at init so an untrained
router equals SLA's), scores ``proj_q(Qbar) proj_k(Kbar)^T / sqrt(D)`` (softmax over the row with
``router_softmax``); ``router="hard"``: the top ``max(1, floor(topk_ratio * Tk))`` blocks (no gradient to
the router); ``router="soft"``: SoftTop-k with temperature ``tau`` (stage-1 calibration), with
``softtopk_standardize`` on the raw scores standardized per row (see ``flexsparse.training.calibrate``).
attend: softmax attention over the selected blocks and linear attention over the others (hard), or
``softmax(S + log M)`` over all keys and linear attention weighted by ``1 - M`` (soft); ``quant`` (hard
router only) fake-quantizes the sparse branch's forward in FP8.
combine: ``O = alpha * O_s + (1 - alpha) * O_l`` (``torch.lerp`` in the input dtype), ``alpha =
sigmoid(alpha_logit)`` per query block (and per head with ``alpha_per_head``); on ``triton`` (hard router)
in the linear branch's output kernel (``backends.triton_linear.mixed_output``; without ``quant`` both branches in
one op, ``sparse_linear_output``). The returned LSE is the sparse branch's.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..backends import torch_linear, torch_soft
from ..masks import (BlockSelection, SoftBlockMask, block_sums, block_topk, key_mean, num_blocks, pooled_qk,
                     ratio_count, router_scores, smoothed_keys, soft_topk_logits, standardize_rows)
from ..masks.pooling import accumulation_dtype
from ..reference import sla2_dense
from ._blocks import block_attention
from ._params import require_params

BACKENDS = ("reference", "torch", "flex", "triton")
SELF_ATTENTION = True


def init_params(cfg, head_dim: int, num_heads: int, seq_len: int | None) -> dict[str, torch.Tensor]:
    """Router projections ``proj_q``, ``proj_k`` (identity, ``(D, D)``) and ``alpha_logit``
    ``(1 or H, Tq)`` with ``sigmoid = alpha_init``; ``Tq`` comes from ``seq_len``. fp32."""
    if seq_len is None:
        raise ValueError("method 'sla2' learns one alpha per query block, so it needs seq_len: "
                         "flexsparse.SparseAttention(config, head_dim=..., num_heads=..., seq_len=N)")
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
    rows = num_heads if cfg.alpha_per_head else 1
    logit = math.log(cfg.alpha_init / (1.0 - cfg.alpha_init))
    return {"proj_q": torch.eye(head_dim), "proj_k": torch.eye(head_dim),
            "alpha_logit": torch.full((rows, num_blocks(seq_len, cfg.block_q)), logit)}


def route(q: torch.Tensor, k: torch.Tensor, cfg, proj_q: torch.Tensor, proj_k: torch.Tensor,
          k_sums: torch.Tensor | None = None) -> BlockSelection | SoftBlockMask:
    """Hard selection ``(B, H, Tq, K)`` or SoftTop-k mask ``(B, H, Tq, Tk)`` from the projected pooled Q and
    smoothed K (``k_sums``: ``masks.block_sums(k, block_k)`` when the caller has them)."""
    count = ratio_count(cfg.topk_ratio, num_blocks(k.shape[2], cfg.block_k), minimum=1)
    soft = cfg.router == "soft"
    with torch.set_grad_enabled(soft and torch.is_grad_enabled()):
        q_bar, k_bar = pooled_qk(q, k, cfg.block_q, cfg.block_k, smooth_k=True, k_sums=k_sums)
        q_bar, k_bar = q_bar @ proj_q.to(q_bar.dtype).T, k_bar @ proj_k.to(k_bar.dtype).T
        if not soft:
            top, _ = block_topk(q_bar, k_bar, count)
            return BlockSelection(top, cfg.block_q, cfg.block_k, q.shape[2], k.shape[2])
        if cfg.softtopk_standardize:           # raw logits, one std per row (scale-free SoftTop-k)
            scores = standardize_rows(router_scores(q_bar, k_bar, softmax=False))
        else:
            scores = router_scores(q_bar, k_bar, softmax=cfg.router_softmax)
        logits = soft_topk_logits(scores, count, cfg.tau, cfg.softtopk_iters)
    return SoftBlockMask(logits, cfg.block_q, cfg.block_k, q.shape[2], k.shape[2])


def _check_alpha(params, rows: int, tq: int, n: int, block_q: int) -> None:
    alpha = (params or {}).get("alpha_logit")
    if isinstance(alpha, torch.Tensor) and alpha.dim() == 2 and alpha.shape[0] == rows and alpha.shape[1] != tq:
        raise ValueError(f"params['alpha_logit'] holds {alpha.shape[1]} query blocks but N={n} with block_q={block_q} "
                         f"gives {tq}; SLA2's alpha is per query block, so build SparseAttention with seq_len={n}")


def forward(q, k, v, cfg, *, backend: str, scale: float, params=None, need_lse: bool = True):
    heads, n, d = q.shape[1], q.shape[2], q.shape[3]
    rows, tq = heads if cfg.alpha_per_head else 1, num_blocks(n, cfg.block_q)
    _check_alpha(params, rows, tq, n, cfg.block_q)
    p = require_params("sla2", params, {"proj_q": (d, d), "proj_k": (d, d), "alpha_logit": (rows, tq)})
    acc = accumulation_dtype(q.dtype)
    k_sums = block_sums(k, cfg.block_k)           # one pass over k for the router and the smoothing mean
    mask = route(q, k, cfg, p["proj_q"], p["proj_k"], k_sums)    # pool(k) - mean in fp32: keys never rounded
    if cfg.smooth_k == "all":                      # both branches attend the smoothed keys, one rounding
        k = smoothed_keys(k, key_mean(k, cfg.block_k, k_sums))
    if backend == "reference":
        return sla2_dense(q, k, v, mask, scale, feature_map=cfg.feature_map, eps=cfg.eps,
                          alpha_logit=p["alpha_logit"], quant=cfg.quant)
    alpha = torch.sigmoid(p["alpha_logit"].to(acc))                                             # (rows, Tq)
    if isinstance(mask, SoftBlockMask):            # calibration: soft weights on every block (torch)
        o_s, lse = torch_soft.soft_block_attention(q, k, v, F.logsigmoid(mask.logits), mask.block_q,
                                                   mask.block_k, scale)
        o_l = torch_linear.weighted_linear_attention(q, k, v, torch.sigmoid(-mask.logits), mask.block_q,
                                                     mask.block_k, feature_map=cfg.feature_map, eps=cfg.eps)
    else:
        if backend == "triton" and cfg.quant is None:  # both branches and the lerp in one op
            from ..backends.triton_linear import sparse_linear_output
            both = sparse_linear_output(q, k, v, mask, scale, deterministic=cfg.deterministic,
                                        feature_map=cfg.feature_map, eps=cfg.eps, alpha=alpha)
            if both is not None:
                return both
        o_s, lse = block_attention(q, k, v, mask, scale, backend=backend,
                                   deterministic=cfg.deterministic, quant=cfg.quant)
        if backend == "triton":                    # the lerp inside the linear branch's output kernel
            from ..backends.triton_linear import mixed_output
            out = mixed_output(q, k, v, mask, o_s, feature_map=cfg.feature_map, eps=cfg.eps, alpha=alpha)
            if out is not None:
                return out, lse
        o_l = torch_linear.masked_linear_for(backend)(q, k, v, mask, feature_map=cfg.feature_map, eps=cfg.eps)
    token_block = torch.arange(n, device=q.device) // cfg.block_q
    per_token = alpha[:, token_block].unsqueeze(0).unsqueeze(-1)                                  # (1, rows, N, 1)
    return torch.lerp(o_l, o_s, per_token.to(q.dtype)), lse  # one pass, fp32 math inside for bf16 / fp16
