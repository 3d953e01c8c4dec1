"""The config of ``sla2``."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ...config import (BlockAliases, Config, FEATURE_MAPS, QuantConfig, check_block, check_bool, check_choice,
                       check_float, check_int)


@dataclass(frozen=True)
class SLA2Config(BlockAliases, Config):
    """SLA2: learnable router, alpha-mixing of the sparse and (masked) linear branches.

    ``smooth_k``: ``"router"`` (default) smooths the keys the router pools; ``"all"`` (paper Alg. 2) also gives both
    branches ``k - mean_N k`` rounded to the input dtype, which in bf16 costs accuracy at large logits
    (docs/methods.md, sla2 step 1)."""

    method: ClassVar[str] = "sla2"
    block_q: int = 128
    block_k: int = 64
    topk_ratio: float = 0.05
    feature_map: str = "softmax"
    eps: float = 1e-5
    alpha_per_head: bool = False
    alpha_init: float = 0.9
    smooth_k: str = "router"
    router: str = "hard"
    router_softmax: bool = True
    tau: float = 0.1
    softtopk_iters: int = 30
    softtopk_standardize: bool = False
    quant: QuantConfig | None = None
    deterministic: bool = False

    def __post_init__(self):
        check_block("block_q", self.block_q)
        check_block("block_k", self.block_k)
        check_float("topk_ratio", self.topk_ratio, 0.0, 1.0, low_open=True)
        check_choice("feature_map", self.feature_map, FEATURE_MAPS)
        check_float("eps", self.eps, 0.0, 1.0, low_open=True)
        check_bool("alpha_per_head", self.alpha_per_head)
        check_float("alpha_init", self.alpha_init, 0.0, 1.0, low_open=True)
        if self.alpha_init >= 1.0:
            raise ValueError(f"config key 'alpha_init' must be in (0, 1), got {self.alpha_init}")
        check_choice("smooth_k", self.smooth_k, ("all", "router"))
        check_choice("router", self.router, ("hard", "soft"))
        check_bool("router_softmax", self.router_softmax)
        check_float("tau", self.tau, 0.0, 1e6, low_open=True)
        check_int("softtopk_iters", self.softtopk_iters)
        check_bool("softtopk_standardize", self.softtopk_standardize)
        object.__setattr__(self, "quant", QuantConfig.from_value(self.quant))
        if self.quant is not None and self.router == "soft":
            raise ValueError("config key 'quant' needs router='hard': FP8 QAT applies to the block-sparse branch of "
                             "stage 2 and inference, not to the soft (stage-1 calibration) branch over every key")
        check_bool("deterministic", self.deterministic)
