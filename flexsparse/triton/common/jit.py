"""Jitted helpers shared by the Triton kernels of every op family, and the columns of LLSA's level table
(``flexsparse.masks.levels``) as kernel constants."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...masks import levels
from .._runtime.sizes import cdiv, pow2

# Columns of the level table (``masks.levels``) and math constants, usable inside kernels and on the host.
T, KV_OFF, TOPK, SEL_OFF, CSC_OFF, SPAN = (tl.constexpr(getattr(levels, name))
                                           for name in ("T", "KV_OFF", "TOPK", "SEL_OFF", "CSC_OFF", "SPAN"))
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def program_heads(H):
    """``(bh, b, h)``: ``program_id(1)`` as batch x query head. (Helpers that compute store addresses take no
    tensor pointer: ``torch.compile``'s write analysis taints a helper's results with all of its arguments.)"""
    bh = tl.program_id(1)
    b = bh // H
    return bh, b, bh - b * H


@triton.jit
def token_tile(x_b, x_h, x_n, H, N, D: tl.constexpr, BD: tl.constexpr, TILE: tl.constexpr):
    """Program ``(pid, b * H + h)``'s tile of ``TILE`` token rows of a ``(B, H, N, D)`` tensor with strides
    ``(x_b, x_h, x_n, 1)``: ``(bh, rows, dim, ok, src, dst)``, the int64 element offsets of the ``(TILE, BD)`` tile
    in that tensor (``src``) and in a contiguous one of the same shape (``dst``), ``ok`` its mask (rows below N,
    dims below D)."""
    bh, b, h = program_heads(H)
    rows = tl.program_id(0) * TILE + tl.arange(0, TILE)
    dim = tl.arange(0, BD)
    ok = (rows < N)[:, None] & (dim < D)[None, :]
    src = b.to(tl.int64) * x_b + h.to(tl.int64) * x_h + rows.to(tl.int64)[:, None] * x_n + dim[None, :]
    dst = bh.to(tl.int64) * N * D + rows.to(tl.int64)[:, None] * D + dim[None, :]
    return bh, rows, dim, ok, src, dst


def token_tiles(x: torch.Tensor) -> tuple[tuple[int, int], dict]:
    """Grid and ``(BD, TILE)`` of a kernel of ``token_tile`` programs over ``x (B, H, N, D)``: 8192 elements (at
    least 16 rows) per program."""
    bsz, heads, n, d = x.shape
    bd = pow2(d, 16)
    tile = max(16, 8192 // bd)
    return (cdiv(n, tile), bsz * heads), dict(BD=bd, TILE=tile)


@triton.jit
def mm(a, b, IEEE: tl.constexpr):
    """``a @ b`` with fp32 accumulation; exact fp32 products when ``IEEE`` (no TF32)."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def dkv_step(q, do, lse2, delta, row_ok, k, v, bias, dk, dv, SCALE2: tl.constexpr, IEEE: tl.constexpr):
    """Key-major update for keys ``k, v (BK, BD)`` with logit bias ``bias (BK,)`` and queries
    ``q, do (QR, BD)``: ``dv += P^T dO``, ``dk += dS^T Q`` (unscaled). Works on ``S^T (BK, QR)`` so
    that every matrix product's first operand is a plain loaded tile or a computed one."""
    s_t = mm(k, tl.trans(q), IEEE) * SCALE2 + bias[:, None]
    p_t = tl.where(row_ok[None, :], tl.exp2(s_t - lse2[None, :]), 0.0)
    ds_t = p_t * (mm(v, tl.trans(do), IEEE) - delta[None, :])
    dv += mm(p_t.to(do.dtype), do, IEEE)
    dk += mm(ds_t.to(q.dtype), q, IEEE)
    return dk, dv


