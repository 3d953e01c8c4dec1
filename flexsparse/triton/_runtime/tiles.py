"""Tile-size overrides for tuning: ``FLEXSPARSE_TRITON_TILES='{"fwd": {"BM": 64}, "bwd": {"QR": 64}}'``.

Kinds and their keys (modules under ``flexsparse/triton/``): ``fwd`` / ``bwd`` (LLSA: ``llsa.fwd.forward_tiles``,
``llsa.bwd.backward_tiles``), ``block_fwd`` / ``block_bwd`` (block-sparse: ``block_sparse.fwd.forward_tiles``,
``block_sparse.bwd.backward_tiles``),
``linear`` (SLA's masked linear branch, forward and backward: ``linear.fwd.linear_tiles``, keys ``TQ``, ``TK``,
``warps``, ``stages``, ``dense_ratio``, ``dense_ratio_bwd``, ``dq_maxnreg``, ``dkv_maxnreg``),
``block_topk`` (``selection.block_topk.topk_tiles``: ``BM``, ``BN``, ``BK``, ``WARPS``, ``STAGES`` of the score
tiles, ``SELECT_WARPS`` per row, ``FUSED_TILE``, ``FUSED_SCORES``, ``FUSED_ROWS``, ``FUSED_WARPS`` of the one-kernel
path of small calls),
``block_fwd_fp8`` (the FP8 forward: ``block_sparse.fwd_fp8.forward_tiles``, ``block_fwd``'s keys, ``fresh_acc`` and
``maxnreg``),
``select`` (LLSA's selection: ``parents``, ``top_split``, ``child_split``, ``top_warps``, ``top_precision``,
``bucket``; ``selection.hierarchy``'s module docstring),
``pool`` (LLSA's pooling: ``warps`` of the first pass, ``pooling.pool.first_pass_warps``).
Read at every call.
"""
from __future__ import annotations

import json
import os


def overrides(kind: str) -> dict:
    """The overrides of ``kind`` (see the module docstring) from the environment, ``{}`` when unset."""
    text = os.environ.get("FLEXSPARSE_TRITON_TILES")
    if not text:
        return {}
    table = json.loads(text)
    if not isinstance(table, dict) or not all(isinstance(v, dict) for v in table.values()):
        raise ValueError("FLEXSPARSE_TRITON_TILES must map kinds ('fwd', 'bwd', 'block_fwd', 'block_bwd', "
                         f"'linear', 'block_topk', 'block_fwd_fp8', 'select', 'pool') to dicts, got {text!r}")
    return table.get(kind, {})
