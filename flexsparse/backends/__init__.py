"""Backends: ``reference`` (dense spec), ``torch`` (gather-based), ``flex`` and ``triton``.

A method module declares which backends it supports; ``resolve`` turns ``"auto"`` into a concrete
backend and rejects unavailable ones with a clear error.
"""
from __future__ import annotations

import torch

BACKENDS = ("reference", "torch", "flex", "triton", "auto")


def resolve(backend: str, method: str, supported: tuple[str, ...], device: torch.device, needs_grad: bool) -> str:
    """Concrete backend for ``method`` on ``device``: the preference order for ``"auto"`` is
    triton, flex, torch (each where it is supported and runs)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; valid backends: {list(BACKENDS)}")
    if backend == "auto":
        for candidate in ("triton", "flex", "torch"):
            if candidate in supported and runs_on(candidate, device, needs_grad):
                return candidate
        return "reference"
    if backend not in supported:
        raise ValueError(f"backend {backend!r} is not available for method {method!r}; "
                         f"available: {list(supported) + ['auto']}")
    return backend


def runs_on(backend: str, device: torch.device, needs_grad: bool) -> bool:
    """Whether ``backend`` can run (forward, and backward if ``needs_grad``) on ``device``."""
    if backend in ("reference", "torch"):
        return True
    if backend == "flex":
        return device.type == "cuda" or not needs_grad
    if backend == "triton":
        return device.type == "cuda"
    return False
