"""Selection results: the index tables every backend consumes.

One selection feeds the reference, torch, flex and triton paths, so they are comparable on
identical selections. Index tables are int32, sorted ascending along the last dim.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .geometry import num_blocks


class _BlockGrid:
    """Block counts of a (query block, key block) grid over ``n_q`` x ``n_k`` tokens."""

    @property
    def num_q_blocks(self) -> int:
        return num_blocks(self.n_q, self.block_q)

    @property
    def num_k_blocks(self) -> int:
        return num_blocks(self.n_k, self.block_k)


@dataclass(frozen=True, eq=False)
class PreparedOperands:
    """Operands a backend's selection pass made for the attention of exactly the tensors ``sources`` (q, k, v):
    the triton backend's e4m3 Q per block from its pooling pass, and for unsmoothed keys K's blocks and V's amax
    (``flexsparse::pool_quantize_queries``, ``flexsparse::pool_quantize``).
    A backend uses them only where it attends those very tensors (``serves``); the others ignore them."""

    sources: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    tensors: list[torch.Tensor]

    def serves(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
        """Whether q, k, v are the tensors these operands were made from (identity, not values)."""
        return all(a is b for a, b in zip(self.sources, (q, k, v)))


@dataclass(frozen=True)
class BlockSelection(_BlockGrid):
    """Top-K key blocks per query block.

    indices: ``(B, H, Tq, K)`` int32 key-block ids, ascending, distinct per row.
    excluded: optional ``(B, H, Tq, Kx)`` int32 blocks that no branch may use (SLA's
    "negligible" class); ``None`` when there are none.
    key_mean: optional ``(B, Hk, 1, D)`` mean over the tokens of the keys the branches attend, in the accumulation
    dtype, from the block sums the selection pooled (methods with ``quant``): the FP8 forward's smoothing mean
    without a pass over K; ``None`` where the selection has none (a backend that needs one takes it from the keys).
    prepared: optional ``PreparedOperands`` of the backend that selected (the FP8 operands of Q, and of K for
    unsmoothed keys).
    """

    indices: torch.Tensor
    block_q: int
    block_k: int
    n_q: int
    n_k: int
    excluded: torch.Tensor | None = None
    key_mean: torch.Tensor | None = None
    prepared: PreparedOperands | None = None


@dataclass(frozen=True)
class LLSASelection:
    """Hierarchical selection of LLSA.

    indices[l-1] is ``S_l``, ``(B, H, T_l, K_l)`` int32 for l = 1..L: row i belongs to level-l
    query token i (the level-(l-1) query block i), entries are level-l key token ids, ascending.
    """

    indices: tuple[torch.Tensor, ...]
    block: int
    n: int

    @property
    def levels(self) -> int:
        return len(self.indices)


@dataclass(frozen=True)
class SoftBlockMask(_BlockGrid):
    """Soft block mask of SLA2's stage-1 router (SoftTop-k).

    logits: ``(B, H, Tq, Tk)`` pre-sigmoid values; the block weight is ``M = sigmoid(logits)``
    (each row sums to the block count), consumed as ``log M = logsigmoid(logits)`` by the softmax
    branch and ``1 - M = sigmoid(-logits)`` by the linear branch. Differentiable.
    """

    logits: torch.Tensor
    block_q: int
    block_k: int
    n_q: int
    n_k: int


def keep_map(skipped: torch.Tensor, num_k_blocks: int, dtype: torch.dtype) -> torch.Tensor:
    """``(B, H, Tq, Tk)`` in ``dtype``: 1 on the key blocks a query block keeps, 0 on its skipped ones ``skipped
    (B, H, Tq, S)`` (block ids below ``Tk = num_k_blocks``).

    The zeros are scattered from a tensor, not a scalar: torch 2.11's inductor rewrites ``full + scatter`` of a
    scalar along a dim of size 1 (one skipped block per row) into a ``where`` whose result is fp32 under the full
    tensor's type (bf16, fp64), which a compiled SLA backward then fed to a ``bmm`` (fixed in later torch)."""
    keep = torch.ones(*skipped.shape[:3], num_k_blocks, dtype=dtype, device=skipped.device)
    return keep.scatter_(-1, skipped.long(), keep.new_zeros(()).expand(skipped.shape))
