"""GPU: an eager forward+backward on ``backend="triton"`` makes no synchronizing CUDA call.

A call that waits for the GPU (``.item()``, a data-dependent shape, a device-to-host copy) stalls the host until
the queue drains, so the next launches start late: a silent slowdown that no output comparison sees. CUDA's
sync debug mode (``torch.cuda.set_sync_debug_mode("error")``) turns each such call into an error.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

import flexsparse
from flexsparse.methods import METHODS as REGISTRY
from triton_support import gpu

METHODS = ["topk", "vsa", "llsa", "sla", "sla2"]


@contextlib.contextmanager
def _sync_errors():
    """A context in which a synchronizing CUDA call raises ``RuntimeError``."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


@gpu
def test_gpu_sync_debug_mode_catches_a_synchronizing_call():
    """The check below can fail: a device-to-host read raises under the mode."""
    x = torch.randn(8, device="cuda")
    with _sync_errors(), pytest.raises(RuntimeError, match="synchroniz"):
        x.sum().item()


@gpu
@pytest.mark.parametrize("n", [16384, 16000])
@pytest.mark.parametrize("method", METHODS)
def test_gpu_eager_forward_backward_never_synchronizes(method, n):
    heads, dim = 4, 64
    module = flexsparse.SparseAttention(REGISTRY[method].example, head_dim=dim, num_heads=heads, seq_len=n,
                                        backend="triton").cuda()
    q, k, v = (torch.randn(1, heads, n, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    grad = torch.randn_like(q)
    leaves = [q, k, v, *(p for p in module.parameters() if p.requires_grad)]

    def step():
        return torch.autograd.grad(module(q, k, v), leaves, grad, allow_unused=True)

    step()                      # compiles the kernels first (loading a module may synchronize)
    with torch.no_grad():
        module(q, k, v)
    torch.cuda.synchronize()
    with _sync_errors():
        grads = step()
        with torch.no_grad():
            module(q, k, v)
    assert all(g is None or torch.isfinite(g).all() for g in grads)
