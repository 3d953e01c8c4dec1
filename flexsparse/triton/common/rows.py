"""Contiguous copies of ``(B, H, N, D)`` tensors whose token rows are strided, such as the q, k, v views of one
fused ``(B, N, 3, H, D)`` projection. The kernels read whole contiguous rows of a head; this copy moves each
``D``-element row once and runs at the speed of a contiguous clone, where PyTorch's strided ``.contiguous()``
took twice as long (H100, B2 H8 N65536 D64 bf16: 0.10 vs 0.19 ms per tensor).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._runtime.registry import launcher
from ..common.jit import token_tile, token_tiles


@triton.jit
def _rows_kernel(X, OUT, x_b, x_h, x_n, H, N, D: tl.constexpr, BD: tl.constexpr, TILE: tl.constexpr):
    _, _, _, ok, src, dst = token_tile(x_b, x_h, x_n, H, N, D, BD, TILE)
    tl.store(OUT + dst, tl.load(X + src, mask=ok), mask=ok)


def copy_rows(x: torch.Tensor) -> torch.Tensor:
    """``x (B, H, N, D)`` (last dim contiguous, any other strides) as a new contiguous tensor of the same values."""
    out = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    grid, tiles = token_tiles(x)
    launcher(_rows_kernel)[grid](x, out, x.stride(0), x.stride(1), x.stride(2), x.shape[1], x.shape[2], D=x.shape[3],
                                 **tiles, num_warps=8)
    return out
