"""CSR -> CSC transpose of selection tables (query-major -> key-major), for key-major backwards."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CSC:
    """Key-major form of a ``(B, H, Tq, K)`` selection over ``Tk`` key blocks.

    offsets: ``(B, H, Tk + 1)`` int32, key j's queries are ``rows[b, h, offsets[j]:offsets[j+1]]``.
    rows: ``(B, H, Tq * K)`` int32 query-block ids, ascending within each key (deterministic).
    """

    offsets: torch.Tensor
    rows: torch.Tensor


def csr_to_csc(indices: torch.Tensor, num_keys: int) -> CSC:
    """Transpose a selection table: ``indices (B, H, Tq, K)`` with ids in ``[0, num_keys)``."""
    bsz, heads, tq, k = indices.shape
    flat = indices.reshape(bsz, heads, tq * k).long()
    order = torch.sort(flat, dim=-1, stable=True).indices
    rows = (order // k).to(torch.int32)
    counts = torch.zeros(bsz, heads, num_keys + 1, dtype=torch.int64, device=indices.device)
    counts.scatter_add_(-1, flat + 1, torch.ones_like(flat))
    return CSC(offsets=counts.cumsum(-1).to(torch.int32), rows=rows)
