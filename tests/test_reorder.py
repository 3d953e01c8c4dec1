"""Token orders: inverses, positions, compactness of aligned blocks, arbitrary sizes."""
import pytest
import torch

from flexsparse.masks import morton_order_2d, tile_order_3d


def _check_order(order, sizes):
    n = 1
    for s in sizes:
        n *= s
    assert order.perm.shape == order.inverse.shape == (n,)
    assert order.positions.shape == (n, len(sizes))
    assert torch.equal(torch.sort(order.perm).values, torch.arange(n))
    assert torch.equal(order.perm[order.inverse], torch.arange(n))
    assert torch.equal(order.inverse[order.perm], torch.arange(n))
    raster = torch.zeros(n, dtype=torch.int64)
    for axis, size in enumerate(sizes):
        raster = raster * size + order.positions[:, axis]
    assert torch.equal(raster, order.perm), "positions must be the coordinates of the permuted tokens"
    x = torch.randn(2, n, 3)
    assert torch.equal(x[:, order.perm][:, order.inverse], x)


def _block_extents(positions, block):
    """Bounding-box side lengths ``(blocks, dims)`` of each aligned run of ``block`` tokens."""
    runs = positions.view(-1, block, positions.shape[1])
    return runs.amax(dim=1) - runs.amin(dim=1) + 1


@pytest.mark.parametrize("h,w", [(1, 1), (1, 9), (7, 13), (13, 7), (16, 16), (5, 32), (33, 17)])
def test_morton_2d_is_a_permutation_with_positions(h, w):
    _check_order(morton_order_2d(h, w), (h, w))


@pytest.mark.parametrize("t,h,w,tile", [(3, 5, 9, (2, 2, 2)), (1, 7, 13, (1, 4, 4)), (4, 8, 8, (4, 4, 4)),
                                        (5, 6, 7, (4, 4, 4)), (2, 3, 3, (1, 1, 1))])
def test_tile_3d_is_a_permutation_with_positions(t, h, w, tile):
    _check_order(tile_order_3d(t, h, w, tile=tile), (t, h, w))


@pytest.mark.parametrize("side", [4, 8, 32, 64])
def test_morton_aligned_blocks_are_squares_for_powers_of_two(side):
    positions = morton_order_2d(side, side).positions
    for block, square in ((4, 2), (16, 4), (256, 16)):
        if block <= side * side:
            assert (_block_extents(positions, block) == square).all()


@pytest.mark.parametrize("h,w", [(48, 80), (12, 20), (96, 96)])
def test_morton_aligned_blocks_are_squares_when_sides_are_multiples(h, w):
    """4 | h, w: every aligned 16-token block is a 4x4 square, also for non-power-of-two sides."""
    assert (_block_extents(morton_order_2d(h, w).positions, 16) == 4).all()


def test_morton_matches_the_classic_z_order():
    expected = torch.tensor([[0, 1, 4, 5], [2, 3, 6, 7], [8, 9, 12, 13], [10, 11, 14, 15]])
    assert torch.equal(morton_order_2d(4, 4).inverse.view(4, 4), expected)


@pytest.mark.parametrize("h,w", [(7, 13), (9, 9), (3, 17)])
def test_morton_dyadic_squares_are_contiguous_for_any_size(h, w):
    """The real cells of every aligned 2^k x 2^k square form one contiguous run."""
    positions = morton_order_2d(h, w).positions
    for k in range(1, 5):
        square = (positions[:, 0] >> k) * 1024 + (positions[:, 1] >> k)
        changes = (square[1:] != square[:-1]).sum().item() + 1
        assert changes == square.unique().numel(), f"a {2**k}x{2**k} square is split into several runs"


def test_tile_3d_aligned_runs_are_tiles():
    positions = tile_order_3d(4, 8, 12, tile=(2, 4, 4)).positions
    assert (_block_extents(positions, 32) == torch.tensor([2, 4, 4])).all()


def test_tile_3d_with_unit_tiles_is_morton_2d():
    assert torch.equal(tile_order_3d(1, 7, 13, tile=(1, 1, 1)).perm, morton_order_2d(7, 13).perm)


def test_tile_3d_partial_tiles_stay_contiguous():
    positions = tile_order_3d(3, 5, 9, tile=(2, 2, 4)).positions
    tile_id = ((positions[:, 0] // 2) * 3 + positions[:, 1] // 2) * 3 + positions[:, 2] // 4
    assert (tile_id[1:] != tile_id[:-1]).sum().item() + 1 == tile_id.unique().numel()


@pytest.mark.parametrize("bad", [0, -3, 2.0, True])
def test_sizes_must_be_positive_ints(bad):
    with pytest.raises(ValueError, match="h must be a positive int"):
        morton_order_2d(bad, 4)
    with pytest.raises(ValueError, match=r"tile\[1\] must be a positive int"):
        tile_order_3d(2, 4, 4, tile=(1, bad, 1))
    with pytest.raises(ValueError, match="tile must have 3 sizes"):
        tile_order_3d(2, 4, 4, tile=(2, 2))
