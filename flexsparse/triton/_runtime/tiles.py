"""Tile-size overrides for tuning: ``FLEXSPARSE_TRITON_TILES='{"fwd": {"BM": 64}, "bwd": {"QR": 64}}'``.

Kinds and their keys (modules under ``flexsparse/triton/``): ``fwd`` / ``bwd`` (LLSA: ``llsa.fwd.forward_tiles``,
``llsa.bwd.backward_tiles``), ``block_fwd`` / ``block_bwd`` (block-sparse: ``block_sparse.fwd.forward_tiles``,
``block_sparse.bwd.backward_tiles``),
``linear`` (SLA's masked linear branch, forward and backward: ``linear.fwd.linear_tiles``, keys ``TQ``, ``TK``,
``warps``, ``stages``, ``dense_ratio``, ``dense_ratio_bwd``, ``dq_maxnreg``, ``dkv_maxnreg`` and their ``_split``
forms),
``block_topk`` (``selection.block_topk.topk_tiles``: ``BM``, ``BN``, ``BK``, ``WARPS``, ``STAGES`` of the score
tiles, ``SELECT_WARPS`` per row, ``FUSED_TILE``, ``FUSED_SCORES``, ``FUSED_ROWS``, ``FUSED_WARPS`` of the one-kernel
path of small calls),
``block_fwd_fp8`` (the FP8 forward: ``block_sparse.fwd_fp8.forward_tiles``, ``block_fwd``'s keys, ``fresh_acc`` and
``maxnreg``; any override runs the Triton FP8 kernel where the Gluon one would), ``block_fwd_ws_fp8`` (the Gluon FP8
forward and its mixed SLA kernel: ``block_sparse.fwd_ws_fp8.default_tiles``, keys ``stages``, ``maxnreg``,
``fresh_acc``, ``defer_rescale``, ``pairs``),
``select`` (LLSA's selection: ``parents``, ``top_split``, ``child_split``, ``top_warps``, ``top_precision``,
``bucket``; ``selection.hierarchy``'s module docstring),
``pool`` (LLSA's pooling: ``warps`` of the first pass, ``pooling.pool.first_pass_warps``).
Read at every call; a kind or key that no tile choice reads is an error naming it (``with_overrides``).
"""
from __future__ import annotations

import json
import os


VARIABLE = "FLEXSPARSE_TRITON_TILES"
KINDS = ("fwd", "bwd", "block_fwd", "block_bwd", "linear", "block_topk", "block_fwd_fp8", "block_fwd_ws_fp8", "select",
         "pool")


def _table() -> dict:
    """The environment's table of overrides, ``{}`` when unset; an error that names what is wrong otherwise."""
    text = os.environ.get(VARIABLE)
    if not text:
        return {}
    try:
        table = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"FLEXSPARSE_TRITON_TILES is not JSON ({exc}): {text!r}") from None
    if not isinstance(table, dict) or not all(isinstance(v, dict) for v in table.values()):
        raise ValueError(f"FLEXSPARSE_TRITON_TILES must map kinds ({', '.join(KINDS)}) to dicts, got {text!r}")
    unknown = sorted(set(table) - set(KINDS))
    if unknown:
        raise ValueError(f"FLEXSPARSE_TRITON_TILES has no kind {unknown[0]!r}; the kinds: {', '.join(KINDS)}")
    return table


def overrides(kind: str) -> dict:
    """The overrides of ``kind`` (see the module docstring) from the environment, ``{}`` when unset."""
    return _table().get(kind, {})


def with_overrides(kind: str, base: dict, optional: tuple[str, ...] = ()) -> dict:
    """``base`` updated with ``overrides(kind)``. A key in neither ``base`` nor ``optional`` (keys a kernel reads
    only where it has them) is an error that names it and the kind's keys: a misspelt key would otherwise change
    nothing."""
    given = overrides(kind)
    unknown = sorted(set(given) - set(base) - set(optional)) if given else ()
    if unknown:
        raise ValueError(f"FLEXSPARSE_TRITON_TILES: kind {kind!r} has no key {unknown[0]!r}; its keys: "
                         f"{', '.join(sorted({*base, *optional}))}")
    return {**base, **given}
