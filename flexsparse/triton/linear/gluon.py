"""The Gluon kernel of the linear branch (``mix_ws``: the block-sparse forward with the linear branch's output in
its epilogue), or ``None`` where the block-sparse Gluon kernels are unavailable (``block_sparse.gluon``)."""
from __future__ import annotations

from ..block_sparse.gluon import block_fwd_ws

if block_fwd_ws is not None:
    from . import mix_ws
else:
    mix_ws = None

__all__ = ["mix_ws"]
