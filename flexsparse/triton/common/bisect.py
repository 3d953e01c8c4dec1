"""Exact per-row top-K of fp32 scores by bisection on order-preserving int32 keys.

Shared by the single-level block top-K (``selection.block_topk``: one row of up to 16K keys per program) and
LLSA's hierarchical selection (``selection.hierarchy``: rows too wide for its packed search, e.g. the ``b`` child
rows of a parent with more than 128 candidates each). A row's order is (largest score, then smallest column);
callers lay columns out in id order, so ties go to the smallest id. Scores become int32 keys with the order of
the floats (``ordered_key``); the K-th largest key of every row is found exactly by bisection (one count of
``key >= mid`` per row and pass, all rows in lock-step), then the ties at the threshold are taken by column.
"""
from __future__ import annotations

import triton
import triton.language as tl

INT_MIN = tl.constexpr(-2147483648)  # the key of padding: never taken
INT_MAX = tl.constexpr(2147483647)
VALUE_PASSES = tl.constexpr(24)  # bisection passes at halfway values before halfway keys (see first_k_rows)


@triton.jit
def ordered_key(x):
    """int32 keys with the order of the fp32 values ``x``: ``-0.0`` as ``+0.0``, every NaN above ``+inf`` as
    ``2^31 - 2`` (``torch.sort``'s order). Keys lie in ``(INT_MIN, INT_MAX)``, and so do their complements.
    Zero is tested on the bits: a float compare flushes subnormals to zero on the GPU."""
    bits = x.to(tl.int32, bitcast=True)
    key = tl.where((bits & 0x7FFFFFFF) == 0, 0, bits ^ ((bits >> 31) & 0x7FFFFFFF))
    return tl.where(x != x, 2147483646, key)


@triton.jit
def key_value(key):
    """The fp32 value of an ordered key (inverse of ``ordered_key`` on non-NaN keys)."""
    return tl.where(key < 0, key ^ 0x7FFFFFFF, key).to(tl.float32, bitcast=True)


@triton.jit
def midpoint(lo, hi, VALUE: tl.constexpr, SMALLEST: tl.constexpr):
    """Split points in ``(lo, hi]`` (int64, ``lo <= hi``; ``lo`` where they are equal): the halfway key, or
    with ``VALUE`` the key of the halfway fp32 value when that one lies inside (fewer passes on scores spread
    around zero, whose keys crowd into a few exponents). Keys are read as ``~key`` with ``SMALLEST``."""
    mid = lo + (hi - lo + 1) // 2
    if VALUE:
        a = lo.to(tl.int32)
        b = hi.to(tl.int32)
        if SMALLEST:
            a, b = ~a, ~b
        m = ordered_key(key_value(a) * 0.5 + key_value(b) * 0.5)
        if SMALLEST:
            m = ~m
        m = m.to(tl.int64)
        mid = tl.where((m > lo) & (m <= hi), m, mid)
    return mid


@triton.jit
def first_k_rows(key, count, pad, SMALLEST: tl.constexpr, TIES_BY_SCAN: tl.constexpr = False):
    """Mask ``(R, C)`` of the ``count`` largest keys of each row of ``key (R, C)`` (or ``(W, R, C)``: rows along the
    last axis), ties at the threshold to the smallest columns; with ``SMALLEST`` the ``count`` smallest, ties to
    the largest columns (the same search over ``~key``, with reversed compares instead of a second array).
    Padding keys hold ``INT_MIN`` (never taken; ``pad`` of them per row, counted only with ``SMALLEST``);
    ``1 <= count <=`` the real keys of a row.

    Invariant per row: at least ``count`` keys >= lo; fewer than ``count`` keys > hi, or exactly ``count``
    keys >= hi = lo (keys read as ``~key`` with ``SMALLEST``: ``~key >= m`` is ``key <= ~m``, which counts the
    padding too). The first ``VALUE_PASSES`` passes split at halfway values, the rest at halfway keys: at most
    ``VALUE_PASSES + 32``. A finished row (lo == hi) stays put: its split point is lo itself. ``TIES_BY_SCAN``:
    how the ties at the threshold are cut (see the comment there; same result either way)."""
    least = tl.min(tl.where(key == INT_MIN, INT_MAX, key), axis=-1)
    most = tl.max(key, axis=-1)
    if SMALLEST:
        lo, hi = (~most).to(tl.int64), (~least).to(tl.int64)
    else:
        lo, hi = least.to(tl.int64), most.to(tl.int64)
    passes = 0
    while tl.max((lo < hi).to(tl.int32)) > 0:
        if passes < VALUE_PASSES:
            mid = midpoint(lo, hi, True, SMALLEST)
        else:
            mid = midpoint(lo, hi, False, SMALLEST)
        if SMALLEST:
            n = tl.sum((key <= tl.expand_dims(~mid.to(tl.int32), -1)).to(tl.int32), axis=-1) - pad
        else:
            n = tl.sum((key >= tl.expand_dims(mid.to(tl.int32), -1)).to(tl.int32), axis=-1)
        hi = tl.where(n == count, mid, tl.where(n > count, hi, mid - 1))
        lo = tl.where(n >= count, mid, lo)
        passes += 1
    threshold = lo.to(tl.int32)  # a real key's range: padding is never tied
    if SMALLEST:
        threshold = ~threshold
    return take_from(key, threshold, count, pad, SMALLEST, TIES_BY_SCAN)


