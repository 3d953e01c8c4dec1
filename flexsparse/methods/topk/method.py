"""``topk``: single-level block top-K (MoBA/VMoBA style).

select: mean-pool Q and K blocks, raw-dot scores, top-K key blocks per query block.
attend: softmax attention over the selected blocks (scale ``1/sqrt(D)``), FP8 fake-quantized with ``quant``.
"""
from __future__ import annotations

from ..base import Method
from ..blocks import select_blocks
from ..dense import block_sparse_dense
from .config import TopKConfig


class TopK(Method):
    name = "topk"
    config = TopKConfig
    example = {"method": "topk", "block_size": 64, "topk": 8}
    self_attention = False
    ring = "fetch_blocks"

    def select(self, q, k, v, cfg, backend, params):
        return select_blocks(q, k, v, cfg, backend)

    def attend(self, q, k, v, selection, cfg, backend, *, scale, params, need_lse):
        return backend.block_sparse_attention(q, k, v, selection, scale, deterministic=cfg.deterministic,
                                              quant=cfg.quant)

    def reference(self, q, k, v, selection, cfg, *, scale, params):
        return block_sparse_dense(q, k, v, selection, scale, quant=cfg.quant)
