"""The config of ``topk``."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ...config import BlockAliases, Config, QuantConfig, check_block, check_bool, check_int


@dataclass(frozen=True)
class TopKConfig(BlockAliases, Config):
    """Single-level block top-K (MoBA/VMoBA style): ``topk`` key blocks per query block."""

    method: ClassVar[str] = "topk"
    block_q: int = 64
    block_k: int = 64
    topk: int = 8
    quant: QuantConfig | None = None
    deterministic: bool = False

    def __post_init__(self):
        check_block("block_q", self.block_q)
        check_block("block_k", self.block_k)
        check_int("topk", self.topk)
        object.__setattr__(self, "quant", QuantConfig.from_value(self.quant))
        check_bool("deterministic", self.deterministic)
