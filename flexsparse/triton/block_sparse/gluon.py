"""The Gluon kernel modules of the block-sparse branch (``fwd_ws``, ``fwd_ws_fp8``, ``bwd_ws``), or ``None`` each
where this triton's Gluon (``triton.experimental.gluon``, an experimental API) does not provide what they use: the
Triton kernels then serve every call, and a warning says so once."""
from __future__ import annotations

import warnings

try:
    from . import bwd_ws as block_bwd_ws
    from . import fwd_ws as block_fwd_ws
    from . import fwd_ws_fp8 as block_fwd_ws_fp8
except (ImportError, AttributeError) as exc:  # an older or newer triton whose Gluon API differs
    warnings.warn(f"flexsparse: the Gluon kernels are unavailable with this triton ({exc!r}); the Triton "
                  "kernels run instead (slower on sm_90)", RuntimeWarning, stacklevel=2)
    block_bwd_ws = block_fwd_ws = block_fwd_ws_fp8 = None

__all__ = ["block_bwd_ws", "block_fwd_ws", "block_fwd_ws_fp8"]
