"""Block means of q and k in one launch: a block method's pooled q and k (``Backend.block_pooling``: the routers'
inputs), or of q, k and v with their rounded copies (``Backend.coarse_pooling``: VSA's router inputs and coarse
tiles), where the call is small enough that its host time, not the GPU's, sets its cost.

A program sums ``STEP`` consecutive blocks of one head, one row of each block per step (fp32), and stores their true
means (a ragged tail block's over its real tokens), for k in ``pair_means`` their sums (the routers' key mean) and
in ``coarse_means`` the means rounded to the input dtype. ``program_id(2)`` picks q, k (or v); programs past a
tensor's blocks or heads store nothing. ``coarse_grads``, ``coarse_means``' backward, spreads each block's gradient
over its token count to its rows in the input dtype. Against the PyTorch path (a sum and a division per tensor, and
a cast per rounded copy) each is one launch; ``pair_runs`` keeps them to the sizes where the launch count matters,
and larger calls take the PyTorch reductions, whose passes run at full memory bandwidth.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._runtime.registry import launcher
from .._runtime.sizes import cdiv, pow2

PAIR_ELEMENTS = 1 << 25   # q and k elements up to which the pair kernel pools (both of B2 H8 N16384 D64)
TILE_ELEMENTS = 1024      # block sums per program times the padded head dim


def pair_runs(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether ``pair_means`` / ``coarse_means`` pool this call: at most ``PAIR_ELEMENTS`` elements of q and k
    together."""
    return q.numel() + k.numel() <= PAIR_ELEMENTS


@triton.jit
def _block_means(src, stride, MEANS, SUMS, ROUNDED, pid, N, T, D: tl.constexpr, BD: tl.constexpr, BLOCK: tl.constexpr,
                 STEP: tl.constexpr, HAS_MEANS: tl.constexpr, HAS_SUMS: tl.constexpr, HAS_ROUNDED: tl.constexpr):
    """Means (with ``HAS_MEANS``, fp32), sums (``HAS_SUMS``) and means rounded to ``ROUNDED``'s dtype
    (``HAS_ROUNDED``) of blocks ``pid * STEP ...`` of ``BLOCK`` rows of ``src`` (row stride ``stride``, ``N`` rows)
    into rows of ``T`` blocks of ``D`` (contiguous)."""
    t = pid * STEP + tl.arange(0, STEP)
    dim = tl.arange(0, BD)
    cols = dim[None, :] < D
    total = tl.zeros([STEP, BD], tl.float32)
    for j in range(BLOCK):
        row = t * BLOCK + j
        total += tl.load(src + row.to(tl.int64)[:, None] * stride + dim[None, :], mask=(row < N)[:, None] & cols,
                         other=0.0).to(tl.float32)
    count = tl.maximum(tl.minimum(N - t * BLOCK, BLOCK), 1).to(tl.float32)
    out = t.to(tl.int64)[:, None] * D + dim[None, :]
    ok = (t < T)[:, None] & cols
    means = total / count[:, None]
    if HAS_MEANS:
        tl.store(MEANS + out, means, mask=ok)
    if HAS_SUMS:
        tl.store(SUMS + out, total, mask=ok)
    if HAS_ROUNDED:
        tl.store(ROUNDED + out, means.to(ROUNDED.dtype.element_ty), mask=ok)


