"""Host-side sizes of kernel launches: ceil division, powers of two, row tables repeated per tile, and whether sizes
are static."""
from __future__ import annotations

import torch

MAX_GRID_YZ = 65535   # CUDA's grid size on its y and z axes (the kernels put batch x heads there)


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for positive ints."""
    return -(-a // b)


def static(*sizes) -> bool:
    """Whether every size is a plain int: a graph traced for any length sees SymInts, and a host-side choice that
    compares one adds a guard on the length (from a backward graph, one that breaks Inductor's scheduler on
    torch 2.11: KeyError in ``compute_ancestors``); such choices take the path that fits every size."""
    return all(isinstance(size, int) for size in sizes)


def pow2(x: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(x, minimum)."""
    return max(minimum, 1 << max(0, int(x) - 1).bit_length())


def repeat_rows(table: torch.Tensor, times: int) -> torch.Tensor:
    """``table (B, H, T, X)`` with each row of dim 2 repeated ``times`` times in place: ``(B, H, T * times, X)``,
    contiguous for a contiguous table (one copy; a view of it when ``times == 1``). A query block's row for
    each of its tiles (the block-sparse dK/dV's index table)."""
    bsz, heads, rows, width = table.shape
    return table.unsqueeze(3).expand(bsz, heads, rows, times, width).flatten(2, 3)
