"""``llsa``: log-linear sparse attention.

select: pooling pyramid of Q and K (block b, L levels), dense raw-dot top-K at level L, then at each
finer level top-K among the children of the parent's selection (``flexsparse.masks.llsa_topk``).
attend: one softmax over the fine children of the level-1 selection, the whole candidate set at every
level 1..L-1, and all level-L tokens; a level-l token adds ``ln(count)`` (``ln b^l`` for full spans)
to its logit; with ``quant`` an FP8 fake-quantized forward (Q per block of b tokens, every level's K per
block of b tokens of that level, V per channel per level, P static) and straight-through backward.
combine: nothing, the output is that softmax's.
"""
from __future__ import annotations

from .._checks import check_topk_fits
from ..backends import sparse_primitives
from ..masks import auto_levels, llsa_topk, num_blocks, pool_pyramid
from ..quant import qat_attention, quantize_kv, quantizes_p
from ..reference import llsa_dense

BACKENDS = ("reference", "torch", "flex", "triton")
SELF_ATTENTION = True
STRIDED_INPUTS = True  # the triton kernels read q, k, v views in place, forward and backward (``api.attention``)


def init_params(cfg, head_dim: int, num_heads: int, seq_len: int | None):
    return {}


def plan(cfg, n: int) -> tuple[int, tuple[int, ...]]:
    """Levels L and ``(K_1, ..., K_L)`` for length ``n``, checked against the number of tokens."""
    b = cfg.block_size
    if cfg.levels != "auto":
        levels = cfg.levels
    else:  # a per-level topk list fixes L
        levels = len(cfg.topk) if isinstance(cfg.topk, tuple) else auto_levels(n, b, cfg.topk)
    topk = cfg.topk_per_level(levels)
    check_topk_fits(f"topk[{levels - 1}]" if isinstance(cfg.topk, tuple) else "topk", topk[-1],
                    num_blocks(n, b**levels), f"level-{levels} tokens at N={n} (block_size={b}, levels={levels})")
    for level in range(levels - 1):
        reachable = (topk[level + 1] - 1) * b + 1
        if topk[level] > reachable:
            raise ValueError(f"config key 'topk': K_{level + 1}={topk[level]} can exceed the candidates of a ragged "
                             f"parent set ((K_{level + 2} - 1) * block_size + 1 = {reachable}); lower it")
    return levels, topk


def forward(q, k, v, cfg, *, backend: str, scale: float, params=None, need_lse: bool = True):
    levels, topk = plan(cfg, q.shape[2])
    if backend == "triton":
        from ..backends import triton_sparse
        return triton_sparse.llsa(q, k, v, cfg.block_size, topk, scale, deterministic=cfg.deterministic)
    b = cfg.block_size
    k_levels = pool_pyramid(k, b, levels)
    selection = llsa_topk(q, k, topk, b, k_levels=k_levels)
    if backend == "reference":
        return llsa_dense(q, k, v, selection, scale, quant=cfg.quant)
    primitives, dtype = sparse_primitives(backend), q.dtype

    def attend(q, k, v, quant):
        if quant is None:
            return primitives.llsa_attention(q, [k, *k_levels], [v, *pool_pyramid(v, b, levels)], selection, scale)
        keys, values = [k, *pool_pyramid(k, b, levels)], [v, *pool_pyramid(v, b, levels)]
        keys, values = map(list, zip(*(quantize_kv(x, y, quant, b) for x, y in zip(keys, values))))
        if backend == "flex":               # flex computes in the input dtype: fake-quantized values rounded to it
            q = q.to(dtype)
        return primitives.llsa_attention(q, keys, values, selection, scale, quantize_p=quantizes_p(quant))

    return qat_attention(attend, q, k, v, cfg.quant, block_q=b, scale=scale)
