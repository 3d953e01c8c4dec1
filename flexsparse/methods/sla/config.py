"""The config of ``sla``."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ...config import (BlockAliases, Config, FEATURE_MAPS, QuantConfig, check_block, check_bool, check_choice,
                       check_float)


@dataclass(frozen=True)
class SLAConfig(BlockAliases, Config):
    """Sparse-linear attention: softmax on the top blocks plus linear attention (learned projection)."""

    method: ClassVar[str] = "sla"
    block_q: int = 64
    block_k: int = 64
    topk_ratio: float = 0.05
    negligible_ratio: float = 0.0
    linear: str = "masked"
    feature_map: str = "softmax"
    eps: float = 1e-5
    quant: QuantConfig | None = None
    deterministic: bool = False

    def __post_init__(self):
        check_block("block_q", self.block_q)
        check_block("block_k", self.block_k)
        check_float("topk_ratio", self.topk_ratio, 0.0, 1.0, low_open=True)
        check_float("negligible_ratio", self.negligible_ratio, 0.0, 1.0)
        check_choice("linear", self.linear, ("masked", "full"))
        check_choice("feature_map", self.feature_map, FEATURE_MAPS)
        check_float("eps", self.eps, 0.0, 1.0, low_open=True)
        if self.negligible_ratio > 0 and self.linear == "full":
            raise ValueError(
                "config key 'negligible_ratio' needs linear='masked' (the full linear branch has no classes)")
        if self.topk_ratio + self.negligible_ratio > 1.0:
            raise ValueError(
                f"config keys 'topk_ratio' + 'negligible_ratio' must be <= 1, "
                f"got {self.topk_ratio} + {self.negligible_ratio}")
        object.__setattr__(self, "quant", QuantConfig.from_value(self.quant))
        check_bool("deterministic", self.deterministic)
