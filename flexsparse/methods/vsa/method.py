"""``vsa``: video sparse attention = coarse tile attention + fine top-K block-sparse attention.

select: pooled tiles, raw-dot scores, top-K key tiles per query tile.
attend: coarse attention over all pooled tiles (dense at tile level) and fine block-sparse attention.
combine: ``o_fine + g * o_coarse`` with ``g = 1`` or, with ``gate: true``, a learned per-token gate
``g = q . w + c`` per head (zero-initialised, so a fresh module is fine attention only).
The returned LSE is the fine branch's.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from ...masks import BlockSelection
from ..base import Method, require_params
from ..blocks import select_blocks
from . import reference
from .config import VSAConfig


class VSASelection(NamedTuple):
    """The fine selection with the coarse branch's pooled tiles of q, k and v (block means in their dtypes, pooled
    with the fp32 means the selection was scored on)."""

    blocks: BlockSelection
    q_tiles: torch.Tensor
    k_tiles: torch.Tensor
    v_tiles: torch.Tensor


class VSA(Method):
    name = "vsa"
    config = VSAConfig
    example = {"method": "vsa", "block_size": 64, "topk": 8}
    self_attention = False

    def init_params(self, cfg, head_dim, num_heads, seq_len):
        if not cfg.gate:
            return {}
        return {"gate_weight": torch.zeros(num_heads, head_dim), "gate_bias": torch.zeros(num_heads)}

    def head_params(self, cfg):
        return ("gate_weight", "gate_bias") if cfg.gate else ()

    def check_params(self, cfg, q, params):
        if not cfg.gate:
            return super().check_params(cfg, q, params)
        heads, d = q.shape[1], q.shape[3]
        return require_params("vsa", params, {"gate_weight": (heads, d), "gate_bias": (heads,)})

    def select(self, q, k, v, cfg, backend, params):
        q_bar, k_bar, *tiles = backend.coarse_pooling(q, k, v, cfg.block_q, cfg.block_k)
        return VSASelection(select_blocks(q, k, v, cfg, backend, pooled=(q_bar, k_bar)), *tiles)

    def attend(self, q, k, v, selection, cfg, backend, *, scale, params, need_lse):
        fine, lse = backend.block_sparse_attention(q, k, v, selection.blocks, scale, deterministic=cfg.deterministic)
        coarse = coarse_attention(selection.q_tiles, selection.k_tiles, selection.v_tiles, scale)
        return combine(fine, coarse, cfg.block_q, gate_values(q, params) if cfg.gate else None), lse

    def reference(self, q, k, v, selection, cfg, *, scale, params):
        return reference.vsa_dense(q, k, v, selection.blocks, scale, gate_values(q, params) if cfg.gate else None)


def gate_values(q: torch.Tensor, params) -> torch.Tensor:
    """Per-token gate ``(B, H, N, 1)`` from q and the gate parameters."""
    w, c = params["gate_weight"], params["gate_bias"]
    return (torch.einsum("bhnd,hd->bhn", q, w.to(q.dtype)) + c.to(q.dtype).view(1, -1, 1)).unsqueeze(-1)


def coarse_attention(q_tiles, k_tiles, v_tiles, scale: float) -> torch.Tensor:
    """Tile-level attention of pooled q ``(B, H, Tq, D)`` over pooled k, v ``(B, Hk, Tk, D)`` (block means in the
    inputs' dtype): ``(B, H, Tq, D)``, one row per query tile."""
    return F.scaled_dot_product_attention(q_tiles, k_tiles, v_tiles, scale=scale,
                                          enable_gqa=q_tiles.shape[1] != k_tiles.shape[1])


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
