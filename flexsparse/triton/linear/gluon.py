"""The Gluon kernels of the linear branch (``mix_ws``, ``mix_ws_fp8``: the block-sparse forward, bf16 or FP8, with
the linear branch's output in its epilogue), or ``None`` where the block-sparse Gluon kernels are unavailable
(``block_sparse.gluon``)."""
from __future__ import annotations

from ..block_sparse.gluon import block_fwd_ws

if block_fwd_ws is not None:
    from . import mix_ws, mix_ws_fp8
else:
    mix_ws = mix_ws_fp8 = None

__all__ = ["mix_ws", "mix_ws_fp8"]
