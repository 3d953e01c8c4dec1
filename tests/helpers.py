"""Shared test utilities: random inputs, error metrics, gradient collection, allocation records."""
from __future__ import annotations

import pytest
import torch
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from flexsparse.masks import num_blocks
from flexsparse.masks.levels import fewest_candidates


# every registered method, with blocks small enough for sequences of about a hundred tokens
SMALL_CONFIGS = {
    "full": {"method": "full"},
    "topk": {"method": "topk", "block_size": 8, "topk": 3},
    "vsa": {"method": "vsa", "block_size": 8, "topk": 3, "gate": True},
    "llsa": {"method": "llsa", "block_size": 4, "topk": 2},
    "sla": {"method": "sla", "block_size": 8, "topk_ratio": 0.25},
    "sla2": {"method": "sla2", "block_size": 8, "topk_ratio": 0.25, "alpha_per_head": True},
}


def assert_fullgraph_step_equals_eager(model, run, tol: dict) -> None:
    """``torch.compile(model, fullgraph=True, backend="aot_eager")`` has no graph break (``torch._dynamo.explain`` of
    ``run(model)``), and a training step, ``run(module)`` and the gradients of ``model``'s trainable parameters of
    its squared sum, equals the eager one to ``tol``."""
    def step(module):
        out = run(module)
        params = [p for p in model.parameters() if p.requires_grad]
        return out, torch.autograd.grad(out.square().sum(), params, allow_unused=True)
    torch._dynamo.reset()
    assert torch._dynamo.explain(lambda: run(model))().graph_break_count == 0
    (out, grads), (want, want_grads) = step(torch.compile(model, fullgraph=True, backend="aot_eager")), step(model)
    torch.testing.assert_close(out, want, **tol)
    for got, expected in zip(grads, want_grads):
        assert (got is None) == (expected is None)
        if got is not None:
            torch.testing.assert_close(got, expected, **tol)


def exhaustive_where(cases: list, heavy) -> list:
    """``cases`` for ``pytest.mark.parametrize`` with those for which ``heavy(case)`` holds in the exhaustive tier."""
    return [pytest.param(*case, marks=pytest.mark.exhaustive) if heavy(case) else case for case in cases]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative L2 error ||a - b|| / ||b|| in fp64 (inf-safe: -inf entries must match exactly)."""
    a, b = a.double(), b.double()
    finite = torch.isfinite(b)
    assert torch.equal(torch.isfinite(a), finite), "non-finite entries differ"
    a, b = a[finite], b[finite]
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def config_fields(method: str) -> set[str]:
    """The keys of a method's config (``flexsparse.methods.METHODS[method].config``): what a test that draws configs
    for every method of the registry may set."""
    import dataclasses

    from flexsparse.methods import METHODS
    return {field.name for field in dataclasses.fields(METHODS[method].config)}


def draw_level_topk(draw, n: int, block: int, levels: int, cap: int | None = None) -> list[int]:
    """Hypothesis draw of LLSA's K per level, finest first, for N tokens: each K at most the blocks of its level,
    at most the fewest candidates of its parents (``fewest_candidates``) and at most ``cap``."""
    def most(limit: int) -> int:
        return limit if cap is None else min(limit, cap)

    top = [0] * levels
    top[-1] = draw(st.integers(1, most(num_blocks(n, block**levels))))
    for level in range(levels - 2, -1, -1):
        top[level] = draw(st.integers(1, most(fewest_candidates(n, block, level + 1, top[level + 1]))))
    return top


def selections_by_search(q_pyr: torch.Tensor, k_pyr: torch.Tensor, n: int, block: int, topk,
                         widest: int | None = None) -> list[torch.Tensor]:
    """LLSA's packed selections from pooled pyramids by each search of the selection kernels
    (``flexsparse.triton.selection.hierarchy``): the packed search with rows cut into parts (``hierarchy.parts``),
    with whole rows, and in parts on int64 keys only (tile override ``bucket`` off: no int32 pass first), and
    bisection (``hierarchy.search`` forced each way; rows of more than ``widest`` candidates always bisect):
    ``[parts, whole, int64, bisection]``."""
    import json
    import os
    from triton_support import env_var
    # not at import: interpreter tests set TRITON_INTERPRET first
    from flexsparse.triton.selection import hierarchy as select
    from flexsparse.triton.selection.op import llsa_select
    chosen, sels = select.search, []
    tiles = json.loads(os.environ.get("FLEXSPARSE_TRITON_TILES") or "{}")
    whole = dict(tiles, select=dict(tiles.get("select", {}), top_split=1, child_split=1))
    int64 = dict(tiles, select=dict(tiles.get("select", {}), bucket=False))
    try:
        runs = ((select.SEARCH_PACKED, tiles), (select.SEARCH_PACKED, whole), (select.SEARCH_PACKED, int64),
                (select.SEARCH_BISECT, tiles))
        for how, table in runs:
            select.search = lambda top, candidates, how=how: (
                how if widest is None or candidates <= widest else select.SEARCH_BISECT)
            with env_var("FLEXSPARSE_TRITON_TILES", json.dumps(table)):
                sels.append(llsa_select(q_pyr, k_pyr, n, block, list(topk)))
    finally:
        select.search = chosen
    return sels


def qkv(batch=2, heads=2, kv_heads=None, n=64, d=16, dtype=torch.float64, device="cpu", seed=None, requires_grad=False):
    """Fresh random q ``(B, H, N, D)`` and k, v ``(B, Hk, N, D)``; k has a per-head offset like real keys."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(torch.randint(0, 2**31 - 1, ()).item() if seed is None else seed)
    kv_heads = heads if kv_heads is None else kv_heads

    def rand(h):
        return torch.randn(batch, h, n, d, generator=gen, dtype=torch.float64)

    q = rand(heads)
    k = rand(kv_heads) + 0.5 * torch.randn(1, kv_heads, 1, d, generator=gen, dtype=torch.float64)
    v = rand(kv_heads)
    return tuple(x.to(dtype=dtype, device=device).requires_grad_(requires_grad) for x in (q, k, v))


def grads(outputs, inputs, seed=0):
    """Gradients of ``sum(out * w)`` for a fixed random ``w`` per output, w.r.t. ``inputs``."""
    gen = torch.Generator().manual_seed(seed)
    total = 0
    for out in outputs:
        w = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(out.device, out.dtype)
        total = total + (out * w).sum()
    return torch.autograd.grad(total, inputs, allow_unused=True)


class NewStorages(TorchDispatchMode):
    """Records ``allocated``: ``(op name, bytes)`` of each storage first seen as an op's output while active (views
    and in-place writes into it are not counted again; the storages of ``known`` tensors never)."""

    def __init__(self, *known: torch.Tensor):
        super().__init__()
        self.seen = {t.untyped_storage().data_ptr() for t in known}
        self.allocated: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.seen:
                self.seen.add(t.untyped_storage().data_ptr())
                self.allocated.append((str(func).split(".")[1], t.untyped_storage().nbytes()))
        return out
