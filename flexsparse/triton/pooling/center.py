"""Centring of token rows, ``x - mean`` with one mean row per (batch, head): SLA2's smoothed keys ``k - mean_N k``
and their gradient ``g - mean_N g``. fp32 math, one rounding to x's dtype, one pass over x (PyTorch's mixed-dtype
broadcast ``out=`` subtraction ran at about a third of the memory bandwidth)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._runtime.registry import launcher
from ..common.jit import token_tile, token_tiles


@triton.jit
def _center_kernel(X, MEAN, OUT, x_b, x_h, x_n, H, N, D: tl.constexpr, BD: tl.constexpr, TILE: tl.constexpr):
    bh, _, dim, ok, src, dst = token_tile(x_b, x_h, x_n, H, N, D, BD, TILE)
    mean = tl.load(MEAN + bh.to(tl.int64) * D + dim, mask=dim < D, other=0.0)
    x = tl.load(X + src, mask=ok, other=0.0).to(tl.float32)
    tl.store(OUT + dst, (x - mean[None, :]).to(OUT.dtype.element_ty), mask=ok)


def center(x: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """``x - mean``: x ``(B, H, N, D)`` (last dim contiguous), mean ``(B, H, 1, D)`` fp32; contiguous, x's dtype."""
    out = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    grid, tiles = token_tiles(x)
    launcher(_center_kernel)[grid](x, mean.float().contiguous(), out, x.stride(0), x.stride(1), x.stride(2), x.shape[1],
                                   x.shape[2], D=x.shape[3], **tiles, num_warps=8)
    return out
