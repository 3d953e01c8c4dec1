"""SoftTop-k (Ding et al. 2024, used by SLA2 Eq. 17): a differentiable top-k mask with fixed row sums.

``M = sigmoid(scores / tau + lambda_i)``, with one shift ``lambda_i`` per row chosen so that every
row of ``M`` sums to ``count``. ``lambda`` is found without host syncs or data-dependent Python
control flow: ``iters`` bisection steps on a bracket that provably contains it, then
``NEWTON_STEPS`` Newton steps clamped to the final bracket (quadratic convergence to the fp limit).

Gradient: implicit. From ``sum_j sigmoid(z_j + lambda) = count`` with ``z = scores / tau``,
``d lambda / d z_k = -s'_k / sum_j s'_j`` (``s'`` the sigmoid slope), so a row's sum has zero
gradient. It is attached to the detached solution as ``lambda + (l(z) - l(z).detach())`` with
``l(z) = -sum_j w_j z_j``, ``w = s' / sum s'`` detached: the value is unchanged and the
first-order gradient is exact.
"""
from __future__ import annotations

import math

import torch

from ...masks import accumulation_dtype

NEWTON_STEPS = 2


def soft_topk_logits(scores: torch.Tensor, count: int, tau: float, iters: int) -> torch.Tensor:
    """Pre-sigmoid logits ``scores / tau + lambda`` of SoftTop-k, with the implicit gradient.

    scores: ``(..., n)`` finite; count: ``1 <= count <= n``; tau > 0; iters: bisection steps.
    Returns ``(..., n)`` in fp32 (fp64 for fp64 scores). ``sigmoid`` of it is the mask; consumers
    use ``logsigmoid`` / ``sigmoid(-x)`` for ``log M`` / ``1 - M`` (stable where M saturates).
    With ``count == n`` every entry is ``+inf`` (M = 1, no gradient).
    """
    n = scores.shape[-1]
    if not 1 <= count <= n:
        raise ValueError(f"SoftTop-k count must be in [1, {n}] (the row length), got {count}")
    if not tau > 0:
        raise ValueError(f"SoftTop-k temperature tau must be > 0, got {tau}")
    acc = accumulation_dtype(scores.dtype)
    if count == n:
        return torch.full(scores.shape, math.inf, dtype=acc, device=scores.device)
    z = scores.to(acc) / tau
    with torch.no_grad():
        shift = _solve_shift(z, count, iters)
        slope = torch.sigmoid(z + shift) * torch.sigmoid(-(z + shift))
        weights = slope / slope.sum(-1, keepdim=True).clamp_min(torch.finfo(acc).tiny)
    implicit = -(weights * z).sum(-1, keepdim=True)
    return z + shift + (implicit - implicit.detach())


def soft_topk(scores: torch.Tensor, count: int, tau: float, iters: int) -> torch.Tensor:
    """SoftTop-k mask ``(..., n)`` in (0, 1], each row summing to ``count`` (see ``soft_topk_logits``)."""
    return torch.sigmoid(soft_topk_logits(scores, count, tau, iters))


def _solve_shift(z: torch.Tensor, count: int, iters: int) -> torch.Tensor:
    """``lambda (..., 1)`` with ``sum_j sigmoid(z_j + lambda) = count``, for ``0 < count < n``.

    Bracket: at ``logit(count/n) - max z`` every term is ``<= count/n`` (sum ``<= count``), at
    ``logit(count/n) - min z`` every term is ``>= count/n``.
    """
    n = z.shape[-1]
    base = math.log(count / (n - count))
    lo = base - z.amax(-1, keepdim=True)
    hi = base - z.amin(-1, keepdim=True)
    for _ in range(iters):
        mid = (lo + hi) / 2
        over = torch.sigmoid(z + mid).sum(-1, keepdim=True) > count
        lo, hi = torch.where(over, lo, mid), torch.where(over, mid, hi)
    shift = (lo + hi) / 2
    for _ in range(NEWTON_STEPS):
        s = torch.sigmoid(z + shift)
        slope = (s * torch.sigmoid(-(z + shift))).sum(-1, keepdim=True).clamp_min(torch.finfo(z.dtype).tiny)
        shift = torch.minimum(torch.maximum(shift - (s.sum(-1, keepdim=True) - count) / slope, lo), hi)
    return shift
