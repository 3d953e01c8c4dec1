"""Sequence parallelism on ``torch.distributed``: ``ParallelConfig`` names the group, ``ulysses_attention`` runs an
attention call over it (``flexsparse.attention(..., parallel=)``, ``SparseAttention``, ``patch`` use it)."""
from .config import ParallelConfig
from .ulysses import ulysses_attention

__all__ = ["ParallelConfig", "ulysses_attention"]
