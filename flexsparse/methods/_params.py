"""Checks of the ``params=`` dict that methods with learnable parts (``sla``, ``sla2``) receive."""
from __future__ import annotations

from typing import Mapping

import torch


def require_params(method: str, params: Mapping[str, torch.Tensor] | None,
                   shapes: Mapping[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """``params`` restricted to ``shapes``' names, after checking names and shapes (clear errors)."""
    names = list(shapes)
    if not params:
        raise ValueError(
            f"method {method!r} has learnable parameters {names}; use flexsparse.SparseAttention(config, "
            f"head_dim=..., num_heads=...) or pass params=flexsparse.methods.{method}.init_params(...)")
    missing = [name for name in names if name not in params]
    unknown = sorted(set(params) - set(names))
    if missing or unknown:
        raise ValueError(f"params for method {method!r} must have exactly the keys {names}; "
                         f"missing {missing}, unknown {unknown}")
    for name, shape in shapes.items():
        value = params[name]
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"params[{name!r}] must be a torch.Tensor, got {type(value).__name__}")
        if tuple(value.shape) != tuple(shape):
            raise ValueError(f"params[{name!r}] must have shape {tuple(shape)}, got {tuple(value.shape)}")
    return {name: params[name] for name in names}
