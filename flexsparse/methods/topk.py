"""``topk``: single-level block top-K (MoBA/VMoBA style).

select: mean-pool Q and K blocks, raw-dot scores, top-K key blocks per query block.
attend: softmax attention over the selected blocks (scale ``1/sqrt(D)``).
"""
from __future__ import annotations

from ..reference import topk_dense
from ._blocks import select_blocks, sparse_branch

BACKENDS = ("reference", "torch", "flex", "triton")
SELF_ATTENTION = False


def init_params(cfg, head_dim: int, num_heads: int, seq_len: int | None):
    return {}


def forward(q, k, v, cfg, *, backend: str, scale: float, params=None, need_lse: bool = True):
    if cfg.quant is not None:
        raise ValueError("config key 'quant' (FP8 quantization of the sparse branch) is not implemented yet "
                         "for method 'topk'")
    selection = select_blocks(q, k, cfg)
    if backend == "reference":
        return topk_dense(q, k, v, selection, scale)
    return sparse_branch(backend, q, k, v, selection, scale, cfg.deterministic)
