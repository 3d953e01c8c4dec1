"""Typed, validated configurations made from plain dicts.

A config is a plain dict such as ``{"method": "llsa", "block_size": 16, "topk": 8}``.
``Config.from_dict`` turns it into the frozen dataclass of its method, checking
every key and value; ``to_dict`` gives back a dict that round-trips.
Unknown methods or keys raise ``ValueError`` naming them, suggesting a close valid one and listing the valid ones.
"""
from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Mapping

FEATURE_MAPS = ("softmax", "elu", "relu")


def _did_you_mean(names, known) -> str:
    """`` (did you mean 'x' for 'y'?)`` for each of ``names`` close to one of ``known`` (lowercase), else ``""``."""
    hints = [f"{match[0]!r} for {name!r}" for name in names
             if (match := difflib.get_close_matches(str(name).lower(), list(known), n=1))]
    return f" (did you mean {', '.join(hints)}?)" if hints else ""


def _check_int(name: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"config key {name!r} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"config key {name!r} must be >= {minimum}, got {value}")
    return value


def _check_float(name: str, value: Any, low: float, high: float, *, low_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"config key {name!r} must be a number, got {type(value).__name__} {value!r}")
    value = float(value)
    ok_low = value > low if low_open else value >= low
    if not (ok_low and value <= high):
        bracket = "(" if low_open else "["
        raise ValueError(f"config key {name!r} must be in {bracket}{low}, {high}], got {value}")
    return value


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ValueError(f"config key {name!r} must be one of {list(choices)}, got {value!r}"
                         f"{_did_you_mean([value], choices)}")
    return value


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"config key {name!r} must be a bool, got {type(value).__name__} {value!r}")
    return value


@dataclass(frozen=True)
class QuantConfig:
    """FP8 e4m3 quantization of the sparse softmax branch's forward, straight-through backward
    (docs/methods.md "FP8 QAT"). ``dtype``: format of P and V; ``qk_dtype``: format of Q and K
    (``"fp8_e4m3"``, or ``"int8"`` as SageAttention2); ``qk``: Q and K scales per block of the method's
    query / key blocks or per (batch, head); ``v``: per channel or per (batch, head); ``p``: ``"static"``
    quantizes the softmax numerator with the static scale 448, ``"none"`` keeps P in the compute
    precision (the only choice FlexAttention can run)."""

    dtype: str = "fp8_e4m3"
    qk_dtype: str = "fp8_e4m3"
    qk: str = "per_block"
    v: str = "per_channel"
    p: str = "static"

    def __post_init__(self):
        _check_choice("quant.dtype", self.dtype, ("fp8_e4m3",))
        _check_choice("quant.qk_dtype", self.qk_dtype, ("fp8_e4m3", "int8"))
        _check_choice("quant.qk", self.qk, ("per_block", "per_tensor"))
        _check_choice("quant.v", self.v, ("per_channel", "per_tensor"))
        _check_choice("quant.p", self.p, ("static", "none"))

    @classmethod
    def from_value(cls, value: Any) -> "QuantConfig | None":
        if value is None or value is False:
            return None
        if isinstance(value, QuantConfig):
            return value
        if not isinstance(value, Mapping):
            raise TypeError(f"config key 'quant' must be a dict or None, got {type(value).__name__}")
        valid = list(cls.__dataclass_fields__)     # not dataclasses.fields(cls): torch.compile traces this
        unknown = sorted(set(value) - set(valid))
        if unknown:
            raise ValueError(f"unknown key(s) {unknown} in config 'quant'{_did_you_mean(unknown, valid)}; "
                             f"valid keys: {valid}")
        return cls(**dict(value))


