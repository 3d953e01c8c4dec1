"""``SparseAttention``: an ``nn.Module`` that holds a method's learnable parts."""
from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from ._checks import check_positive_int
from .api import attention, head_params
from .config import Config
from .methods import METHODS
from .parallel import ParallelConfig


class SparseAttention(nn.Module):
    """Sparse attention with the method's learnable parameters (SLA projection, SLA2 router and
    alpha, VSA gate) registered as module parameters, so they train and live in ``state_dict``.

    ``forward(q, k, v)`` takes ``(B, H, N, D)`` tensors like ``F.scaled_dot_product_attention``.
    ``seq_len`` is needed only by methods whose parameters depend on it (SLA2's per-block alpha); it is the whole
    sequence's length under sequence parallelism. ``parallel``: a ``flexsparse.ParallelConfig`` when q, k, v are
    this rank's shards of the sequence (``flexsparse.attention``).
    """

    def __init__(self, config: "Mapping[str, Any] | Config", *, head_dim: int, num_heads: int,
                 seq_len: int | None = None, backend: str = "auto", parallel: ParallelConfig | None = None):
        super().__init__()
        self.config = Config.from_dict(config)
        check_positive_int("head_dim", head_dim)
        check_positive_int("num_heads", num_heads)
        method = METHODS[self.config.method]
        if backend not in (*method.backends, "auto"):
            raise ValueError(f"backend {backend!r} is not available for method {method.name!r}; "
                             f"available: {list(method.backends) + ['auto']}")
        self.parallel = ParallelConfig.check(parallel)
        self.head_dim, self.num_heads, self.seq_len, self.backend = head_dim, num_heads, seq_len, backend
        initial = method.init_params(self.config, head_dim, num_heads, seq_len)
        self.params = nn.ParameterDict({name: nn.Parameter(value) for name, value in initial.items()})

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None,
                return_lse: bool = False):
        if q.shape[-1] != self.head_dim:
            raise ValueError(f"q has head dim {q.shape[-1]} but this SparseAttention was built with "
                             f"head_dim={self.head_dim}")
        if q.shape[1] != self.num_heads:
            raise ValueError(f"q has {q.shape[1]} heads but this SparseAttention was built with "
                             f"num_heads={self.num_heads}")
        return attention(q, k, v, self.config, backend=self.backend, scale=scale, return_lse=return_lse,
                         params=dict(self.params.items()), parallel=self.parallel)

    def forward_heads(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: slice, *,
                      scale: float | None = None) -> torch.Tensor:
        """Attention of the query heads ``heads`` (a slice of ``range(num_heads)``) over the whole sequence in this
        process, with those heads' rows of the per-head parameters: the call a sequence-parallel caller makes on
        each rank (``flexsparse.parallel.ulysses_attention``). q ``(B, len(heads), N, D)``."""
        if q.shape[1] != len(range(self.num_heads)[heads]):
            raise ValueError(f"q has {q.shape[1]} heads but the slice {heads} of this SparseAttention's "
                             f"{self.num_heads} heads has {len(range(self.num_heads)[heads])}")
        method = METHODS[self.config.method]
        return attention(q, k, v, self.config, backend=self.backend, scale=scale,
                         params=head_params(method, self.config, dict(self.params.items()), heads))

    def extra_repr(self) -> str:
        return f"config={self.config.to_dict()}, head_dim={self.head_dim}, num_heads={self.num_heads}"
