"""Sequence parallelism on ``torch.distributed``: ``ParallelConfig`` names the group, ``ulysses_attention`` runs an
attention call over it (``flexsparse.attention(..., parallel=)``, ``SparseAttention``, ``patch`` use it);
``all_to_all`` is its differentiable exchange, for models that move their own shards."""
from .collectives import all_to_all
from .config import ParallelConfig
from .ulysses import ulysses_attention

__all__ = ["ParallelConfig", "all_to_all", "ulysses_attention"]
