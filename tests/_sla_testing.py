"""Shared helpers of test_sla.py and test_sla2.py: random inputs and a run of forward + backward."""
from __future__ import annotations

import torch

import flexsparse


def rand_qkv(b: int, h: int, hk: int, n: int, d: int, dtype=torch.float64, seed: int = 0, k_offset: float = 0.5):
    """Random leaf q ``(b, h, n, d)``, k, v ``(b, hk, n, d)``; k gets a per-channel offset (a real key mean)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, n, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, hk, n, d, generator=g, dtype=torch.float64) + k_offset * torch.randn(d, generator=g,
                                                                                            dtype=torch.float64)
    v = torch.randn(b, hk, n, d, generator=g, dtype=torch.float64)
    return [x.to(dtype).requires_grad_() for x in (q, k, v)]


def leaf_params(params: dict, dtype=torch.float64, seed: int = 1, noise: float = 0.3) -> dict:
    """Initial params plus random noise (so every part is active), as leaf tensors of ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    return {name: (p.double() + noise * torch.randn(p.shape, generator=g, dtype=torch.float64)).to(dtype)
            .requires_grad_() for name, p in params.items()}


def run(q, k, v, config, params, backend: str, seed: int = 2):
    """Output, LSE and gradients (q, k, v, then params in order; None where unused) of a random loss."""
    out, lse = flexsparse.attention(q, k, v, config, backend=backend, return_lse=True, params=params)
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.dtype)
    inputs = [q, k, v, *params.values()]
    grads = torch.autograd.grad((out * weight).sum() + lse.sum(), inputs, allow_unused=True)
    return out, lse, grads


def cast(tensors, dtype):
    """Detached leaf copies in ``dtype`` (same values, fresh graph)."""
    return [x.detach().to(dtype).requires_grad_() for x in tensors]


def cast_params(params: dict, dtype) -> dict:
    return dict(zip(params, cast(params.values(), dtype)))


def assert_all_close(got, want, rtol: float, atol: float):
    """Pairwise ``assert_close`` (in fp64) of two result tuples from ``run``."""
    (o1, l1, g1), (o2, l2, g2) = got, want
    torch.testing.assert_close(o1.double(), o2.double(), rtol=rtol, atol=atol)
    torch.testing.assert_close(l1.double(), l2.double(), rtol=rtol, atol=atol)
    for i, (a, b) in enumerate(zip(g1, g2)):
        assert (a is None) == (b is None), f"gradient {i}: one backend gives None"
        if a is not None:
            torch.testing.assert_close(a.double(), b.double(), rtol=rtol, atol=atol, msg=lambda m: f"grad {i}: {m}")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
