"""Pooling, log weights, block top-K and CSR->CSC."""
import warnings

import pytest
import torch

from flexsparse.masks import csr_to_csc, fit_block, level_span, level_table, log_token_weights, token_counts
from flexsparse.masks.levels import SPAN
from flexsparse.methods.dense import span_means
from flexsparse.triton.pooling.naive import mean_pool, pool_pyramid
from flexsparse.triton.selection.naive import block_topk, stable_topk

from helpers import NewStorages, qkv, rel_err


@pytest.mark.parametrize("n, block", [(1, 4), (15, 4), (17, 16), (1000, 8), (65, 64)])
def test_mean_pool_is_the_true_mean_of_real_tokens(n, block):
    x = torch.randn(2, 3, n, 5, dtype=torch.float64)
    assert rel_err(mean_pool(x, block), span_means(x, block)) < 1e-14
    y = x.float()
    assert mean_pool(y, block).dtype == torch.float32


@pytest.mark.parametrize("n", [1000, 1024])
def test_router_pooling_makes_no_full_size_copy(n):
    """The router's pooling of q and k (the torch backend's ``router_inputs``) reads them in place: no intermediate
    as large as q, also at a ragged length (a zero-padded copy of q and k took 0.665 ms at the public SLA shape on an
    H100)."""
    from flexsparse.backends import BACKENDS

    q, k = torch.randn(2, 2, n, 16, dtype=torch.bfloat16), torch.randn(2, 2, n, 16, dtype=torch.bfloat16)
    with NewStorages(q, k) as mode:
        BACKENDS["torch"].router_inputs(q, k, 64, 64)
    assert 0 < max(size for _, size in mode.allocated) < q.untyped_storage().nbytes() // 8


@pytest.mark.parametrize("n", [1000, 1024])
def test_pooling_backward_writes_one_gradient_of_x(n):
    """The gradient of the block sums reaches bf16 x as one tensor written once (no zero-filled slice gradients,
    no widened copy), and it is exact: each token gets its block's gradient."""
    from flexsparse.triton.pooling.naive import block_sums

    x = torch.randn(2, 2, n, 16, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(2, 2, -(-n // 64), 16)
    sums = block_sums(x, 64)
    with NewStorages(x) as mode:
        (dx,) = torch.autograd.grad(sums, x, grad)
    big = [name for name, size in mode.allocated if size >= x.untyped_storage().nbytes()]
    assert len(big) == 1 and not set(big) & {"zeros", "slice_backward"}
    assert torch.equal(dx, grad.repeat_interleave(64, dim=2)[:, :, :n].to(torch.bfloat16))


@pytest.mark.parametrize("n, block, levels", [(1, 4, 2), (300, 4, 4), (4097, 16, 2), (1000, 3, 3)])
def test_pyramid_levels_are_means_over_their_spans(n, block, levels):
    x = torch.randn(1, 2, n, 4, dtype=torch.float64)
    for level, pooled in enumerate(pool_pyramid(x, block, levels), start=1):
        assert rel_err(pooled, span_means(x, block**level)) < 1e-13


def test_pyramid_accumulates_bf16_in_fp32():
    x = torch.randn(1, 1, 4096, 8) + 100.0
    pooled = pool_pyramid(x.bfloat16(), 16, 2)
    assert pooled[0].dtype == torch.float32
    exact = span_means(x.bfloat16().double(), 256)
    assert rel_err(pooled[1], exact) < 1e-6


@pytest.mark.parametrize("n, block, levels", [(64, 64, 4), (70, 4, 6), (5, 2, 32), (1, 2, 3)])
def test_pyramid_levels_past_the_sequence_have_one_token_of_all(n, block, levels):
    x = torch.randn(1, 2, n, 4, dtype=torch.float64)
    for level, pooled in enumerate(pool_pyramid(x, block, levels), start=1):
        want = span_means(x, min(block**level, n))
        assert pooled.shape == want.shape and rel_err(pooled, want) < 1e-13


def test_fit_block_covers_the_sequence_with_a_bounded_block():
    assert [fit_block(b, 100) for b in (7, 100, 101, 128, 129, 65536, 2**31 - 1)] == [7, 100, 101, 128, 128, 128, 128]
    assert [fit_block(b, 5) for b in (3, 8, 16, 17, 2**20)] == [3, 8, 16, 16, 16]


def test_level_span_stops_at_the_sequence():
    assert [level_span(100, 4, level) for level in range(5)] == [1, 4, 16, 64, 100]
    assert level_span(64, 64, 1) == level_span(64, 64, 32) == 64
    assert level_span(10, 2**31 - 1, 32) == 10


def test_level_table_spans_fit_int32_and_refuse_overflowing_kernel_products():
    table = level_table(64, 64, (1,) * 32)
    assert [row[SPAN] for row in table.rows] == [1] + [64] * 32
    assert all(table.tokens(level) == 1 for level in range(1, 33))
    table.meta(torch.empty(0))                      # every entry fits int32
    with pytest.raises(ValueError, match="block_size=65536 at N=65536.*int32"):
        level_table(65536, 65536, (1, 1))


def test_counts_and_log_weights():
    assert token_counts(10, 4).tolist() == [4, 4, 2]
    w = log_token_weights(10, 4, length=5)
    assert torch.allclose(w[:3], torch.tensor([4.0, 4.0, 2.0]).log())
    assert torch.isneginf(w[3:]).all()


def test_stable_topk_breaks_ties_by_position():
    scores = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0], [float("-inf"), 2.0, 2.0, 2.0, 1.0]])
    assert stable_topk(scores, 2).tolist() == [[1, 2], [1, 2]]


