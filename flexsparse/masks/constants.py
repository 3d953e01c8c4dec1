"""Small read-only device tensors kept per key for eager calls (LLSA's level tables, the identity program order):
building one on a CUDA device launches an op, or copies from the host and waits, on every call."""
from __future__ import annotations

from typing import Callable, Hashable

import torch

_KEPT: dict = {}


def kept_constant(key: Hashable, like: torch.Tensor, build: Callable[[torch.device], torch.Tensor]) -> torch.Tensor:
    """``build(like.device)``, kept under ``(key, like.device)`` for plain tensors; shared, so callers only read it.

    Traced calls (fake or functional tensors, ``torch.compile``) build it in the graph. Inside a CUDA graph capture
    the kept one is read where an eager call built it (the warm-up before a capture does), else it is built and not
    kept (the capture only records its fill). The first build on a CUDA device waits for its stream, so a later call
    on another stream never reads it unwritten."""
    if type(like) is not torch.Tensor or torch.compiler.is_compiling():
        return build(like.device)
    full_key = (key, like.device)
    kept = _KEPT.get(full_key)
    if kept is None:
        kept = build(like.device)
        if like.is_cuda:
            if torch.cuda.is_current_stream_capturing():
                return kept
            torch.cuda.current_stream(like.device).synchronize()
        _KEPT[full_key] = kept
    return kept