@triton.jit
def backward_rows(q_base, do_base, lse_base, delta_base, n, n_ok, q_n, do_n, dim, D: tl.constexpr):
    """What a dK/dV step reads of query rows ``n`` (``n_ok``) of one head: q, dO (``(N, D)`` rows, row strides
    ``q_n``, ``do_n``), the LSE in log2 units and Delta (``(N,)``; LSE in natural log)."""
    q = load_rows(q_base, n, q_n, dim, n_ok, D)
    do = load_rows(do_base, n, do_n, dim, n_ok, D)
    lse2 = tl.load(lse_base + n, mask=n_ok, other=0.0) * LOG2E
    delta = tl.load(delta_base + n, mask=n_ok, other=0.0)
    return q, do, lse2, delta


@triton.jit
def dkv_rows(q_base, do_base, lse_base, delta_base, lo, hi, q_n, do_n, dim, k, v, bias, dk, dv, D: tl.constexpr,
             QR: tl.constexpr, SCALE2: tl.constexpr, IEEE: tl.constexpr):
    """``dkv_step`` over query rows ``[lo, hi)`` of one head in steps of ``QR`` (``backward_rows``' arguments)."""
    for n0 in range(lo, hi, QR):
        n = n0 + tl.arange(0, QR)
        n_ok = n < hi
        q, do, lse2, delta = backward_rows(q_base, do_base, lse_base, delta_base, n, n_ok, q_n, do_n, dim, D)
        dk, dv = dkv_step(q, do, lse2, delta, n_ok, k, v, bias, dk, dv, SCALE2, IEEE)
    return dk, dv


@triton.jit
def softmax_step(x, scale, v, m, l, acc, IEEE: tl.constexpr):
    """Online-softmax update of ``(m, l, acc)`` with logits ``x * scale`` (log2 units; ``x (BM, BN)``, ``scale > 0`` a
    scalar) and values ``v (BN, BD)``; or batched: ``x (W, BM, BN)``, ``v (W, BN, BD)``. The row max is taken on
    ``x`` (``max(x) scale`` is ``max(x scale)`` exactly: rounding is monotone), so each logit costs one FMA in
    ``exp2(x scale - m)``."""
    m_new = tl.maximum(m, tl.max(x, axis=-1) * scale)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_use)
    p = tl.exp2(x * scale - tl.expand_dims(m_use, -1))
    l = l * alpha + tl.sum(p, axis=-1)
    acc = acc * tl.expand_dims(alpha, -1) + mm(p.to(v.dtype), v, IEEE)
    return m_new, l, acc


@triton.jit
def log2_count(tok, span, n):
    """``log2`` of the number of real fine tokens under level tokens ``tok`` of ``span``; -inf for padding."""
    count = tl.minimum(n - tok * span, span)
    return tl.where(count > 0, tl.log2(tl.maximum(count, 1).to(tl.float32)), float("-inf"))


@triton.jit
def sparse_keys(row_ptr, e, n_keys, topk, BLOCK: tl.constexpr):
    """Key slots ``e`` of consecutive selection rows at ``row_ptr`` (``topk`` ids each, ``BLOCK`` children
    per id). Returns ``(row, child token, in range)``: slot e is child ``e % BLOCK`` of entry
    ``(e // BLOCK) % topk`` of row ``e // (topk * BLOCK)``."""
    per_row = topk * BLOCK
    row = e // per_row
    rest = e - row * per_row
    entry = rest // BLOCK
    ok = e < n_keys
    parent = tl.load(row_ptr + row * topk + entry, mask=ok, other=0)
    return row, parent * BLOCK + (rest - entry * BLOCK), ok


@triton.jit
def load_rows(base, rows, stride, dim, row_ok, D: tl.constexpr):
    """Rows ``rows`` of a ``(tokens, D)`` slab at ``base``: ``(len(rows), BD)``, zeros where masked."""
    ptr = base + rows.to(tl.int64)[:, None] * stride + dim[None, :]
    return tl.load(ptr, mask=row_ok[:, None] & (dim[None, :] < D), other=0.0)