@dataclass(frozen=True)
class Config:
    """Base of all method configs. Use ``Config.from_dict``."""

    method: ClassVar[str] = ""
    registry: ClassVar[dict[str, type["Config"]]] = {}
    ALIASES: ClassVar[tuple[str, ...]] = ()  # keys accepted besides the fields (``_BlockAliases``)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.method:
            Config.registry[cls.method] = cls

    @staticmethod
    def from_dict(config: "Mapping[str, Any] | Config") -> "Config":
        """Validate a config dict and return the method's typed config."""
        if isinstance(config, Config):
            return config
        if not isinstance(config, Mapping):
            raise TypeError(f"config must be a dict or a flexsparse.Config, got {type(config).__name__}")
        if "method" not in config:
            raise ValueError(f"config needs a 'method' key; valid methods: {sorted(Config.registry)}")
        method = config["method"]
        if method not in Config.registry:
            raise ValueError(f"unknown method {method!r}{_did_you_mean([method], Config.registry)}; "
                             f"valid methods: {sorted(Config.registry)}")
        cls = Config.registry[method]
        kwargs = {key: value for key, value in config.items() if key != "method"}
        kwargs = cls._normalise_aliases(kwargs)
        valid = cls._field_names()
        unknown = sorted(set(kwargs) - set(valid))
        if "quant" in unknown:
            quantized = sorted(name for name, c in Config.registry.items() if "quant" in c._field_names())
            raise ValueError(f"config key 'quant' (FP8 quantization of the sparse branch) is not supported by method "
                             f"{method!r}; methods with it: {quantized}")
        if unknown:
            keys = sorted(valid + list(cls.ALIASES))
            raise ValueError(f"unknown config key(s) {unknown} for method {method!r}{_did_you_mean(unknown, keys)}; "
                             f"valid keys: {keys}")
        return cls(**kwargs)

    @classmethod
    def _normalise_aliases(cls, kwargs: dict) -> dict:
        return kwargs

    @classmethod
    def _field_names(cls) -> list[str]:
        """Sorted config keys; read from ``__dataclass_fields__`` (ClassVars dropped) rather than
        ``dataclasses.fields(cls)``, which ``torch.compile`` cannot trace on a class."""
        return sorted(name for name, f in cls.__dataclass_fields__.items() if f._field_type is dataclasses._FIELD)

    def to_dict(self) -> dict:
        """Plain dict that ``Config.from_dict`` turns back into an equal config."""
        out: dict[str, Any] = {"method": self.method}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, QuantConfig):
                value = dataclasses.asdict(value)
            elif isinstance(value, tuple):
                value = list(value)
            out[f.name] = value
        return out

    def replace(self, **changes) -> "Config":
        """A copy with some keys changed (validated again)."""
        return Config.from_dict({**self.to_dict(), **changes})


class _BlockAliases:
    """``block_size`` is shorthand for equal ``block_q`` and ``block_k``."""

    ALIASES = ("block_size",)

    @classmethod
    def _normalise_aliases(cls, kwargs: dict) -> dict:
        if "block_size" in kwargs:
            size = kwargs.pop("block_size")
            for key in ("block_q", "block_k"):
                if key in kwargs and kwargs[key] != size:
                    raise ValueError(
                        f"config keys 'block_size'={size!r} and {key!r}={kwargs[key]!r} disagree; give one or the other")
                kwargs[key] = size
        return kwargs


@dataclass(frozen=True)
class FullConfig(Config):
    """Dense softmax attention."""

    method: ClassVar[str] = "full"


@dataclass(frozen=True)
class TopKConfig(_BlockAliases, Config):
    """Single-level block top-K (MoBA/VMoBA style): ``topk`` key blocks per query block."""

    method: ClassVar[str] = "topk"
    block_q: int = 64
    block_k: int = 64
    topk: int = 8
    quant: QuantConfig | None = None
    deterministic: bool = False

    def __post_init__(self):
        _check_int("block_q", self.block_q)
        _check_int("block_k", self.block_k)
        _check_int("topk", self.topk)
        object.__setattr__(self, "quant", QuantConfig.from_value(self.quant))
        _check_bool("deterministic", self.deterministic)


@dataclass(frozen=True)
class VSAConfig(_BlockAliases, Config):
    """Coarse attention over pooled tiles plus fine top-K block-sparse attention, summed."""

    method: ClassVar[str] = "vsa"
    block_q: int = 64
    block_k: int = 64
    topk: int = 8
    gate: bool = False
    deterministic: bool = False

    def __post_init__(self):
        _check_int("block_q", self.block_q)
        _check_int("block_k", self.block_k)
        _check_int("topk", self.topk)
        _check_bool("gate", self.gate)
        _check_bool("deterministic", self.deterministic)


