"""``vsa``: video sparse attention = coarse tile attention + fine top-K block-sparse attention.

select: pooled tiles, raw-dot scores, top-K key tiles per query tile.
attend: coarse attention over all pooled tiles (dense at tile level) and fine block-sparse attention.
combine: ``o_fine + g * o_coarse`` with ``g = 1`` or, with ``gate: true``, a learned per-token gate
``g = q . w + c`` per head (zero-initialised, so a fresh module is fine attention only).
The returned LSE is the fine branch's.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..masks import mean_pool
from ..reference import vsa_dense
from ._blocks import block_attention, select_blocks

BACKENDS = ("reference", "torch", "flex", "triton")
SELF_ATTENTION = False


def init_params(cfg, head_dim: int, num_heads: int, seq_len: int | None) -> dict[str, torch.Tensor]:
    if not cfg.gate:
        return {}
    return {"gate_weight": torch.zeros(num_heads, head_dim), "gate_bias": torch.zeros(num_heads)}


def gate_values(q: torch.Tensor, params) -> torch.Tensor:
    """Per-token gate ``(B, H, N, 1)`` from q and the gate parameters."""
    w, c = params["gate_weight"], params["gate_bias"]
    return (torch.einsum("bhnd,hd->bhn", q, w.to(q.dtype)) + c.to(q.dtype).view(1, -1, 1)).unsqueeze(-1)


def forward(q, k, v, cfg, *, backend: str, scale: float, params=None, need_lse: bool = True):
    if cfg.gate and not params:
        raise ValueError("vsa with gate=True has learnable parameters; use flexsparse.SparseAttention "
                         "or pass params={'gate_weight': (H, D), 'gate_bias': (H,)}")
    q_bar, k_bar = mean_pool(q, cfg.block_q), mean_pool(k, cfg.block_k)   # fp32, for selection and coarse
    selection = select_blocks(q, k, cfg, pooled=(q_bar, k_bar))
    gate = gate_values(q, params) if cfg.gate else None
    if backend == "reference":
        return vsa_dense(q, k, v, selection, scale, gate)
    fine, lse = block_attention(q, k, v, selection, scale, backend=backend, deterministic=cfg.deterministic)
    coarse = coarse_attention(q_bar, k_bar, mean_pool(v, cfg.block_k), scale, q.dtype)
    return combine(fine, coarse, cfg.block_q, gate), lse


def coarse_attention(q_bar, k_bar, v_bar, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Tile-level attention of pooled q ``(B, H, Tq, D)`` over pooled k, v ``(B, Hk, Tk, D)`` (block means, in
    the accumulation dtype), computed in ``dtype``: ``(B, H, Tq, D)``, one row per query tile."""
    qc, kc, vc = (x.to(dtype) for x in (q_bar, k_bar, v_bar))
    return F.scaled_dot_product_attention(qc, kc, vc, scale=scale, enable_gqa=q_bar.shape[1] != k_bar.shape[1])


def combine(fine: torch.Tensor, coarse: torch.Tensor, block_q: int, gate: torch.Tensor | None) -> torch.Tensor:
    """``fine + g * coarse`` with each query tile's coarse row ``(B, H, Tq, D)`` broadcast to its tokens:
    ``(B, H, N, D)``. When N fills the tiles the broadcast is a view, so no ``(B, H, N, D)`` copy of the coarse
    rows is made (forward or backward)."""
    n, tiles = fine.shape[2], coarse.shape[2]
    if tiles * block_q == n:
        rows = coarse.unsqueeze(3)
        if gate is not None:
            rows = gate.unflatten(2, (tiles, block_q)) * rows
        return (fine.unflatten(2, (tiles, block_q)) + rows).flatten(2, 3)
    coarse = coarse.repeat_interleave(block_q, dim=2)[:, :, :n]
    return fine + (coarse if gate is None else gate * coarse)
