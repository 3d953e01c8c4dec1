"""Typed, validated configurations made from plain dicts.

A config is a plain dict such as ``{"method": "llsa", "block_size": 16, "topk": 8}``.
``Config.from_dict`` turns it into the frozen dataclass of its method (each method folder defines its own, and
``flexsparse.methods`` registers it), checking every key and value; ``to_dict`` gives back a dict that round-trips.
Unknown methods or keys raise ``ValueError`` naming them, suggesting a close valid one and listing the valid ones.
Sizes have upper bounds that do not depend on the input: block sizes at most ``MAX_BLOCK`` (int32 index tables),
LLSA's ``levels`` at most ``MAX_LEVELS``. A block longer than the sequence is legal and runs as one block covering
it (``flexsparse.masks.fit_block``), so memory follows the input, not the config.
"""
from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Mapping

import torch

FEATURE_MAPS = ("softmax", "elu", "relu")
MAX_BLOCK = 2**31 - 1   # block sizes: the index tables and the kernels' token rows are int32
MAX_LEVELS = 32         # LLSA levels: with blocks of >= 2 tokens level 32 spans 2**32 tokens, past any int32 length


# the public SLA / SLA2 code's argument names (``SparseLinearAttention(topk=0.2, BLKQ=64, BLKK=64)``) -> flexsparse's
FOREIGN_NAMES = {"topk": "topk_ratio", "blkq": "block_q", "blkk": "block_k"}


def did_you_mean(names, known) -> str:
    """`` (did you mean 'x' for 'y'?)`` for each of ``names`` that is another code's name of one of ``known``
    (``FOREIGN_NAMES``) or close to one of them (lowercase), else ``""``."""
    hints = []
    for name in names:
        foreign = FOREIGN_NAMES.get(str(name).lower())
        match = [foreign] if foreign in known else difflib.get_close_matches(str(name).lower(), list(known), n=1)
        if match:
            hints.append(f"{match[0]!r} for {name!r}")
    return f" (did you mean {', '.join(hints)}?)" if hints else ""


def check_int(name: str, value: Any, minimum: int = 1, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"config key {name!r} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"config key {name!r} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"config key {name!r} must be <= {maximum}, got {value}")
    return value


def check_block(name: str, value: Any, minimum: int = 1) -> int:
    """A block size: an int in ``[minimum, MAX_BLOCK]``."""
    return check_int(name, value, minimum, MAX_BLOCK)


def check_float(name: str, value: Any, low: float, high: float, *, low_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"config key {name!r} must be a number, got {type(value).__name__} {value!r}")
    value = float(value)
    ok_low = value > low if low_open else value >= low
    if not (ok_low and value <= high):
        bracket = "(" if low_open else "["
        raise ValueError(f"config key {name!r} must be in {bracket}{low}, {high}], got {value}")
    return value


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ValueError(f"config key {name!r} must be one of {list(choices)}, got {value!r}"
                         f"{did_you_mean([value], choices)}")
    return value


def check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"config key {name!r} must be a bool, got {type(value).__name__} {value!r}")
    return value


@dataclass(frozen=True)
class Joint:
    """A joint text+visual sequence (SD3-, Flux-, HunyuanVideo-style blocks; a ViT's class token is a 1-token
    prefix): ``length`` text tokens at the start (``text="prefix"``) or the end (``"suffix"``) of the sequence. Text
    queries attend every token densely; visual queries attend every text token densely and the visual tokens by the
    method, in one softmax (the method's softmax branch and the text keys merge by LSE); selection and pooling see
    the visual tokens only. A call argument, not a config key: the text length belongs to the call (the prompt), and
    a config (and the checkpoints that carry it) stays independent of it.

    ``mask``: an optional ``(B, length)`` bool tensor, False for padding text tokens (a batch of prompts of
    different lengths, HunyuanVideo's): no query attends them, as under SDPA with that key padding mask (their own
    queries still attend every other key). Left out of equality and ``repr``."""

    text: str
    length: int
    mask: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        check_choice("joint.text", self.text, ("prefix", "suffix"))
        check_int("joint.length", self.length, minimum=0)
        if self.mask is not None and not (isinstance(self.mask, torch.Tensor) and self.mask.dtype == torch.bool
                                          and self.mask.dim() == 2 and self.mask.shape[1] == self.length):
            got = (f"a {self.mask.dtype} tensor of shape {tuple(self.mask.shape)}"
                   if isinstance(self.mask, torch.Tensor) else type(self.mask).__name__)
            raise ValueError(f"joint.mask must be a bool tensor of shape (batch, {self.length}) (True: a text token "
                             f"to attend, False: padding), got {got}")

    @classmethod
    def from_value(cls, value: Any) -> "Joint | None":
        """``None``, a ``Joint`` or a dict ``{"text": "prefix" | "suffix", "length": n}`` (and optionally
        ``"mask"``), checked; ``None`` for no text tokens (a plain call)."""
        if value is None:
            return None
        if not isinstance(value, (Joint, Mapping)):
            raise TypeError(f"joint must be a flexsparse.Joint, a dict {{'text': 'prefix' | 'suffix', 'length': n}} "
                            f"or None, got {type(value).__name__}")
        if isinstance(value, Mapping):
            if not {"text", "length"} <= set(value) <= {"text", "length", "mask"}:
                raise ValueError(f"joint takes the keys 'text', 'length' and optionally 'mask', got {sorted(value)}")
            value = cls(**value)
        return value if value.length else None

    def join(self, text: torch.Tensor, visual: torch.Tensor, dim: int) -> torch.Tensor:
        """The text and the visual parts of something along the sequence concatenated on ``dim`` in its order."""
        return torch.cat([text, visual] if self.text == "prefix" else [visual, text], dim=dim)

    def to(self, device) -> "Joint":
        """This joint with its ``mask`` (if any) on ``device``."""
        return self if self.mask is None else dataclasses.replace(self, mask=self.mask.to(device))

    def slices(self, n: int) -> tuple[slice, slice]:
        """``(text, visual)`` token slices of a sequence of ``n`` tokens; raises where no visual token is left."""
        if self.length >= n:
            raise ValueError(f"joint.length={self.length} text tokens leave no visual token in a sequence of {n}")
        if self.text == "prefix":
            return slice(0, self.length), slice(self.length, n)
        return slice(n - self.length, n), slice(0, n - self.length)


