"""Token orders that make pooling blocks spatially compact: 2D Z-order (Morton) for images and
tile-major 3D order for video, for any sizes.

Both return a ``TokenOrder``: ``perm`` (``(N,)``, the raster index of each token in the new order),
``inverse`` (``(N,)``, so ``x[:, perm][:, inverse] == x``) and ``positions`` (``(N, 2)`` rows/columns or
``(N, 3)`` frames/rows/columns of the tokens in the new order, for RoPE). Use on a raster token
sequence ``x (B, N, C)``: ``x[:, order.perm]`` before the blocks, ``y[:, order.inverse]`` after.

Compactness guarantee. The order is the Z-order of the enclosing power-of-two grid with the cells
outside the image dropped (``tile_order_3d``: the same over the grid of tiles, tokens inside a tile in
raster order). Hence
* the real cells of every aligned dyadic square (2D: ``2^k x 2^k``) are one contiguous run, for any size;
* if ``2^k`` divides ``h`` and ``w``, every aligned run of ``4^k`` tokens (run ``i`` = tokens
  ``i*4^k .. (i+1)*4^k - 1``) is exactly a ``2^k x 2^k`` square: blocks of 16 tokens are 4x4 pixels,
  blocks of 256 are 16x16 (sizes with a ragged edge have partial squares along that edge, which shift
  the alignment of the blocks after them);
* 3D: if the tile divides ``(t, h, w)``, every aligned run of ``tt*th*tw`` tokens is exactly one tile.
Within a 2x2 square the row is the more significant bit (LLSA's order): (0,0), (0,1), (1,0), (1,1).
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import torch


class TokenOrder(NamedTuple):
    """A token permutation: ``perm (N,)``, ``inverse (N,)``, ``positions (N, dims)`` (int64)."""

    perm: torch.Tensor
    inverse: torch.Tensor
    positions: torch.Tensor


def morton_order_2d(h: int, w: int, *, device: torch.device | str | None = None) -> TokenOrder:
    """Z-order of an ``h x w`` grid (any sizes); ``positions`` are ``(row, col)``."""
    sizes = _check_sizes({"h": h, "w": w})
    coords = _grid_coords(sizes, device)
    return _order(coords, _morton_codes(coords, _bits(sizes)))


def tile_order_3d(t: int, h: int, w: int, tile: Sequence[int] = (4, 4, 4), *,
                  device: torch.device | str | None = None) -> TokenOrder:
    """Tile-major order of a ``t x h x w`` grid (any sizes): tiles of ``tile = (tt, th, tw)`` tokens in
    3D Z-order over the tile grid (frame bit most significant), tokens inside a tile in raster order;
    edge tiles may be partial. ``positions`` are ``(frame, row, col)``.
    ``tile_order_3d(1, h, w, tile=(1, 1, 1))`` equals ``morton_order_2d(h, w)``."""
    sizes = _check_sizes({"t": t, "h": h, "w": w})
    if len(tile) != 3:
        raise ValueError(f"tile must have 3 sizes (tt, th, tw), got {tuple(tile)}")
    tile = _check_sizes({f"tile[{i}]": s for i, s in enumerate(tile)})
    coords = _grid_coords(sizes, device)
    tiles = torch.tensor(tile, device=coords.device)
    tile_grid = tuple(-(-s // d) for s, d in zip(sizes, tile))
    local = coords % tiles
    local_raster = (local[:, 0] * tile[1] + local[:, 1]) * tile[2] + local[:, 2]
    volume = tile[0] * tile[1] * tile[2]
    keys = _morton_codes(coords // tiles, _bits(tile_grid)) * volume + local_raster
    return _order(coords, keys)


def _check_sizes(sizes: dict[str, int]) -> tuple[int, ...]:
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    return tuple(sizes.values())


def _grid_coords(sizes: tuple[int, ...], device) -> torch.Tensor:
    """Coordinates ``(N, dims)`` of the grid cells in raster order."""
    axes = [torch.arange(s, device=device) for s in sizes]
    return torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1).reshape(-1, len(sizes))


def _bits(sizes: tuple[int, ...]) -> int:
    """Bits per axis of the enclosing power-of-two grid."""
    return max(max(sizes) - 1, 0).bit_length()


def _morton_codes(coords: torch.Tensor, bits: int) -> torch.Tensor:
    """Interleaved bits of ``coords (N, dims)``; axis 0 is the most significant within each group."""
    dims = coords.shape[1]
    if bits * dims > 62:
        raise ValueError(f"grid too large for 64-bit Morton codes ({bits} bits x {dims} axes)")
    codes = torch.zeros(coords.shape[0], dtype=torch.int64, device=coords.device)
    for bit in range(bits):
        for axis in range(dims):
            codes |= ((coords[:, axis] >> bit) & 1) << (bit * dims + dims - 1 - axis)
    return codes


def _order(coords: torch.Tensor, keys: torch.Tensor) -> TokenOrder:
    """Cells sorted by their (distinct) keys."""
    perm = torch.argsort(keys)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel(), device=perm.device)
    return TokenOrder(perm, inverse, coords[perm])
