"""Masked linear branch of SLA / SLA2, backward: query-major, then key-major over the CSC of ``skipped``.

With ``y = phi(Q_i) [H_i | Z_i] = [num | den]`` and ``O = num / (eps + den)``:

* ``_query_grad_kernel``: one program per (query block i, batch x query head), from the saved ``H_i``, ``Z_i``
  (with ``PROJ``, SLA's combine ``out = O_s + O W^T + b``: ``dO = d out W`` first, rounded to q's dtype as one
  matmul would round it):
  ``dy = [dO, -rowsum(dO . O)] / (eps + den)`` (O: the forward's output in q's dtype when given, ``SAVED``;
  else recomputed in fp32), ``dphi(Q_i) = dy [H_i | Z_i]^T`` -> dq
  through phi's gradient, and ``d[H_i | Z_i] = phi(Q_i)^T dy`` (stored in ``fwd.state_dtype``). Q is also
  loaded transposed, so ``phi(Q_i)^T`` is a computed register tile (the first operand of every dot is never a
  transposed tile). With the dense strategy a query block of several tiles (e.g. 128 rows) gets one program per
  tile, each storing its tile's partial ``d[H_i | Z_i]``, and the ``keep^T`` matmul sums the partials (its keep
  rows repeated per tile): a program over all tiles keeps the ``D x D`` gradient live across them (255
  registers at D = 128).
* ``_key_grad_kernel``: one program per (key block j, batch x KV head). With ``GATHER``: ``d[h_j | z_j]`` = the
  KV head's total of ``d[H_i | Z_i]`` (all its query heads, fp32 ``torch.sum``) minus those of the query blocks
  that skipped j (the key-major lists of ``csc.block_csc(..., deterministic=True)``, walked for every query
  head of the KV head: no atomics, ascending lists, so bitwise reproducible); without it the sums come from
  ``dense.key_sums`` (``keep^T`` block matmuls). Then ``dphi(K_j) = [V_j | 1] d[h_j | z_j]^T``,
  ``dV_j = phi(K_j) dh_j`` and phi's gradient, in-kernel.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._runtime.registry import launcher
from ..common.csc import block_csc
from .._runtime.sizes import cdiv, pow2
from .fwd import block_tokens, dense, dot, feature, feature_code, feature_grad, linear_tiles, split, state_dtype
from .._runtime.registry import register_cap


@triton.jit
def _query_grad_kernel(Q, DO, W, ROWS_H, ROWS_Z, OL, DQ_ADD, DQ, DHQ, DZQ, EPS: tl.constexpr, NQ, TQ,
                       D: tl.constexpr, BD: tl.constexpr, BLOCK_Q: tl.constexpr, TILE: tl.constexpr,
                       SPLIT: tl.constexpr, FMAP: tl.constexpr, BF16: tl.constexpr, ADD: tl.constexpr,
                       SAVED: tl.constexpr, PROJ: tl.constexpr, PARTS: tl.constexpr):
    part = tl.program_id(0)                        # PARTS programs per query block, SPLIT // PARTS tiles each
    i = part // PARTS
    TILES: tl.constexpr = SPLIT // PARTS
    bh = tl.program_id(1).to(tl.int64)
    dim = tl.arange(0, BD)
    dim_ok = dim < D
    hmask = dim_ok[:, None] & dim_ok[None, :]
    row = bh * TQ + i
    state_h = tl.load(ROWS_H + row * D * D + dim[:, None] * D + dim[None, :], mask=hmask, other=0.0)
    state_z = tl.load(ROWS_Z + row * D + dim, mask=dim_ok, other=0.0)
    d_h = tl.zeros([BD, BD], tl.float32)
    d_z = tl.zeros([BD], tl.float32)
    base = bh * NQ * D
    first = (part % PARTS) * TILES
    for t in range(TILES):                         # constexpr bounds (a runtime range measured slower)
        rows, ok = block_tokens(i, first + t, BLOCK_Q, TILE, NQ)
        mask = ok[:, None] & dim_ok[None, :]
        mask_t = dim_ok[:, None] & ok[None, :]
        ptr = base + rows.to(tl.int64)[:, None] * D + dim[None, :]
        x = tl.load(Q + ptr, mask=mask, other=0.0).to(tl.float32)
        phi = feature(x, mask, 1, FMAP)                                             # (TILE, BD)
        x_t = tl.load(Q + base + rows.to(tl.int64)[None, :] * D + dim[:, None], mask=mask_t, other=0.0)
        phi_t = feature(x_t.to(tl.float32), mask_t, 0, FMAP)                        # (BD, TILE)
        den = EPS + tl.sum(phi * state_z[None, :], axis=1)
        if SAVED:                                  # the forward's O, in q's dtype: one product fewer
            out = tl.load(OL + ptr, mask=mask, other=0.0).to(tl.float32)
        else:
            out = dot(phi, state_h, BF16) / den[:, None]
        g = tl.load(DO + ptr, mask=mask, other=0.0)
        if PROJ:                                   # W (D_out, D_in) in q's dtype, loaded per tile: live briefly
            w = tl.load(W + dim[:, None] * D + dim[None, :], mask=hmask, other=0.0).to(DQ.dtype.element_ty)
            g = dot(g, w, BF16).to(DQ.dtype.element_ty)
        g = g.to(tl.float32)
        dy_num = g / den[:, None]
        dy_den = -tl.sum(g * out, axis=1) / den
        dphi = dot(dy_num, tl.trans(state_h), BF16) + dy_den[:, None] * state_z[None, :]
        dq = feature_grad(x, phi, dphi, 1, FMAP)
        if ADD:
            dq += tl.load(DQ_ADD + ptr, mask=mask, other=0.0).to(tl.float32)
        tl.store(DQ + ptr, dq.to(DQ.dtype.element_ty), mask=mask)
        d_h += dot(phi_t, dy_num, BF16)
        d_z += tl.sum(phi_t * dy_den[None, :], axis=1)
    out_row = bh * TQ * PARTS + part
    tl.store(DHQ + out_row * D * D + dim[:, None] * D + dim[None, :], d_h.to(DHQ.dtype.element_ty), mask=hmask)
    tl.store(DZQ + out_row * D + dim, d_z.to(DZQ.dtype.element_ty), mask=dim_ok)


@triton.jit
def _key_grad_kernel(K, V, DHQ, DZQ, DHT, DZT, OFFSETS, LISTS, DK_ADD, DV_ADD, DK, DV, NK, TQ, TK, L, HK, GROUP,
                     D: tl.constexpr, BD: tl.constexpr, BLOCK_K: tl.constexpr, TILE: tl.constexpr, SPLIT: tl.constexpr,
                     FMAP: tl.constexpr, BF16: tl.constexpr, GATHER: tl.constexpr, STAGES: tl.constexpr,
                     ADD: tl.constexpr):
    j = tl.program_id(0)
    bkv = tl.program_id(1)
    dim = tl.arange(0, BD)
    dim_ok = dim < D
    hp = dim[:, None] * D + dim[None, :]
    hmask = dim_ok[:, None] & dim_ok[None, :]
    if GATHER:
        b = bkv // HK
        acc_h = tl.zeros([BD, BD], tl.float32)
        acc_z = tl.zeros([BD], tl.float32)
        for g in range(GROUP):
            head = (b * HK * GROUP + (bkv - b * HK) * GROUP + g).to(tl.int64)      # query head (b, kv * G + g)
            start = tl.load(OFFSETS + head * (TK + 1) + j)
            end = tl.load(OFFSETS + head * (TK + 1) + j + 1)
            src_h = DHQ + head * TQ * D * D
            src_z = DZQ + head * TQ * D
            for e in tl.range(start, end, num_stages=STAGES):
                i = tl.load(LISTS + head * L + e).to(tl.int64)
                acc_h += tl.load(src_h + i * D * D + hp, mask=hmask, other=0.0).to(tl.float32)
                acc_z += tl.load(src_z + i * D + dim, mask=dim_ok, other=0.0).to(tl.float32)
        d_h = tl.load(DHT + bkv.to(tl.int64) * D * D + hp, mask=hmask, other=0.0) - acc_h
        d_z = tl.load(DZT + bkv.to(tl.int64) * D + dim, mask=dim_ok, other=0.0) - acc_z
    else:                                                  # per key block, summed by dense.key_sums
        d_h = tl.load(DHT + (bkv.to(tl.int64) * TK + j) * D * D + hp, mask=hmask, other=0.0)
        d_z = tl.load(DZT + (bkv.to(tl.int64) * TK + j) * D + dim, mask=dim_ok, other=0.0)
    base = bkv.to(tl.int64) * NK * D
    for c in range(SPLIT):
        rows, ok = block_tokens(j, c, BLOCK_K, TILE, NK)
        mask = ok[:, None] & dim_ok[None, :]
        ptr = base + rows.to(tl.int64)[:, None] * D + dim[None, :]
        x = tl.load(K + ptr, mask=mask, other=0.0).to(tl.float32)
        phi = feature(x, mask, 1, FMAP)                                             # (TILE, BD)
        v = tl.load(V + ptr, mask=mask, other=0.0)
        dphi = dot(v, tl.trans(d_h), BF16) + d_z[None, :]
        dv = dot(phi, d_h, BF16)
        dk = feature_grad(x, phi, dphi, 1, FMAP)
        if ADD:
            dv += tl.load(DV_ADD + ptr, mask=mask, other=0.0).to(tl.float32)
            dk += tl.load(DK_ADD + ptr, mask=mask, other=0.0).to(tl.float32)
        tl.store(DV + ptr, dv.to(DV.dtype.element_ty), mask=mask)
        tl.store(DK + ptr, dk.to(DK.dtype.element_ty), mask=mask)


def tile_register_cap(tiles: dict, kernel: str, n_split: int) -> dict:
    """``{"maxnreg": cap}`` for ``kernel`` (``"dq"``, ``"dkv"``) when ``tiles`` caps its registers (the cap
    ``{kernel}_maxnreg_split`` applies to programs of several tiles, ``n_split > 1``, e.g. 128-row query blocks)
    and the kernel launches directly (eager; ``torch.compile``'s ``wrap_triton`` takes no ``maxnreg``, so traced
    launches run uncapped: same results, measured 0.06-0.14 ms slower, docs/triton_sla_pieces.md); else ``{}``."""
    return register_cap(tiles.get(f"{kernel}_maxnreg" if n_split == 1 else f"{kernel}_maxnreg_split"))


def linear_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, skipped: torch.Tensor,
                    rows_h: torch.Tensor, rows_z: torch.Tensor, block_q: int, block_k: int, feature_map: str,
                    eps: float, tiles: dict | None = None, add: tuple | None = None, o_l: torch.Tensor | None = None,
                    weight: torch.Tensor | None = None):
    """``(dq, dk, dv)`` of ``fwd.linear_forward`` from ``do (B, H, Nq, D)`` and its saved query-block states
    ``rows_h (B, H, Tq, D, D)``, ``rows_z (B, H, Tq, D)``. Shapes and dtypes as ``linear_forward``; all
    contiguous. ``add``: ``(dq, dk, dv)`` of another branch (shapes and dtypes of q, k, v, contiguous), added in
    fp32 before the one rounding of the stores (one pass over each instead of a separate sum). ``o_l``: the
    forward's O_l ``(B, H, Nq, D)`` in q's dtype, contiguous; the query-gradient kernel reads it instead of
    recomputing ``phi(Q_i) H_i / (eps + phi(Q_i) . Z_i)`` (one matrix product fewer per tile). ``weight``: SLA's
    ``W (D, D)`` (any float dtype, contiguous): ``do`` is then the gradient of ``O_s + O_l W^T + b``, and the
    branch's own, ``do W`` in q's dtype, is made in the query-gradient kernel."""
    bsz, heads, nq, d = q.shape
    kv_heads, nk = k.shape[1], k.shape[2]
    tq, tk = skipped.shape[2], cdiv(nk, block_k)
    tiles = tiles or linear_tiles(q.device, d, q.dtype)
    bf16, fmap, bd = q.dtype == torch.bfloat16, feature_code(feature_map), pow2(d, 16)
    dt = state_dtype(q.dtype)
    group, gather = heads // kv_heads, not dense(skipped, tk, tiles, backward=True)
    tile, n_split = split(block_q, tiles["TQ"])
    parts = 1 if gather else n_split                       # query-gradient programs per query block
    dq = torch.empty_like(q)
    d_hq = q.new_empty(bsz, heads, tq * parts, d, d, dtype=dt)
    d_zq = q.new_empty(bsz, heads, tq * parts, d, dtype=dt)
    launcher(_query_grad_kernel)[(tq * parts, bsz * heads)](
        q, do, q if weight is None else weight, rows_h, rows_z, q if o_l is None else o_l,
        dq if add is None else add[0], dq, d_hq, d_zq, float(eps), nq, tq, D=d, BD=bd, BLOCK_Q=block_q, TILE=tile,
        SPLIT=n_split, FMAP=fmap, BF16=bf16, ADD=add is not None, SAVED=o_l is not None, PROJ=weight is not None,
        PARTS=parts, num_warps=tiles["warps"], **tile_register_cap(tiles, "dq", n_split // parts))
    if not gather:        # the tiles' partial state gradients summed by the keep^T matmul (keep rows repeated)
        from .dense import key_sums
        d_ht, d_zt = key_sums(skipped, d_hq, d_zq, kv_heads, tk, parts)
        offsets = lists = skipped                          # not read without GATHER
    else:
        d_ht = d_hq.unflatten(1, (kv_heads, group)).sum((2, 3), dtype=torch.float32)  # over the group and Tq
        d_zt = d_zq.unflatten(1, (kv_heads, group)).sum((2, 3), dtype=torch.float32)
        offsets, lists = block_csc(skipped, tk, deterministic=True)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    tile, n_split = split(block_k, tiles["TK"])
    launcher(_key_grad_kernel)[(tk, bsz * kv_heads)](
        k, v, d_hq, d_zq, d_ht, d_zt, offsets, lists, *((dk, dv) if add is None else add[1:]), dk, dv, nk, tq, tk,
        lists.shape[-1], kv_heads, group, D=d, BD=bd, BLOCK_K=block_k, TILE=tile, SPLIT=n_split, FMAP=fmap,
        BF16=bf16, GATHER=gather, STAGES=tiles["stages"], ADD=add is not None, num_warps=tiles["warps"],
        **tile_register_cap(tiles, "dkv", n_split))
    return dq, dk, dv
