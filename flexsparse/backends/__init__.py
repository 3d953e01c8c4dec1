"""Backends: ``reference`` (dense spec), ``torch`` (gather-based), ``flex`` and ``triton``.

A method module declares which backends it supports; ``resolve`` turns ``"auto"`` into a concrete
backend and rejects unavailable ones with a clear error. ``sparse_primitives`` gives the module
with a backend's ``block_sparse_attention`` / ``llsa_attention``.
"""
from __future__ import annotations

import importlib.util
import os

import torch

from ..quant.attention import unsupported_reason as quant_unsupported_reason
from . import flex, torch_sparse

BACKENDS = ("reference", "torch", "flex", "triton", "auto")
_PRIMITIVES = {"torch": torch_sparse, "flex": flex}


def resolve(backend: str, method: str, supported: tuple[str, ...], device: torch.device, needs_grad: bool, *,
            needs_lse: bool = False, dtype: torch.dtype = torch.float32, blocks: tuple[int, ...] = (),
            head_dim: int | None = None, quant=None) -> str:
    """Concrete backend for ``method``: the preference order for ``"auto"`` is triton, flex, torch
    (each where it is supported and can run this call). ``blocks``: the config's block sizes; ``head_dim``: q's D;
    ``quant``: the config's ``QuantConfig`` (FP8 QAT), which not every backend runs."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; valid backends: {list(BACKENDS)}")
    call = dict(needs_lse=needs_lse, dtype=dtype, blocks=blocks, head_dim=head_dim)
    if backend == "auto":
        for candidate in ("triton", "flex", "torch"):
            if (candidate in supported and quant_unsupported_reason(candidate, quant, method) is None
                    and runs_on(candidate, device, needs_grad, **call)):
                return candidate
        return "reference"
    if backend not in supported:
        raise ValueError(f"backend {backend!r} is not available for method {method!r}; "
                         f"available: {list(supported) + ['auto']}")
    reason = quant_unsupported_reason(backend, quant, method)
    if reason is not None:
        raise ValueError(f"backend {backend!r} cannot run method {method!r} with config key 'quant': {reason}")
    if backend == "flex":
        reason = flex.unsupported_reason(device, dtype, needs_grad, needs_lse, blocks, head_dim)
        if reason is not None:
            raise ValueError(f"backend 'flex' cannot run this call for method {method!r}: {reason}")
    return backend


def runs_on(backend: str, device: torch.device, needs_grad: bool, *, needs_lse: bool = False,
            dtype: torch.dtype = torch.float32, blocks: tuple[int, ...] = (), head_dim: int | None = None) -> bool:
    """Whether ``backend`` can run this call (forward, backward if ``needs_grad``, LSE if ``needs_lse``)."""
    if backend in ("reference", "torch"):
        return True
    if backend == "flex":
        return flex.unsupported_reason(device, dtype, needs_grad, needs_lse, blocks, head_dim) is None
    if backend == "triton":
        if importlib.util.find_spec("triton") is None:
            return False
        return device.type == "cuda" or (device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")
    return False


def sparse_primitives(backend: str):
    """Module with the sparse primitives (``block_sparse_attention``, ``llsa_attention``; optionally
    ``fp8_block_sparse_attention``, a fused FP8 forward used for ``quant``) of ``backend``
    (``triton``'s is imported on first use, so flexsparse imports without triton installed)."""
    if backend == "triton":
        from . import triton_sparse
        return triton_sparse
    return _PRIMITIVES[backend]