def test_block_topk_chunks_give_the_same_answer():
    q, k, _ = qkv(heads=4, kv_heads=2, n=512, d=8)
    qp, kp = mean_pool(q, 8), mean_pool(k, 8)
    full, bottom = block_topk(qp, kp, 5, bottomk=3)
    chunked, bottom_c = block_topk(qp, kp, 5, bottomk=3, max_elements=100)
    assert torch.equal(full, chunked) and torch.equal(bottom, bottom_c)
    assert not (full.unsqueeze(-1) == bottom.unsqueeze(-2)).any()


@pytest.mark.parametrize("tq, tk, k", [(1, 1, 1), (7, 5, 3), (64, 64, 8), (33, 100, 10)])
def test_csc_is_the_transpose(tq, tk, k):
    idx = torch.stack([torch.randperm(tk)[:k] for _ in range(2 * 3 * tq)]).view(2, 3, tq, k).sort(-1).values.int()
    csc = csr_to_csc(idx, tk)
    dense = torch.zeros(2, 3, tq, tk, dtype=torch.bool)
    dense.scatter_(-1, idx.long(), True)
    assert csc.offsets.dtype == torch.int32 and csc.rows.dtype == torch.int32
    for b in range(2):
        for h in range(3):
            for j in range(tk):
                start, end = csc.offsets[b, h, j].item(), csc.offsets[b, h, j + 1].item()
                rows = csc.rows[b, h, start:end].tolist()
                assert rows == sorted(rows)
                assert rows == dense[b, h, :, j].nonzero().flatten().tolist()


@pytest.mark.parametrize("skipped_per_row", [1, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_keep_map_zeros_the_skipped_blocks_eager_and_compiled(skipped_per_row, dtype):
    """1 on kept key blocks, 0 on skipped ones, in the dtype asked for, also compiled: torch 2.11's inductor gave an
    fp32 map typed ``dtype`` for one skipped block per row (``masks.keep_map``)."""
    from flexsparse.masks import keep_map

    tk = 7
    skipped = torch.rand(2, 3, 5, tk).argsort(-1)[..., :skipped_per_row].int()
    want = 1.0 - (skipped.long().unsqueeze(-1) == torch.arange(tk)).any(-2).to(dtype)
    for fn in (keep_map, torch.compile(keep_map, fullgraph=True)):
        got = fn(skipped, tk, dtype)
        assert got.dtype == dtype and torch.equal(got, want)


def test_kept_constant_is_built_once_per_key_and_device_and_again_in_a_trace():
    """An eager call reads the tensor the first one built; a trace (fake tensors) builds its own in the graph."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from flexsparse.masks.constants import kept_constant
    builds = []

    def build(device):
        builds.append(device)
        return torch.arange(3, device=device)

    key, like = ("test", object()), torch.empty(3)
    first = kept_constant(key, like, build)
    assert kept_constant(key, like, build) is first and builds == [like.device]
    assert kept_constant(("test", object()), like, build) is not first and len(builds) == 2
    traced = make_fx(lambda x: kept_constant(key, x, build) + x, tracing_mode="fake")(like)
    assert len(builds) == 3 and torch.equal(traced(torch.ones(3)), torch.arange(3) + 1.0)


def test_level_table_traces_without_a_dynamo_warning():
    """The triton backend builds the table inside a user's compiled region: dynamo traces its code and warns about
    no ``functools.lru_cache`` (a warning that speaks of possible silent incorrectness)."""
    torch._dynamo.reset()                  # also forgets the warnings dynamo gives once per process
    n = int(torch.randint(20, 200, ()))
    traced = torch.compile(lambda x: x + level_table(x.shape[0], 4, (2,)).tokens(1), backend="eager", fullgraph=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = traced(torch.zeros(n))
    assert not [w for w in caught if "lru_cache" in str(w.message)]
    assert torch.equal(out, torch.full((n,), float(level_table(n, 4, (2,)).tokens(1))))