@dataclass(frozen=True)
class QuantConfig:
    """FP8 e4m3 quantization of the sparse softmax branch's forward, whose backward is the softmax backward at the
    quantized output (docs/methods.md "FP8 QAT"). ``dtype``: format of P and V; ``qk_dtype``: format of Q and K
    (``"fp8_e4m3"``, or ``"int8"`` as SageAttention2); ``qk``: Q and K scales per block of the method's
    query / key blocks or per (batch, head); ``v``: per channel or per (batch, head); ``p``: ``"static"``
    quantizes the softmax numerator with the static scale 448, ``"none"`` keeps P in the compute
    precision (the only choice FlexAttention can run); ``smooth_keys``: K minus its mean over the sequence before
    its scales (SageAttention), or K as it comes (False: the triton backend then quantizes Q and K in the
    selection's pooling pass, with no pass of their own)."""

    dtype: str = "fp8_e4m3"
    qk_dtype: str = "fp8_e4m3"
    qk: str = "per_block"
    v: str = "per_channel"
    p: str = "static"
    smooth_keys: bool = True

    def __post_init__(self):
        check_choice("quant.dtype", self.dtype, ("fp8_e4m3",))
        check_choice("quant.qk_dtype", self.qk_dtype, ("fp8_e4m3", "int8"))
        check_choice("quant.qk", self.qk, ("per_block", "per_tensor"))
        check_choice("quant.v", self.v, ("per_channel", "per_tensor"))
        check_choice("quant.p", self.p, ("static", "none"))
        check_bool("quant.smooth_keys", self.smooth_keys)

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
            raise ValueError(f"unknown key(s) {unknown} in config 'quant'{did_you_mean(unknown, valid)}; "
                             f"valid keys: {valid}")
        return cls(**dict(value))


@dataclass(frozen=True)
class Config:
    """Base of all method configs. Use ``Config.from_dict``."""

    method: ClassVar[str] = ""
    registry: ClassVar[dict[str, type["Config"]]] = {}   # filled by ``flexsparse.methods`` (one entry per method)
    ALIASES: ClassVar[tuple[str, ...]] = ()  # keys accepted besides the fields (``BlockAliases``)

    @staticmethod
    def from_dict(config: "Mapping[str, Any] | Config") -> "Config":
        """Validate a config dict and return the method's typed config."""
        if isinstance(config, Config):
            if Config.registry.get(config.method) is not type(config):
                raise TypeError(f"config must be a method's config (e.g. Config.from_dict({{'method': 'llsa'}})), "
                                f"got a {type(config).__name__} of no registered method")
            return config
        if not isinstance(config, Mapping):
            raise TypeError(f"config must be a dict or a flexsparse.Config, got {type(config).__name__}")
        if "method" not in config:
            raise ValueError(f"config needs a 'method' key; valid methods: {sorted(Config.registry)}")
        method = config["method"]
        if method not in Config.registry:
            raise ValueError(f"unknown method {method!r}{did_you_mean([method], Config.registry)}; "
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
            raise ValueError(f"unknown config key(s) {unknown} for method {method!r}{did_you_mean(unknown, keys)}; "
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


class BlockAliases:
    """``block_size`` is shorthand for equal ``block_q`` and ``block_k``. Blocks hold 1 to ``MAX_BLOCK`` = 2**31 - 1
    tokens (int32 index tables); one longer than the sequence covers it whole."""

    ALIASES = ("block_size",)

    @classmethod
    def _normalise_aliases(cls, kwargs: dict) -> dict:
        if "block_size" in kwargs:
            size = check_block("block_size", kwargs.pop("block_size"))
            for key in ("block_q", "block_k"):
                if key in kwargs and kwargs[key] != size:
                    raise ValueError(
                        f"config keys 'block_size'={size!r} and {key!r}={kwargs[key]!r} disagree; "
                        "give one or the other")
                kwargs[key] = size
        return kwargs
