"""The config of ``llsa``."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ...config import MAX_LEVELS, Config, QuantConfig, check_block, check_bool, check_int


@dataclass(frozen=True)
class LLSAConfig(Config):
    """Log-linear sparse attention: hierarchical top-K with enriched, reweighted coarse KV.

    ``topk`` is an int (same K at every level) or a list ``[K_1, ..., K_L]`` from the
    finest selection (K_1 fine blocks per query block) to the coarsest (K_L).
    ``levels`` is an int 1 <= L <= ``MAX_LEVELS`` = 32 or ``"auto"`` (see ``flexsparse.masks.auto_levels``); a
    list ``topk`` has at most 32 entries. ``block_size`` b is 2 to ``MAX_BLOCK`` = 2**31 - 1 (int32 index tables).
    Levels whose spans ``b^l`` reach past the sequence hold one (ragged) token, the mean of every token.
    """

    method: ClassVar[str] = "llsa"
    block_size: int = 16
    topk: int | tuple[int, ...] = 8
    levels: int | str = "auto"
    quant: QuantConfig | None = None
    deterministic: bool = False

    def __post_init__(self):
        check_block("block_size", self.block_size, minimum=2)
        if isinstance(self.topk, (list, tuple)):
            if not 0 < len(self.topk) <= MAX_LEVELS:
                raise ValueError(f"config key 'topk' must be an int or a list of 1 to {MAX_LEVELS} ints (one per "
                                 f"level), got {len(self.topk)} entries")
            for i, value in enumerate(self.topk):
                check_int(f"topk[{i}]", value)
            object.__setattr__(self, "topk", tuple(self.topk))
            if self.levels != "auto" and self.levels != len(self.topk):
                raise ValueError(
                    f"config key 'topk' lists {len(self.topk)} levels but 'levels'={self.levels!r}; "
                    "give one K per level, finest first")
        else:
            check_int("topk", self.topk)
        if self.levels != "auto":
            check_int("levels", self.levels, maximum=MAX_LEVELS)
        object.__setattr__(self, "quant", QuantConfig.from_value(self.quant))
        check_bool("deterministic", self.deterministic)

    def topk_per_level(self, levels: int) -> tuple[int, ...]:
        """``(K_1, ..., K_L)`` for ``levels`` levels."""
        if isinstance(self.topk, tuple):
            return self.topk
        return (self.topk,) * levels