@dataclass(frozen=True)
class LLSAConfig(Config):
    """Log-linear sparse attention: hierarchical top-K with enriched, reweighted coarse KV.

    ``topk`` is an int (same K at every level) or a list ``[K_1, ..., K_L]`` from the
    finest selection (K_1 fine blocks per query block) to the coarsest (K_L).
    ``levels`` is an int L >= 1 or ``"auto"`` (see ``flexsparse.masks.auto_levels``).
    """

    method: ClassVar[str] = "llsa"
    block_size: int = 16
    topk: int | tuple[int, ...] = 8
    levels: int | str = "auto"
    quant: QuantConfig | None = None
    deterministic: bool = False

    def __post_init__(self):
        _check_int("block_size", self.block_size, minimum=2)
        if isinstance(self.topk, (list, tuple)):
            if len(self.topk) == 0:
                raise ValueError("config key 'topk' must be an int or a non-empty list of ints")
            for i, value in enumerate(self.topk):
                _check_int(f"topk[{i}]", value)
            object.__setattr__(self, "topk", tuple(self.topk))
            if self.levels != "auto" and self.levels != len(self.topk):
                raise ValueError(
                    f"config key 'topk' lists {len(self.topk)} levels but 'levels'={self.levels!r}; "
                    "give one K per level, finest first")
        else:
            _check_int("topk", self.topk)
        if self.levels != "auto":
            _check_int("levels", self.levels)
        object.__setattr__(self, "quant", QuantConfig.from_value(self.quant))
        _check_bool("deterministic", self.deterministic)

    def topk_per_level(self, levels: int) -> tuple[int, ...]:
        """``(K_1, ..., K_L)`` for ``levels`` levels."""
        if isinstance(self.topk, tuple):
            return self.topk
        return (self.topk,) * levels


@dataclass(frozen=True)
class SLAConfig(_BlockAliases, Config):
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
        _check_int("block_q", self.block_q)
        _check_int("block_k", self.block_k)
        _check_float("topk_ratio", self.topk_ratio, 0.0, 1.0, low_open=True)
        _check_float("negligible_ratio", self.negligible_ratio, 0.0, 1.0)
        _check_choice("linear", self.linear, ("masked", "full"))
        _check_choice("feature_map", self.feature_map, FEATURE_MAPS)
        _check_float("eps", self.eps, 0.0, 1.0, low_open=True)
        if self.negligible_ratio > 0 and self.linear == "full":
            raise ValueError("config key 'negligible_ratio' needs linear='masked' (the full linear branch has no classes)")
        if self.topk_ratio + self.negligible_ratio > 1.0:
            raise ValueError(
                f"config keys 'topk_ratio' + 'negligible_ratio' must be <= 1, got {self.topk_ratio} + {self.negligible_ratio}")
        object.__setattr__(self, "quant", QuantConfig.from_value(self.quant))
        _check_bool("deterministic", self.deterministic)


@dataclass(frozen=True)
class SLA2Config(_BlockAliases, Config):
    """SLA2: learnable router, alpha-mixing of the sparse and (masked) linear branches."""

    method: ClassVar[str] = "sla2"
    block_q: int = 128
    block_k: int = 64
    topk_ratio: float = 0.05
    feature_map: str = "softmax"
    eps: float = 1e-5
    alpha_per_head: bool = False
    alpha_init: float = 0.9
    smooth_k: str = "all"
    router: str = "hard"
    router_softmax: bool = True
    tau: float = 0.1
    softtopk_iters: int = 30
    softtopk_standardize: bool = False
    quant: QuantConfig | None = None
    deterministic: bool = False

    def __post_init__(self):
        _check_int("block_q", self.block_q)
        _check_int("block_k", self.block_k)
        _check_float("topk_ratio", self.topk_ratio, 0.0, 1.0, low_open=True)
        _check_choice("feature_map", self.feature_map, FEATURE_MAPS)
        _check_float("eps", self.eps, 0.0, 1.0, low_open=True)
        _check_bool("alpha_per_head", self.alpha_per_head)
        _check_float("alpha_init", self.alpha_init, 0.0, 1.0, low_open=True)
        if self.alpha_init >= 1.0:
            raise ValueError(f"config key 'alpha_init' must be in (0, 1), got {self.alpha_init}")
        _check_choice("smooth_k", self.smooth_k, ("all", "router"))
        _check_choice("router", self.router, ("hard", "soft"))
        _check_bool("router_softmax", self.router_softmax)
        _check_float("tau", self.tau, 0.0, 1e6, low_open=True)
        _check_int("softtopk_iters", self.softtopk_iters)
        _check_bool("softtopk_standardize", self.softtopk_standardize)
        object.__setattr__(self, "quant", QuantConfig.from_value(self.quant))
        if self.quant is not None and self.router == "soft":
            raise ValueError("config key 'quant' needs router='hard': FP8 QAT applies to the block-sparse branch of "
                             "stage 2 and inference, not to the soft (stage-1 calibration) branch over every key")
        _check_bool("deterministic", self.deterministic)


METHODS = tuple(sorted(Config.registry))
