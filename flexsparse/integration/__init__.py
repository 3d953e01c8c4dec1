"""Putting flexsparse into existing models: ``patch``/``unpatch``, dense warm-up (``set_step``), the
diffusers processor ``FlexSparseAttnProcessor`` and the SDPA-shaped ``SparseSDPA``; under diffusers' context
parallelism they exchange the sequence shards themselves (``context_parallel``)."""
from .patch import patch, unpatch
from .processor import FlexSparseAttnProcessor
from .sdpa import RouteSDPA, SparseSDPA, set_step
from .spec import PatchSpec

__all__ = ["patch", "unpatch", "set_step", "FlexSparseAttnProcessor", "SparseSDPA", "RouteSDPA", "PatchSpec"]
