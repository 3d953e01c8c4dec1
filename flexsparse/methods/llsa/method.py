"""``llsa``: log-linear sparse attention.

select: pooling pyramid of Q and K (block b, L levels), dense raw-dot top-K at level L, then at each
finer level top-K among the children of the parent's selection.
attend: one softmax over the fine children of the level-1 selection, the whole candidate set at every
level 1..L-1, and all level-L tokens; a level-l token adds ``ln(count)`` (``ln b^l`` for full spans)
to its logit; with ``quant`` an FP8 fake-quantized forward (Q per block of b tokens, every level's K per
block of b tokens of that level, V per channel per level, P static) and QAT backward.
combine: nothing, the output is that softmax's.
"""
from __future__ import annotations

from ..._checks import clamp_topk
from ...masks import auto_levels, level_span, num_blocks
from ...masks.levels import fewest_candidates
from ..base import Method
from . import reference
from .config import LLSAConfig


class LLSA(Method):
    name = "llsa"
    config = LLSAConfig
    example = {"method": "llsa", "block_size": 16, "topk": 8}
    keeps_views = True      # the triton kernels read q, k, v views in place, forward and backward
    sparse_branch = "llsa"
    ring = "fetch_levels"

    def plan(self, cfg, n: int) -> tuple[int, tuple[int, ...]]:
        """Levels L and ``(K_1, ..., K_L)`` at length ``n`` (``plan``)."""
        return plan(cfg, n)

    def select(self, q, k, v, cfg, backend, params):
        _, topk = plan(cfg, q.shape[2])
        return backend.llsa_select(q, k, v, cfg.block_size, topk)

    def attend(self, q, k, v, selection, cfg, backend, *, scale, params, need_lse):
        return backend.llsa_attention(q, k, v, selection, scale, deterministic=cfg.deterministic, quant=cfg.quant)

    def reference(self, q, k, v, selection, cfg, *, scale, params):
        return reference.llsa_dense(q, k, v, selection.selection, scale, quant=cfg.quant)


def plan(cfg, n: int) -> tuple[int, tuple[int, ...]]:
    """Levels L and ``(K_1, ..., K_L)`` for length ``n``, each clamped to the tokens it selects among
    (``clamp_topk``): ``K_L`` to the level-L tokens, then ``K_l`` to the fewest candidates under ``K_{l+1}``."""
    b = cfg.block_size
    if cfg.levels != "auto":
        levels = cfg.levels
    else:  # a per-level topk list fixes L
        levels = len(cfg.topk) if isinstance(cfg.topk, tuple) else auto_levels(n, b, cfg.topk)
    topk = list(cfg.topk_per_level(levels))
    key = (lambda level: f"topk[{level}]") if isinstance(cfg.topk, tuple) else (lambda level: "topk")
    topk[-1] = clamp_topk(key(levels - 1), topk[-1], num_blocks(n, level_span(n, b, levels)),
                          f"level-{levels} tokens at N={n} (block_size={b}, levels={levels})")
    for level in range(levels - 2, -1, -1):     # top down: K_l against the candidates under the clamped K_{l+1}
        topk[level] = clamp_topk(key(level), topk[level], fewest_candidates(n, b, level + 1, topk[level + 1]),
                                 f"level-{level + 1} candidates under {topk[level + 1]} level-{level + 2} tokens at "
                                 f"N={n} (block_size={b}; fewest when the ragged last one is among them)")
    return levels, tuple(topk)

