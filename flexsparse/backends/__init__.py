"""Backends: ``reference`` (each method's dense spec), ``torch`` (gather-based PyTorch), ``flex`` (FlexAttention)
and ``triton`` (the ``flexsparse::`` ops). The one place that turns a backend name into where a call runs.

``resolve`` picks the backend of a call (``"auto"``: the fastest that can run it) and rejects unusable ones with a
clear error; the returned ``Backend`` runs every step of the method (``base``), selection included.
"""
from __future__ import annotations

import torch

from ..config import QuantConfig
from .base import Backend
from .flex_backend import FlexBackend
from .reference_backend import ReferenceBackend
from .torch_backend import TorchBackend
from .triton_backend import TritonBackend

BACKENDS: dict[str, Backend] = {b.name: b for b in (ReferenceBackend(), TorchBackend(), FlexBackend(),
                                                    TritonBackend())}
NAMES = (*BACKENDS, "auto")
AUTO_ORDER = ("triton", "flex", "torch")


def resolve(backend: str, method, device: torch.device, needs_grad: bool, *, needs_lse: bool = False,
            dtype: torch.dtype = torch.float32, blocks: tuple[int, ...] = (), head_dim: int | None = None,
            quant: QuantConfig | None = None, batch_heads: int = 1) -> Backend:
    """The backend that runs ``method`` (a ``flexsparse.methods.Method``) for this call. ``"auto"`` takes the first of
    triton, flex, torch that the method supports and that can run the call (else the reference); a named backend
    that cannot raises a ``ValueError`` saying why. ``blocks``: the config's block sizes;
    ``head_dim``: q's D; ``quant``: the config's ``QuantConfig``, which not every backend runs; ``batch_heads``:
    q's B * H."""
    if backend not in NAMES:
        raise ValueError(f"unknown backend {backend!r}; valid backends: {list(NAMES)}")
    call = dict(needs_lse=needs_lse, dtype=dtype, blocks=blocks, head_dim=head_dim, batch_heads=batch_heads)
    if backend == "auto":
        for name in AUTO_ORDER:
            candidate = BACKENDS[name]
            if (name in method.backends and candidate.quant_unsupported(quant, method.sparse_branch) is None
                    and runs_on(name, device, needs_grad, **call)):
                return candidate
        return BACKENDS["reference"]
    if backend not in method.backends:
        raise ValueError(f"backend {backend!r} is not available for method {method.name!r}; "
                         f"available: {list(method.backends) + ['auto']}")
    chosen = BACKENDS[backend]
    reason = chosen.quant_unsupported(quant, method.sparse_branch)
    if reason is not None:
        raise ValueError(f"backend {backend!r} cannot run method {method.name!r} with config key 'quant': {reason}")
    reason = chosen.unsupported(device, dtype, needs_grad, needs_lse, blocks, head_dim, batch_heads)
    if reason is not None:
        raise ValueError(f"backend {backend!r} cannot run this call for method {method.name!r}: {reason}")
    return chosen


def runs_on(backend: str, device: torch.device, needs_grad: bool, *, needs_lse: bool = False,
            dtype: torch.dtype = torch.float32, blocks: tuple[int, ...] = (), head_dim: int | None = None,
            batch_heads: int = 1) -> bool:
    """Whether ``backend`` can run a call on ``device`` (forward, backward if ``needs_grad``, LSE if ``needs_lse``)."""
    chosen = BACKENDS.get(backend)
    return chosen is not None and chosen.unsupported(device, dtype, needs_grad, needs_lse, blocks, head_dim,
                                                     batch_heads) is None


__all__ = ["Backend", "BACKENDS", "NAMES", "resolve", "runs_on"]