@triton.jit
def _pair_means_kernel(Q, K, QM, KM, KS, q_b, q_h, q_n, k_b, k_h, k_n, H, HK, NQ, NK, TQ, TK, D: tl.constexpr,
                       BD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, STEP_Q: tl.constexpr,
                       STEP_K: tl.constexpr):
    """``_block_means`` of q's head ``program_id(1)`` (``program_id(2) == 0``) or of k's (KV heads past ``HK``
    return); outputs ``(B, H or HK, T, D)`` contiguous fp32."""
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    if tl.program_id(2) == 0:
        b = bh // H
        h = bh - b * H
        _block_means(Q + b.to(tl.int64) * q_b + h.to(tl.int64) * q_h, q_n, QM + bh.to(tl.int64) * TQ * D, QM, QM,
                     pid, NQ, TQ, D, BD, BLOCK_Q, STEP_Q, True, False, False)
    elif bh < (tl.num_programs(1) // H) * HK:
        b = bh // HK
        h = bh - b * HK
        head = bh.to(tl.int64) * TK * D
        _block_means(K + b.to(tl.int64) * k_b + h.to(tl.int64) * k_h, k_n, KM + head, KS + head, KM, pid, NK, TK, D,
                     BD, BLOCK_K, STEP_K, True, True, False)


@triton.jit
def _coarse_means_kernel(Q, K, V, QM, KM, QC, KC, VC, q_b, q_h, q_n, k_b, k_h, k_n, v_b, v_h, v_n, H, HK, NQ, NK,
                         TQ, TK, D: tl.constexpr, BD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
                         STEP_Q: tl.constexpr, STEP_K: tl.constexpr):
    """``_block_means`` of q's head ``program_id(1)`` (``program_id(2) == 0``: fp32 and rounded), of k's (1: fp32 and
    rounded) or of v's (2: rounded); KV heads past ``HK`` return. Outputs ``(B, H or HK, T, D)`` contiguous."""
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    which = tl.program_id(2)
    if which == 0:
        b = bh // H
        h = bh - b * H
        head = bh.to(tl.int64) * TQ * D
        _block_means(Q + b.to(tl.int64) * q_b + h.to(tl.int64) * q_h, q_n, QM + head, QM, QC + head, pid, NQ, TQ, D,
                     BD, BLOCK_Q, STEP_Q, True, False, True)
    elif bh < (tl.num_programs(1) // H) * HK:
        b = bh // HK
        h = bh - b * HK
        head = bh.to(tl.int64) * TK * D
        if which == 1:
            _block_means(K + b.to(tl.int64) * k_b + h.to(tl.int64) * k_h, k_n, KM + head, KM, KC + head, pid, NK, TK,
                         D, BD, BLOCK_K, STEP_K, True, False, True)
        else:
            _block_means(V + b.to(tl.int64) * v_b + h.to(tl.int64) * v_h, v_n, VC, VC, VC + head, pid, NK, TK, D, BD,
                         BLOCK_K, STEP_K, False, False, True)


@triton.jit
def _spread_block_grads(GT, GM, OUT, pid, N, T, D: tl.constexpr, BD: tl.constexpr, BLOCK: tl.constexpr,
                        STEP: tl.constexpr, MODE: tl.constexpr):
    """The gradient of block means: blocks ``pid * STEP ...`` of the means' gradient (``MODE`` 1: ``GT``'s, of the
    rounded means; 2: ``GM``'s, fp32; 3: their sum, ``GM + GT`` in fp32), divided by the block's token count, into
    its ``BLOCK`` rows of ``OUT`` (``N`` rows of ``D``, contiguous) in OUT's dtype."""
    t = pid * STEP + tl.arange(0, STEP)
    dim = tl.arange(0, BD)
    cols = dim[None, :] < D
    at = t.to(tl.int64)[:, None] * D + dim[None, :]
    ok = (t < T)[:, None] & cols
    grad = tl.zeros([STEP, BD], tl.float32)
    if MODE >= 2:
        grad += tl.load(GM + at, mask=ok, other=0.0)
    if MODE != 2:
        grad += tl.load(GT + at, mask=ok, other=0.0).to(tl.float32)
    grad = (grad / tl.maximum(tl.minimum(N - t * BLOCK, BLOCK), 1).to(tl.float32)[:, None]).to(OUT.dtype.element_ty)
    for j in range(BLOCK):
        row = t * BLOCK + j
        tl.store(OUT + row.to(tl.int64)[:, None] * D + dim[None, :], grad, mask=(row < N)[:, None] & cols)


@triton.jit
def _coarse_grads_kernel(GQT, GQM, GKT, GKM, GVT, DQ, DK, DV, H, HK, NQ, NK, TQ, TK, D: tl.constexpr,
                         BD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, STEP_Q: tl.constexpr,
                         STEP_K: tl.constexpr, MODE_Q: tl.constexpr, MODE_K: tl.constexpr, MODE_V: tl.constexpr):
    """``coarse_means``' backward: ``_spread_block_grads`` of q's (``program_id(2) == 0``), k's (1) or v's (2)
    gradients of head ``program_id(1)`` (``MODE`` 0: none); KV heads past ``HK`` return."""
    pid = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    which = tl.program_id(2)
    if which == 0:
        if MODE_Q != 0:
            _spread_block_grads(GQT + bh * TQ * D, GQM + bh * TQ * D, DQ + bh * NQ * D, pid, NQ, TQ, D, BD, BLOCK_Q,
                                STEP_Q, MODE_Q)
    elif bh < (tl.num_programs(1) // H) * HK:
        if which == 1:
            if MODE_K != 0:
                _spread_block_grads(GKT + bh * TK * D, GKM + bh * TK * D, DK + bh * NK * D, pid, NK, TK, D, BD,
                                    BLOCK_K, STEP_K, MODE_K)
        elif MODE_V != 0:
            _spread_block_grads(GVT + bh * TK * D, GVT, DV + bh * NK * D, pid, NK, TK, D, BD, BLOCK_K, STEP_K, MODE_V)


def _grid(nq: int, nk: int, d: int, block_q: int, block_k: int) -> dict:
    """The launch geometry the kernels share: block counts, padded head dim, blocks per program, grid width."""
    tq, tk, bd = cdiv(nq, block_q), cdiv(nk, block_k), pow2(d)
    step = max(1, TILE_ELEMENTS // bd)
    step_q, step_k = min(step, pow2(tq)), min(step, pow2(tk))
    return dict(tq=tq, tk=tk, bd=bd, step_q=step_q, step_k=step_k, width=max(cdiv(tq, step_q), cdiv(tk, step_k)))


def pair_means(q: torch.Tensor, k: torch.Tensor, block_q: int, block_k: int):
    """Block means of q ``(B, H, Nq, D)`` over ``block_q`` tokens and of k ``(B, Hk, Nk, D)`` over ``block_k``
    (last dims contiguous), fp32 ``(B, H, Tq, D)`` and ``(B, Hk, Tk, D)``, and k's fp32 block sums like k's means."""
    bsz, heads, nq, d = q.shape
    kv_heads, nk = k.shape[1], k.shape[2]
    g = _grid(nq, nk, d, block_q, block_k)
    q_means = q.new_empty(bsz, heads, g["tq"], d, dtype=torch.float32)
    k_means = q.new_empty(bsz, kv_heads, g["tk"], d, dtype=torch.float32)
    sums = torch.empty_like(k_means)
    launcher(_pair_means_kernel)[(g["width"], bsz * heads, 2)](
        q, k, q_means, k_means, sums, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        heads, kv_heads, nq, nk, g["tq"], g["tk"], D=d, BD=g["bd"], BLOCK_Q=block_q, BLOCK_K=block_k,
        STEP_Q=g["step_q"], STEP_K=g["step_k"])
    return q_means, k_means, sums


def coarse_means(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_q: int, block_k: int):
    """VSA's pooled tiles in one launch: block means of q ``(B, H, Nq, D)`` over ``block_q`` tokens and of k and v
    ``(B, Hk, Nk, D)`` over ``block_k`` (last dims contiguous): ``(q_means, k_means, q_coarse, k_coarse,
    v_coarse)``, q's and k's means in fp32 ``(B, H, Tq, D)`` / ``(B, Hk, Tk, D)`` and all three rounded to their
    dtypes."""
    bsz, heads, nq, d = q.shape
    kv_heads, nk = k.shape[1], k.shape[2]
    g = _grid(nq, nk, d, block_q, block_k)
    q_means = q.new_empty(bsz, heads, g["tq"], d, dtype=torch.float32)
    k_means = q.new_empty(bsz, kv_heads, g["tk"], d, dtype=torch.float32)
    q_coarse, k_coarse, v_coarse = q.new_empty(q_means.shape), k.new_empty(k_means.shape), v.new_empty(k_means.shape)
    launcher(_coarse_means_kernel)[(g["width"], bsz * heads, 3)](
        q, k, v, q_means, k_means, q_coarse, k_coarse, v_coarse, q.stride(0), q.stride(1), q.stride(2), k.stride(0),
        k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), heads, kv_heads, nq, nk, g["tq"], g["tk"], D=d,
        BD=g["bd"], BLOCK_Q=block_q, BLOCK_K=block_k, STEP_Q=g["step_q"], STEP_K=g["step_k"])
    return q_means, k_means, q_coarse, k_coarse, v_coarse


def coarse_grads(q_shape, k_shape, dtypes, grads, needed, block_q: int, block_k: int):
    """``coarse_means``' backward in one launch: ``(dq, dk, dv)`` in ``dtypes`` (``None`` where not ``needed`` or
    without a gradient) from ``grads = (d_q_means, d_k_means, d_q_tiles, d_k_tiles, d_v_tiles)`` (contiguous,
    ``None`` where absent): each block's gradient (the fp32 mean's plus the rounded mean's) over its token count,
    broadcast to its tokens (q ``q_shape``, k and v ``k_shape``)."""
    d_qm, d_km, d_qt, d_kt, d_vt = grads
    modes = [0 if not need else (1 if tiles is not None else 0) + (2 if means is not None else 0)
             for need, means, tiles in zip(needed, (d_qm, d_km, None), (d_qt, d_kt, d_vt))]
    present = next(g for g in grads if g is not None)
    outs = [present.new_empty(shape, dtype=dtype) if mode else None
            for mode, shape, dtype in zip(modes, (q_shape, k_shape, k_shape), dtypes)]
    bsz, heads, nq, d = q_shape
    g = _grid(nq, k_shape[2], d, block_q, block_k)
    launcher(_coarse_grads_kernel)[(g["width"], bsz * heads, 3)](
        *(present if x is None else x for x in (d_qt, d_qm, d_kt, d_km, d_vt, *outs)), heads, k_shape[1], nq,
        k_shape[2], g["tq"], g["tk"], D=d, BD=g["bd"], BLOCK_Q=block_q, BLOCK_K=block_k, STEP_Q=g["step_q"],
        STEP_K=g["step_k"], MODE_Q=modes[0], MODE_K=modes[1], MODE_V=modes[2])
    return tuple(outs)
