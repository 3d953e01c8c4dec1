"""``topk``: single-level block top-K (MoBA/VMoBA style).

select: mean-pool Q and K blocks, raw-dot scores, top-K key blocks per query block.
attend: softmax attention over the selected blocks (scale ``1/sqrt(D)``), FP8 fake-quantized with ``quant``.
"""
from __future__ import annotations

from ._blocks import block_attention, select_blocks

BACKENDS = ("reference", "torch", "flex", "triton")
SELF_ATTENTION = False


def init_params(cfg, head_dim: int, num_heads: int, seq_len: int | None):
    return {}


def forward(q, k, v, cfg, *, backend: str, scale: float, params=None, need_lse: bool = True):
    selection = select_blocks(q, k, cfg)
    return block_attention(q, k, v, selection, scale, backend=backend, deterministic=cfg.deterministic,
                           quant=cfg.quant)