@triton.jit
def store_rows(base, x, rows, stride, dim, row_ok, D: tl.constexpr):
    """Store ``x (len(rows), BD)`` into rows ``rows`` of a ``(tokens, D)`` slab at ``base``."""
    ptr = base + rows.to(tl.int64)[:, None] * stride + dim[None, :]
    tl.store(ptr, x.to(base.dtype.element_ty), mask=row_ok[:, None] & (dim[None, :] < D))


@triton.jit
def load_tile(base, rows, stride, dim, row_ok, D: tl.constexpr, BD: tl.constexpr, MASK_ROWS: tl.constexpr):
    """Rows ``rows`` of a ``(tokens, D)`` slab at ``base``: ``(len(rows), BD)``. Masked (zeros) by ``row_ok``
    only with ``MASK_ROWS`` and on the head dim only when ``BD > D``: the even case loads without masks."""
    ptr = base + rows.to(tl.int64)[:, None] * stride + dim[None, :]
    if MASK_ROWS:
        if BD == D:
            return tl.load(ptr, mask=row_ok[:, None], other=0.0)
        else:
            return tl.load(ptr, mask=row_ok[:, None] & (dim[None, :] < D), other=0.0)
    else:
        if BD == D:
            return tl.load(ptr)
        else:
            return tl.load(ptr, mask=dim[None, :] < D, other=0.0)


@triton.jit
def store_tile(base, x, rows, stride, dim, row_ok, D: tl.constexpr, BD: tl.constexpr, MASK_ROWS: tl.constexpr):
    """Store ``x (len(rows), BD)`` into rows ``rows`` of a ``(tokens, D)`` slab (masks as ``load_tile``)."""
    ptr = base + rows.to(tl.int64)[:, None] * stride + dim[None, :]
    x = x.to(base.dtype.element_ty)
    if MASK_ROWS:
        if BD == D:
            tl.store(ptr, x, mask=row_ok[:, None])
        else:
            tl.store(ptr, x, mask=row_ok[:, None] & (dim[None, :] < D))
    else:
        if BD == D:
            tl.store(ptr, x)
        else:
            tl.store(ptr, x, mask=dim[None, :] < D)


@triton.jit
def load_slab(base, rows, stride, dim, D: tl.constexpr, BD: tl.constexpr):
    """Rows ``rows (W, R)`` of a ``(tokens, D)`` slab at ``base``: ``(W, R, BD)`` (the batched form of
    ``load_tile`` without row masks), zeros past the head dim ``D``."""
    ptr = base + rows.to(tl.int64)[:, :, None] * stride + dim[None, None, :]
    if BD == D:
        return tl.load(ptr)
    else:
        return tl.load(ptr, mask=dim[None, None, :] < D, other=0.0)


@triton.jit
def store_slab(base, x, rows, stride, dim, row_ok, D: tl.constexpr, BD: tl.constexpr, MASK_ROWS: tl.constexpr):
    """Store ``x (W, R, BD)`` into rows ``rows (W, R)`` of a ``(tokens, D)`` slab; with ``MASK_ROWS`` only where
    ``row_ok`` (broadcast to ``(W, R)``)."""
    ptr = base + rows.to(tl.int64)[:, :, None] * stride + dim[None, None, :]
    x = x.to(base.dtype.element_ty)
    if MASK_ROWS:
        tl.store(ptr, x, mask=row_ok[:, :, None] & (dim[None, None, :] < D))
    elif BD == D:
        tl.store(ptr, x)
    else:
        tl.store(ptr, x, mask=dim[None, None, :] < D)


@triton.jit
def store_row_values(base, x, rows, row_ok, MASK_ROWS: tl.constexpr):
    """Store ``x (len(rows),)`` (one value per row, e.g. the LSE) at ``base + rows``, masked by ``row_ok`` only with
    ``MASK_ROWS``."""
    if MASK_ROWS:
        tl.store(base + rows, x, mask=row_ok)
    else:
        tl.store(base + rows, x)
