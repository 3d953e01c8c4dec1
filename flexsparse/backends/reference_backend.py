"""The ``reference`` backend: each method's dense O(N^2) spec (its ``reference``) on the selection the PyTorch
steps make. For tests and small checks, never for speed."""
from __future__ import annotations

from .base import Backend


class ReferenceBackend(Backend):
    """Selection in PyTorch, then the method's dense reference instead of its sparse steps."""

    name = "reference"

    def attend(self, method, q, k, v, selection, cfg, *, scale: float, params, need_lse: bool):
        return method.reference(q, k, v, selection, cfg, scale=scale, params=params)
