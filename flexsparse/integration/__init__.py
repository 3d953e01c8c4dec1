"""Putting flexsparse into existing models: ``patch``/``unpatch``, dense warm-up (``set_step``), the
diffusers processor ``FlexSparseAttnProcessor`` and the SDPA-shaped ``SparseSDPA``; joint text+visual calls of
patched modules attend as such (``joint``); under diffusers' context parallelism they exchange the sequence shards
themselves (``context_parallel``). Dense runs of patched modules and ``patch``'s summary go to the
``flexsparse.integration.*`` loggers; ``strict=True`` makes unintended dense runs a ``DenseFallbackError``."""
from .patch import PatchReport, patch, unpatch
from .processor import FlexSparseAttnProcessor
from .sdpa import DenseFallbackError, RouteSDPA, SparseSDPA, set_step
from .spec import PatchSpec

__all__ = ["patch", "unpatch", "set_step", "FlexSparseAttnProcessor", "SparseSDPA", "RouteSDPA", "PatchSpec",
           "PatchReport", "DenseFallbackError"]
