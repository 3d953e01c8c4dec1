"""Sequence parallelism on ``torch.distributed``: ``ParallelConfig`` names the groups, ``ulysses_attention`` and
``ring_attention`` run an attention call over them (``flexsparse.attention(..., parallel=)``, ``SparseAttention``,
``patch`` use them); ``all_to_all`` is their differentiable exchange, for models that move their own shards."""
from .collectives import all_to_all
from .config import ParallelConfig
from .ring import ring_attention, ring_methods
from .ulysses import ulysses_attention

__all__ = ["ParallelConfig", "all_to_all", "ring_attention", "ring_methods", "ulysses_attention"]
