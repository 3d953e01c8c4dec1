"""Tile-size overrides for tuning: ``FLEXSPARSE_TRITON_TILES='{"fwd": {"BM": 64}, "bwd": {"QR": 64}}'``.

Keys are those of ``llsa_fwd.forward_tiles`` and ``llsa_bwd.backward_tiles``; read at every call.
"""
from __future__ import annotations

import json
import os


def overrides(kind: str) -> dict:
    """The overrides of ``kind`` (``"fwd"`` or ``"bwd"``) from the environment, ``{}`` when unset."""
    text = os.environ.get("FLEXSPARSE_TRITON_TILES")
    if not text:
        return {}
    table = json.loads(text)
    if not isinstance(table, dict) or not all(isinstance(v, dict) for v in table.values()):
        raise ValueError(f"FLEXSPARSE_TRITON_TILES must map 'fwd'/'bwd' to dicts, got {text!r}")
    return table.get(kind, {})
