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
from flexsparse.methods import METHODS
from triton_support import fp8_methods, gpu, triton_methods


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


# every method of the registry on backend="triton" with its example config, and those the FP8 kernel runs with "quant"
CONFIGS = [METHODS[name].example for name in triton_methods()] + [
    {**METHODS[name].example, "quant": {}} for name in fp8_methods()]


@gpu
@pytest.mark.parametrize("n", [16384, 16000])
@pytest.mark.parametrize("config", CONFIGS, ids=lambda cfg: cfg["method"] + ("_fp8" if "quant" in cfg else ""))
@pytest.mark.parametrize("dim", [64, 128])
def test_gpu_eager_forward_backward_never_synchronizes(config, dim, n, monkeypatch):
    """Forward, forward+backward and a ``no_grad`` forward at head dims 64 and 128 (the FP8 forward runs the
    Triton kernel at 64 and the Gluon one at 128 on Hopper), every kernel launched eagerly (no CUDA graphs:
    ``test_eager_graphs`` checks their replays)."""
    monkeypatch.setenv("FLEXSPARSE_EAGER_GRAPHS", "0")
    if "quant" in config:
        pytest.importorskip("torchao")
    heads = 4
    module = flexsparse.SparseAttention(config, head_dim=dim, num_heads=heads, seq_len=n, backend="triton").cuda()
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
