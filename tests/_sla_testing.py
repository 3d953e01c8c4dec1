"""Helpers shared by test_sla.py and test_sla2.py: noisy parameters, a forward + backward run, comparisons."""
from __future__ import annotations

import torch

import flexsparse
from helpers import grads, qkv


def leaf_params(params: dict, dtype=torch.float64, noise: float = 0.3) -> dict:
    """Initial params plus fresh random noise (so every part is active), as leaf tensors of ``dtype``."""
    return {name: (p.double() + noise * torch.randn(p.shape, dtype=torch.float64)).to(dtype).requires_grad_()
            for name, p in params.items()}


def leaf_qkv(batch, heads, kv_heads, n, d, dtype=torch.float64, seed=None):
    return qkv(batch=batch, heads=heads, kv_heads=kv_heads, n=n, d=d, dtype=dtype, seed=seed, requires_grad=True)


def qkv_selecting_alike(select, batch, heads, kv_heads, n, d, tries: int = 20):
    """Fresh fp32 ``leaf_qkv`` draws whose selection ``select(q, k)`` (a tuple of index tensors) is the same from
    the fp32 values and from their fp64 copies. A near-tie between two blocks' router scores can pick other
    blocks in the two precisions (rare: 0 of 300 draws at these shapes, but CI met one), and a comparison of the
    precisions' outputs would then measure that choice, not the arithmetic."""
    for _ in range(tries):
        q, k, v = leaf_qkv(batch, heads, kv_heads, n, d, dtype=torch.float32)
        low, high = select(q, k), select(q.double(), k.double())
        if all(torch.equal(a, b) for a, b in zip(low, high)):
            return q, k, v
    raise AssertionError(f"{tries} draws all selected differently in fp32 and fp64")


def run(q, k, v, config, params, backend: str):
    """Output, LSE and gradients (q, k, v, then params in order; None where unused) of a random loss of both."""
    out, lse = flexsparse.attention(q, k, v, config, backend=backend, return_lse=True, params=params)
    return out, lse, grads([out, lse], [q, k, v, *params.values()])


def cast(tensors, dtype):
    """Detached leaf copies in ``dtype`` (same values, fresh graph)."""
    return [x.detach().to(dtype).requires_grad_() for x in tensors]


def cast_params(params: dict, dtype) -> dict:
    return dict(zip(params, cast(params.values(), dtype)))


def assert_all_close(got, want, rtol: float, atol: float):
    """Elementwise ``assert_close`` (in fp64) of two ``run`` results: outputs, LSEs, every gradient."""
    (o1, l1, g1), (o2, l2, g2) = got, want
    torch.testing.assert_close(o1.double(), o2.double(), rtol=rtol, atol=atol)
    torch.testing.assert_close(l1.double(), l2.double(), rtol=rtol, atol=atol)
    for i, (a, b) in enumerate(zip(g1, g2)):
        assert (a is None) == (b is None), f"gradient {i}: one backend gives None"
        if a is not None:
            torch.testing.assert_close(a.double(), b.double(), rtol=rtol, atol=atol, msg=lambda m: f"grad {i}: {m}")
