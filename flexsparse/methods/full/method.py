"""``full``: dense softmax attention (the baseline every sparse method is compared with).

select: nothing. attend: dense attention (SDPA), the LSE by a row-chunked pass only when asked for.
"""
from __future__ import annotations

from ..base import Method
from . import reference
from .config import FullConfig


class Full(Method):
    name = "full"
    config = FullConfig
    example = {"method": "full"}
    backends = ("reference", "torch")
    self_attention = False
    sparse_branch = None
    ring = "rotate"

    def select(self, q, k, v, cfg, backend, params):
        return None

    def attend(self, q, k, v, selection, cfg, backend, *, scale, params, need_lse):
        return backend.dense_attention(q, k, v, scale, need_lse)

    def reference(self, q, k, v, selection, cfg, *, scale, params):
        return reference.full_dense(q, k, v, scale)
