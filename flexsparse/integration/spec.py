"""``PatchSpec``: what ``flexsparse.patch`` does, from one config dict (JSON-friendly) and/or keywords.

A patch config is a method config plus optional patch keys::

    {"method": "llsa", "block_size": 16, "topk": 8,
     "layers": ["blocks.*.attn"],                 # module-name globs; default: auto-detect
     "overrides": {"0": "full", "-1": "full",     # by index among the patched modules (negative from the end)
                   "blocks.5.*": {"topk": 16}},   # or by module-name glob
     "dense_warmup_steps": 4,                     # inference steps 0..3 run dense (see ``set_step``)
     "token_grid": [64, 64]}                      # raster tokens of a 64x64 grid: blocks in Z-order

An override value is ``"full"`` (dense), a dict without ``"method"`` (keys changed on the default
config) or a dict with ``"method"`` (a new config). Overrides apply in order; later ones win. A glob that matches
no patched module is logged (WARNING) and changes nothing, so one config serves models of any depth; an index out
of range is an error.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any, Mapping

from ..config import Config
from .sdpa import grid_order

logger = logging.getLogger(__name__)
PATCH_KEYS = ("layers", "overrides", "dense_warmup_steps", "token_grid")
_INDEX = re.compile(r"-?\d+")
_ALIASES = {"block_size": ("block_q", "block_k"), "block_q": ("block_size",), "block_k": ("block_size",)}


@dataclass(frozen=True)
class PatchSpec:
    """The default method config (a dict), module-name globs, ordered overrides, dense warm-up steps,
    the token grid (see ``SparseSDPA``)."""

    default: dict
    layers: tuple[str, ...] | None
    overrides: tuple[tuple[int | str, Any], ...]
    dense_warmup_steps: int
    token_grid: tuple[int, ...] | None

    @classmethod
    def from_config(cls, config: "Mapping[str, Any] | Config", **given) -> "PatchSpec":
        """Split ``config`` into its method part and patch keys; ``given`` keywords (``None`` = not
        given) may set patch keys that the dict does not."""
        if isinstance(config, Config):
            method, inline = config.to_dict(), {}
        elif isinstance(config, Mapping):
            method = {k: v for k, v in config.items() if k not in PATCH_KEYS}
            inline = {k: config[k] for k in PATCH_KEYS if k in config}
        else:
            raise TypeError(f"config must be a dict or a flexsparse.Config, got {type(config).__name__}")
        Config.from_dict(method)
        for key, value in given.items():
            if value is None:
                continue
            if key in inline:
                raise ValueError(f"{key!r} is given both in the config dict and as an argument; give it once")
            inline[key] = value
        warmup = inline.get("dense_warmup_steps", 0)
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
            raise ValueError(f"dense_warmup_steps must be an int >= 0, got {warmup!r}")
        grid = inline.get("token_grid")
        grid_order(grid)                                  # validates it
        return cls(dict(method), _layers(inline.get("layers")), _overrides(inline.get("overrides")), warmup,
                   None if grid is None else tuple(grid))

    def configs(self, names: list[str]) -> list[Config]:
        """The config of each of the modules ``names`` (in patch order) after the overrides."""
        chosen = [dict(self.default) for _ in names]
        for key, value in self.overrides:
            hits = _matches(key, names)
            if not hits:      # a glob: one config serves models of any depth (an index out of range raises)
                logger.warning("flexsparse.patch: overrides key %r matches none of the patched modules %s; it "
                               "changes nothing", key, names)
            for i in hits:
                chosen[i] = _apply(chosen[i], value)
        out = []
        for name, config in zip(names, chosen):
            try:
                out.append(Config.from_dict(config))
            except (TypeError, ValueError) as err:
                raise type(err)(f"config of module {name!r} after overrides: {err}") from err
        return out


def _layers(layers) -> tuple[str, ...] | None:
    if layers is None:
        return None
    if isinstance(layers, str):
        layers = [layers]
    if not isinstance(layers, (list, tuple)) or not layers or not all(isinstance(p, str) for p in layers):
        raise TypeError(f"layers must be a module-name glob or a non-empty list of them, got {layers!r}")
    return tuple(layers)


def _overrides(overrides) -> tuple[tuple[int | str, Any], ...]:
    if overrides is None:
        return ()
    if not isinstance(overrides, Mapping):
        raise TypeError(f"overrides must be a dict {{layer index or module-name glob: config}}, "
                        f"got {type(overrides).__name__}")
    for key, value in overrides.items():
        if isinstance(key, bool) or not isinstance(key, (int, str)):
            raise TypeError(f"overrides key {key!r} must be a layer index or a module-name glob")
        if value != "full" and not isinstance(value, Mapping):
            raise TypeError(f"overrides[{key!r}] must be 'full' or a config dict, got {value!r}")
    return tuple(overrides.items())


def _matches(key: int | str, names: list[str]) -> list[int]:
    """Indices of ``names`` that ``key`` (an index, negative from the end, or a glob) selects."""
    if isinstance(key, str) and _INDEX.fullmatch(key):
        key = int(key)
    if isinstance(key, int):
        if not -len(names) <= key < len(names):
            raise ValueError(f"overrides key {key} is out of range for {len(names)} patched modules {names}")
        return [key % len(names)]
    return [i for i, name in enumerate(names) if fnmatchcase(name, key)]


def _apply(config: dict, value) -> dict:
    if value == "full":
        return {"method": "full"}
    if "method" in value:
        return dict(value)
    base = {k: v for k, v in config.items() if not any(k in _ALIASES.get(changed, ()) for changed in value)}
    return {**base, **value}