@triton.jit
def take_from(key, threshold, count, pad, SMALLEST: tl.constexpr, TIES_BY_SCAN: tl.constexpr):
    """``first_k_rows``' mask given each row's threshold ``(R,)`` (the ``count``-th largest key, or smallest with
    ``SMALLEST``): the keys beyond it and the ties at it up to ``count``, ties to the smallest columns (the largest
    with ``SMALLEST``)."""
    bound = tl.expand_dims(threshold, -1)
    if SMALLEST:
        need = count - tl.sum((key < bound).to(tl.int32), axis=-1) + pad
    else:
        need = count - tl.sum((key > bound).to(tl.int32), axis=-1)
    ties = key == bound
    tied = tl.sum(ties.to(tl.int32), axis=-1)
    # the ties taken: columns <= cut (top) or >= cut (SMALLEST). Where some are left out, the cut is the column of
    # the target-th tie from the left: by a prefix sum with TIES_BY_SCAN, else by bisection over the columns (the
    # prefix sum, even when no row needs it, made block_topk's kernel ~35x slower at 512 columns on an H100 with
    # triton 3.6; LLSA's selection on 16 x 128 candidate rows took 0.167 ms with it against 0.188:
    # docs/triton_sla_pieces.md)
    width: tl.constexpr = key.shape[-1]
    cols = tl.arange(0, width)
    cut = tl.zeros_like(need) + (0 if SMALLEST else width)
    if tl.max((need < tied).to(tl.int32)) > 0:
        target = tied - need + 1 if SMALLEST else need
        if TIES_BY_SCAN:
            seen = tl.cumsum(ties.to(tl.int32), -1)
            first = tl.min(tl.where(seen == tl.expand_dims(target, -1), cols, width), axis=-1)
        else:
            first = tl.zeros_like(need)
            last = tl.zeros_like(need) + (width - 1)
            while tl.max((first < last).to(tl.int32)) > 0:
                half = (first + last) // 2
                enough = tl.sum((ties & (cols <= tl.expand_dims(half, -1))).to(tl.int32), axis=-1) >= target
                last = tl.where(enough, half, last)
                first = tl.where(enough, first, half + 1)
        cut = tl.where(need < tied, first, cut)
    if SMALLEST:
        return ((key < bound) & (key != INT_MIN)) | (ties & (cols >= tl.expand_dims(cut, -1)))
    else:
        return (key > bound) | (ties & (cols <= tl.expand_dims(cut, -1)))


@triton.jit
def store_taken(out_rows, taken, values):
    """Store ``values (C,)`` where ``taken (R, C)``, row r packed from ``out_rows[r]`` in column order; or batched:
    ``values (W, C)``, ``taken (W, R, C)``, ``out_rows (W, R)``."""
    slot = tl.cumsum(taken.to(tl.int32), -1) - 1
    tl.store(tl.expand_dims(out_rows, -1) + slot, tl.expand_dims(values, -2) + tl.zeros_like(slot), mask=taken)
