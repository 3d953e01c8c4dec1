"""Sizes of an LLSA problem on the host: the level table and the packed layouts of pyramids and selections.

The level table ``meta`` is an int32 tensor ``(L + 1, 6)``, one row per level l = 0..L:

* ``T``       tokens at level l (``ceil(N / b^l)``),
* ``KV_OFF``  first row of level l in a concatenated pyramid ``(B, H, T_1 + ... + T_L, D)`` (0 for l = 0),
* ``TOPK``    ``K_{l+1}`` (0 for l = L),
* ``SEL_OFF`` first entry of ``S_{l+1}`` in a packed selection ``(B, H, sum_l T_l * K_l)`` (row-major
  ``(T_{l+1}, K_{l+1})`` blocks, finest first),
* ``CSC_OFF`` first entry of the key offsets of ``S_{l+1}``'s CSC in ``(B, H, sum_l (T_l + 1))``,
* ``SPAN``    ``b^l``, fine tokens under one level-l token; N where that reaches past the sequence
  (``level_span``: the level's one token covers all N), so every entry fits int32 whatever the levels.

The kernels multiply a span by b (the queries under one token of the level above) in int32: a table whose
``SPAN * b`` below the top level reaches ``2**31`` is refused (``ValueError``).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from .constants import kept_constant
from .geometry import level_span, num_blocks
from .selection import LLSASelection

T, KV_OFF, TOPK, SEL_OFF, CSC_OFF, SPAN = range(6)
INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class Levels:
    """Sizes of an LLSA problem; ``rows`` is the level table (see module docstring)."""

    n: int
    block: int
    topk: tuple[int, ...]
    rows: tuple[tuple[int, ...], ...]
    pyramid_tokens: int
    selection_size: int
    csc_size: int

    @property
    def levels(self) -> int:
        return len(self.topk)

    def tokens(self, level: int) -> int:
        return self.rows[level][T]

    def meta(self, like: torch.Tensor) -> torch.Tensor:
        """The level table as an int32 tensor on ``like``'s device (cached, see ``constant``)."""
        return self.constant("meta", like, lambda device: torch.tensor(self.rows, dtype=torch.int32, device=device))

    @property
    def coarse_keys(self) -> int:
        """Keys per ancestor in ``coarse_rows``: ``b * (K_2 + ... + K_L)``."""
        return self.block * sum(self.topk[1:])

    def log2_counts(self, like: torch.Tensor) -> torch.Tensor:
        """``log2`` of the fine tokens under each pyramid row ``(T_1 + ... + T_L,)`` fp32 (``b^l`` but on a
        ragged tail), on ``like``'s device (cached, see ``constant``)."""
        return self.constant("log2_counts", like, self._log2_counts)

    def _log2_counts(self, device) -> torch.Tensor:
        parts = []  # constants only (inductor failed on the arange arithmetic inside a compiled CUDA graph)
        for level in range(1, self.levels + 1):
            span, tokens = self.rows[level][SPAN], self.tokens(level)
            parts += [torch.full((tokens - 1,), math.log2(span), device=device),
                      torch.full((1,), math.log2(self.n - (tokens - 1) * span), device=device)]
        return torch.cat(parts)

    def constant(self, name: str, like: torch.Tensor, build) -> torch.Tensor:
        """``build(device)`` for ``like``'s device, kept per table and device (``constants.kept_constant``)."""
        return kept_constant((name, self.rows), like, build)

    def split_pyramid(self, pyramid: torch.Tensor) -> list[torch.Tensor]:
        """``(B, H, T_1 + ... + T_L, D)`` -> levels 1..L, ``(B, H, T_l, D)`` each (views)."""
        return list(pyramid.split([self.tokens(level) for level in range(1, self.levels + 1)], dim=2))

    def unpack(self, sel: torch.Tensor) -> LLSASelection:
        """Packed ``(B, H, S)`` -> ``LLSASelection`` (views)."""
        bsz, heads, _ = sel.shape
        parts = []
        for level in range(self.levels):
            rows, k, off = self.tokens(level + 1), self.topk[level], self.rows[level][SEL_OFF]
            parts.append(sel[:, :, off:off + rows * k].unflatten(2, (rows, k)))
        return LLSASelection(indices=tuple(parts), block=self.block, n=self.n)


def pack(selection: LLSASelection) -> torch.Tensor:
    """``LLSASelection`` -> packed ``(B, H, sum_l T_l * K_l)`` int32."""
    return torch.cat([s.flatten(2) for s in selection.indices], dim=2).to(torch.int32).contiguous()


def level_table(n: int, block: int, topk) -> Levels:
    """The level table of length ``n``, block ``b`` and ``topk = (K_1, ..., K_L)`` (cached: every op of a call
    asks for it). Raises ``ValueError`` where a selection row could not be filled (``K_L`` over the top level's
    tokens, or ``K_l`` over the fewest candidates a parent set can have, ``fewest_candidates``): the kernels would
    read unwritten selection slots; and where the kernels' int32 arithmetic would overflow (module docstring).
    In a compiled region dynamo traces the table's code (its arguments are constants there), not the cache, which it
    cannot honour and warns about."""
    args = int(n), int(block), tuple(int(k) for k in topk)
    if torch.compiler.is_compiling():
        return _level_table.__wrapped__(*args)
    return _level_table(*args)


def fewest_candidates(n: int, block: int, level: int, parents: int) -> int:
    """The fewest level-``level`` tokens (spans ``level_span(n, block, level)`` of ``n`` tokens) under any ``parents``
    tokens of the next level: ``parents * block``, less what the ragged last parent lacks when it can be among them."""
    children = num_blocks(n, level_span(n, block, level))
    last = children - (num_blocks(children, block) - 1) * block     # children of the last parent, 1..block
    return min(children, (parents - 1) * block + last)


@functools.lru_cache(maxsize=256)
def _level_table(n: int, block: int, topk: tuple[int, ...]) -> Levels:
    levels = len(topk)
    top_tokens = num_blocks(n, level_span(n, block, levels))
    if topk[-1] > top_tokens:
        raise ValueError(f"LLSA topk: K_{levels}={topk[-1]} exceeds the {top_tokens} level-{levels} tokens at N={n} "
                         f"(block {block})")
    for level in range(levels - 1):
        fewest = fewest_candidates(n, block, level + 1, topk[level + 1])
        if topk[level] > fewest:
            raise ValueError(f"LLSA topk: K_{level + 1}={topk[level]} exceeds the candidates under "
                             f"{topk[level + 1]} level-{level + 2} tokens (as few as {fewest} at N={n}, block {block})")
    rows, kv_off, sel_off, csc_off = [], 0, 0, 0
    for level in range(levels + 1):
        span = level_span(n, block, level)
        if level < levels and span * block > INT32_MAX:
            raise ValueError(f"LLSA block_size={block} at N={n}: the {span} fine tokens under a level-{level} token "
                             f"times block_size reach past int32 ({INT32_MAX}), which the kernels index with; "
                             f"lower block_size or levels")
        tokens = num_blocks(n, span)
        k = topk[level] if level < levels else 0
        rows.append((tokens, kv_off if level else 0, k, sel_off, csc_off, span))
        if level:
            kv_off += tokens
        if level < levels:
            parents = num_blocks(n, level_span(n, block, level + 1))
            sel_off += parents * k
            csc_off += parents + 1
    return Levels(n, block, topk, tuple(rows), kv_off, sel_off, csc_off)
