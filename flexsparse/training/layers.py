"""Choosing the ``SparseAttention`` modules of a model that the SLA2 training helpers work on, and
changing their config in place (``router``, ``topk_ratio``)."""
from __future__ import annotations

import dataclasses
from fnmatch import fnmatchcase
from typing import Callable, Sequence, Union

from torch import nn

from ..integration.sdpa import SparseSDPA
from ..module import SparseAttention

LayerSpec = Union[None, str, Sequence[str], Callable[[str, SparseAttention], bool]]


def select_layers(model: nn.Module, layers: LayerSpec = None) -> dict[str, SparseAttention]:
    """``{name: module}`` of the ``SparseAttention`` modules of ``model`` chosen by ``layers``, in
    ``named_modules`` order.

    layers: None (every one with method ``sla2``); a module-name glob or a list of them, matched
    against the module's name or the name of any module containing it (so ``"blocks.*.attn"`` picks
    ``blocks.3.attn.attention`` and a patched ``blocks.3.attn.flexsparse.attention``); or a predicate
    ``(name, module) -> bool``. A glob that matches none of them is an error.
    """
    found = [(name, m) for name, m in model.named_modules() if isinstance(m, SparseAttention)]
    if not found:
        raise ValueError("model has no flexsparse.SparseAttention module (build it with one, or call "
                         "flexsparse.patch(model, config) first)")
    if layers is None:
        chosen = [(n, m) for n, m in found if m.config.method == "sla2"]
        if not chosen:
            raise ValueError(f"model has no SparseAttention with method 'sla2' (found {_describe(found)})")
        return dict(chosen)
    if callable(layers):
        return {n: m for n, m in found if layers(n, m)}
    patterns = [layers] if isinstance(layers, str) else list(layers)
    if not patterns or not all(isinstance(p, str) for p in patterns):
        raise TypeError(f"layers must be None, a glob, a list of globs or a predicate, got {layers!r}")
    for pattern in patterns:
        if not any(_matches(n, pattern) for n, _ in found):
            raise ValueError(f"layers pattern {pattern!r} matches no SparseAttention module; "
                             f"they are {_describe(found)}")
    return {n: m for n, m in found if any(_matches(n, p) for p in patterns)}


def require_sla2(layers: dict[str, SparseAttention]) -> None:
    """Raise if ``layers`` is empty or holds a module whose method is not ``sla2``."""
    if not layers:
        raise ValueError("no SparseAttention layer selected")
    other = {n: m.config.method for n, m in layers.items() if m.config.method != "sla2"}
    if other:
        raise ValueError(f"SLA2 training needs method 'sla2', but these layers use another one: {other}")


def set_config(model: nn.Module, name: str, **changes) -> None:
    """Replace keys of the config of the ``SparseAttention`` named ``name`` (e.g. ``router="hard"``),
    and of the ``SparseSDPA`` holding it, if any, so that both report the config that runs."""
    module = model.get_submodule(name)
    if not isinstance(module, SparseAttention):
        raise TypeError(f"{name!r} is a {type(module).__name__}, not a flexsparse.SparseAttention")
    module.config = dataclasses.replace(module.config, **changes)
    parent_name = name.rpartition(".")[0]
    parent = model.get_submodule(parent_name) if "." in name else model
    if isinstance(parent, SparseSDPA) and parent.attention is module:
        parent.config = module.config


def _matches(name: str, pattern: str) -> bool:
    parts = name.split(".")
    return any(fnmatchcase(".".join(parts[:i]), pattern) for i in range(1, len(parts) + 1))


def _describe(found) -> str:
    shown = [f"{n} ({m.config.method})" for n, m in found[:8]]
    return ", ".join(shown) + (f", ... ({len(found)} in all)" if len(found) > 8 else "")
