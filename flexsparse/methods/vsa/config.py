"""The config of ``vsa``."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ...config import BlockAliases, Config, check_block, check_bool, check_int


@dataclass(frozen=True)
class VSAConfig(BlockAliases, Config):
    """Coarse attention over pooled tiles plus fine top-K block-sparse attention, summed."""

    method: ClassVar[str] = "vsa"
    block_q: int = 64
    block_k: int = 64
    topk: int = 8
    gate: bool = False
    deterministic: bool = False

    def __post_init__(self):
        check_block("block_q", self.block_q)
        check_block("block_k", self.block_k)
        check_int("topk", self.topk)
        check_bool("gate", self.gate)
        check_bool("deterministic", self.deterministic)
