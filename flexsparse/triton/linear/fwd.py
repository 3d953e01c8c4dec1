"""Masked linear branch of SLA / SLA2, forward: key-block states, the sums over key blocks, one fused output kernel.

* ``_states_kernel``: one program per (key block j, batch x KV head): ``h_j = phi(K_j)^T V_j`` ``(D, D)`` and
  ``z_j = colsum phi(K_j)`` ``(D,)``, phi applied in-kernel (fp32), the product by ``tl.dot`` with fp32
  accumulation; tokens past ``Nk`` contribute 0. ``K_j`` is loaded transposed (``(D, tokens)``, phi along axis
  0), so the first operand of the dot is a computed register tile.
* ``_forward_kernel``: one program per (query block i, batch x query head). With ``GATHER`` (the gather
  strategy): ``[H_i | Z_i]`` = the KV head's total (one fp32 ``torch.sum`` over the blocks, deterministic) minus
  the states of the CSR row ``skipped[b, h, i]`` (read once each, summed in fp32 in list order), stored for the
  backward (``H_i`` in the states' dtype, ``Z_i`` fp32); without it they come summed from ``dense.py`` (the
  dense strategy, ``dense``). Then per query tile ``O = phi(Q) H_i / (eps + phi(Q) . Z_i)`` in q's dtype; phi(Q)
  never reaches HBM. With a ``Mix`` the same kernel also combines the branches (SLA's ``O_s + O_l W^T + b``,
  SLA2's ``alpha`` lerp) in its epilogue, so the methods' combine costs no extra pass over HBM.

States are stored in bf16 for bf16 inputs (half the gathered bytes; the totals are summed from the same rounded
states, so ``H_i`` is exactly the fp32 sum of its kept rounded states, no cancellation is amplified) and fp32
otherwise. Dots (``dot``) run on bf16 operands for bf16 inputs, exact fp32 (``ieee``) otherwise; so ``H_i``, whose
only use is as a dot operand, is stored in the states' dtype too (rounded once, as the dot would).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ...config import FEATURE_MAPS
from .._runtime.registry import launcher
from .._runtime.sizes import cdiv, pow2
from .._runtime.tiles import with_overrides

DENSE_NEVER = 2.0  # a dense_ratio no skipped table reaches (S <= Tk)
REGISTER_CAPS = ("dq_maxnreg", "dq_maxnreg_split", "dkv_maxnreg", "dkv_maxnreg_split")  # linear_tiles' keys where set


@triton.jit
def feature(x, ok, AXIS: tl.constexpr, FMAP: tl.constexpr):
    """phi of the fp32 tile ``x`` over the head dim ``AXIS`` (0 softmax, 1 elu + 1, 2 relu); 0 where not
    ``ok`` (padding tokens and padding dims)."""
    if FMAP == 0:
        s = tl.where(ok, x, float("-inf"))
        m = tl.max(s, axis=AXIS, keep_dims=True)
        p = tl.exp(s - tl.where(m == float("-inf"), 0.0, m))
        total = tl.sum(p, axis=AXIS, keep_dims=True)
        return p / tl.where(total == 0.0, 1.0, total)
    elif FMAP == 1:
        return tl.where(ok, tl.where(x > 0, x + 1.0, tl.exp(tl.minimum(x, 0.0))), 0.0)
    else:
        return tl.where(ok, tl.maximum(x, 0.0), 0.0)


@triton.jit
def feature_grad(x, phi, g, AXIS: tl.constexpr, FMAP: tl.constexpr):
    """Gradient w.r.t. ``x`` of ``phi = feature(x)`` given ``g = dL/dphi`` (0 wherever phi was masked)."""
    if FMAP == 0:
        return phi * (g - tl.sum(g * phi, axis=AXIS, keep_dims=True))
    elif FMAP == 1:
        return g * tl.where(x > 0, 1.0, phi)
    else:
        return tl.where(x > 0, g, 0.0)


@triton.jit
def dot(a, b, BF16: tl.constexpr):
    """``a @ b`` with fp32 accumulation: on bf16 operands (tensor cores) for bf16 inputs, else exact fp32."""
    if BF16:
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")


@triton.jit
def block_tokens(blk, chunk, BLOCK: tl.constexpr, TILE: tl.constexpr, n):
    """Token rows ``(TILE,)`` of chunk ``chunk`` of block ``blk`` and which are real (in the block, below n)."""
    local = chunk * TILE + tl.arange(0, TILE)
    rows = blk * BLOCK + local
    return rows, (local < BLOCK) & (rows < n)


@triton.jit
def _states_kernel(K, V, HS, ZS, NK, TK, D: tl.constexpr, BD: tl.constexpr, BLOCK_K: tl.constexpr,
                   TILE: tl.constexpr, SPLIT: tl.constexpr, FMAP: tl.constexpr, BF16: tl.constexpr):
    j = tl.program_id(0)
    bkv = tl.program_id(1).to(tl.int64)
    base = bkv * NK * D
    dim = tl.arange(0, BD)
    dim_ok = dim < D
    h = tl.zeros([BD, BD], tl.float32)
    z = tl.zeros([BD], tl.float32)
    for c in range(SPLIT):
        rows, ok = block_tokens(j, c, BLOCK_K, TILE, NK)
        mask_t = dim_ok[:, None] & ok[None, :]
        kt = tl.load(K + base + rows.to(tl.int64)[None, :] * D + dim[:, None], mask=mask_t, other=0.0)
        phi_t = feature(kt.to(tl.float32), mask_t, 0, FMAP)                     # (BD, TILE)
        v = tl.load(V + base + rows.to(tl.int64)[:, None] * D + dim[None, :], mask=ok[:, None] & dim_ok[None, :],
                    other=0.0)
        h += dot(phi_t, v, BF16)
        z += tl.sum(phi_t, axis=1)
    out = bkv * TK + j
    hp = dim[:, None] * D + dim[None, :]
    tl.store(HS + out * D * D + hp, h.to(HS.dtype.element_ty), mask=dim_ok[:, None] & dim_ok[None, :])
    tl.store(ZS + out * D + dim, z.to(ZS.dtype.element_ty), mask=dim_ok)


@triton.jit
def _forward_kernel(Q, HS, ZS, HT, ZT, IDS, O, ROWS_H, ROWS_Z, OS, OL, W, BIAS, LOGIT, logit_h, EPS: tl.constexpr,
                    NQ, TQ, TK, S, H, GROUP, D: tl.constexpr, BD: tl.constexpr, BLOCK_Q: tl.constexpr,
                    TILE: tl.constexpr, SPLIT: tl.constexpr, FMAP: tl.constexpr, BF16: tl.constexpr,
                    GATHER: tl.constexpr, STAGES: tl.constexpr, MIX: tl.constexpr, STORE_LINEAR: tl.constexpr):
    """O_l of query block ``program_id(0)``; ``MIX`` 0: O = O_l; 1 (SLA): O = O_s + O_l W^T + bias; 2 (SLA2):
    O = O_l + alpha (O_s - O_l), alpha = sigmoid(``LOGIT[h * logit_h + i]``) in fp32 rounded to q's dtype. With
    ``MIX`` the O_l rounded to q's dtype is what mixes (as in the unfused methods) and ``STORE_LINEAR`` also stores
    it to ``OL``."""
    i = tl.program_id(0)
    bh = tl.program_id(1)
    dim = tl.arange(0, BD)
    dim_ok = dim < D
    hmask = dim_ok[:, None] & dim_ok[None, :]
    hp = dim[:, None] * D + dim[None, :]
    row = bh.to(tl.int64) * TQ + i
    if GATHER:
        b = bh // H
        kv = (b * (H // GROUP) + (bh - b * H) // GROUP).to(tl.int64)
        hs = HS + kv * TK * D * D
        zs = ZS + kv * TK * D
        ids = IDS + (bh.to(tl.int64) * TQ + i) * S
        acc_h = tl.zeros([BD, BD], tl.float32)
        acc_z = tl.zeros([BD], tl.float32)
        for e in tl.range(0, S, num_stages=STAGES):
            j = tl.load(ids + e).to(tl.int64)
            acc_h += tl.load(hs + j * D * D + hp, mask=hmask, other=0.0).to(tl.float32)
            acc_z += tl.load(zs + j * D + dim, mask=dim_ok, other=0.0).to(tl.float32)
        state_h = tl.load(HT + kv * D * D + hp, mask=hmask, other=0.0) - acc_h
        state_z = tl.load(ZT + kv * D + dim, mask=dim_ok, other=0.0) - acc_z
        state_h = state_h.to(ROWS_H.dtype.element_ty)      # what the dots read, here and in the backward
        tl.store(ROWS_H + row * D * D + hp, state_h, mask=hmask)
        tl.store(ROWS_Z + row * D + dim, state_z, mask=dim_ok)
    else:                                                  # summed by dense.query_sums
        state_h = tl.load(ROWS_H + row * D * D + hp, mask=hmask, other=0.0)
        state_z = tl.load(ROWS_Z + row * D + dim, mask=dim_ok, other=0.0)
    w_t, bias, alpha = mix_operands(Q, W, BIAS, LOGIT, logit_h, bh % H, i, D, BD, MIX)
    base = bh.to(tl.int64) * NQ * D
    for c in range(SPLIT):
        rows, ok = block_tokens(i, c, BLOCK_Q, TILE, NQ)
        mask = ok[:, None] & dim_ok[None, :]
        ptr = base + rows.to(tl.int64)[:, None] * D + dim[None, :]
        o_l = linear_output(tl.load(Q + ptr, mask=mask, other=0.0), mask, state_h, state_z, EPS, FMAP, BF16)
        o_l = o_l.to(O.dtype.element_ty)
        if MIX == 0:
            tl.store(O + ptr, o_l, mask=mask)
        else:
            if STORE_LINEAR:
                tl.store(OL + ptr, o_l, mask=mask)
            o_s = tl.load(OS + ptr, mask=mask, other=0.0).to(tl.float32)
            out = combine(o_s, o_l, w_t, bias, alpha, BF16, MIX)
            tl.store(O + ptr, out.to(O.dtype.element_ty), mask=mask)


@triton.jit
def mix_operands(Q, W, BIAS, LOGIT, logit_h, h, i, D: tl.constexpr, BD: tl.constexpr, MIX: tl.constexpr):
    """What ``combine`` mixes with for query block ``i`` of head ``h``: ``(w_t, bias, alpha)``, ``MIX`` 1: W^T
    ``(BD, BD)`` (D_in, D_out) of ``W (D, D)`` (``nn.Linear`` layout, q's dtype) and the bias rounded to q's dtype;
    2: alpha = sigmoid(``LOGIT[h * logit_h + i]``) in fp32 rounded to q's dtype (``Q``'s element type); 0 where
    unused."""
    dim = tl.arange(0, BD)
    dim_ok = dim < D
    w_t = 0.0
    bias = 0.0
    alpha = 0.0
    if MIX == 1:
        w_t = tl.load(W + dim[None, :] * D + dim[:, None], mask=dim_ok[:, None] & dim_ok[None, :], other=0.0)
        bias = tl.load(BIAS + dim, mask=dim_ok, other=0.0).to(Q.dtype.element_ty).to(tl.float32)
    if MIX == 2:
        alpha = tl.sigmoid(tl.load(LOGIT + h * logit_h + i).to(tl.float32)).to(Q.dtype.element_ty)
        alpha = alpha.to(tl.float32)
    return w_t, bias, alpha


@triton.jit
def linear_output(q, mask, state_h, state_z, EPS: tl.constexpr, FMAP: tl.constexpr, BF16: tl.constexpr):
    """``phi(q) H_i / (eps + phi(q) . Z_i)`` fp32 ``(rows, BD)`` of a query tile (zeros where not ``mask``) and its
    query block's states ``state_h (BD, BD)``, ``state_z (BD,)``."""
    phi = feature(q.to(tl.float32), mask, 1, FMAP)
    den = EPS + tl.sum(phi * state_z[None, :], axis=1)
    return dot(phi, state_h, BF16) / den[:, None]


@triton.jit
def combine(o_s, o_l, w_t, bias, alpha, BF16: tl.constexpr, MIX: tl.constexpr):
    """The methods' combine in fp32 of ``o_s`` (fp32) and ``o_l`` (q's dtype): ``MIX`` 1 (SLA) ``o_s + o_l W^T +
    bias``, 2 (SLA2) ``o_l + alpha (o_s - o_l)`` (``mix_operands``)."""
    if MIX == 1:
        return o_s + dot(o_l, w_t, BF16) + bias[None, :]
    else:
        lin = o_l.to(tl.float32)
        return lin + alpha * (o_s - lin)


def feature_code(name: str) -> int:
    """The in-kernel code of feature map ``name``: its index in ``config.FEATURE_MAPS`` (``feature``'s ``FMAP``)."""
    if name not in FEATURE_MAPS:
        raise ValueError(f"unknown feature_map {name!r}; valid: {sorted(FEATURE_MAPS)}")
    return FEATURE_MAPS.index(name)


def mixed_outputs(q: torch.Tensor, store: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Empty ``(out, lse, o_s, o_l)`` of a forward that mixes the branches in its epilogue: out like q, the LSE
    ``(B, H, Nq)`` fp32, O_s and O_l like q where ``store`` (the backward reads them), else empty."""
    side = (torch.empty_like(q), torch.empty_like(q)) if store else (q.new_empty(0), q.new_empty(0))
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32), *side


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """Storage dtype of the block states and their gradients: bf16 for bf16 inputs, else fp32."""
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float32


def linear_tiles(device: torch.device, d: int, dtype: torch.dtype) -> dict:
    """Token rows per tile ``TQ`` / ``TK`` (caps, powers of two >= 16), warps and pipeline stages of the gather
    loops, the strategy of the sums over key blocks (``dense``: ``dense_ratio`` forward, ``dense_ratio_bwd``
    backward) and register caps ``dq_maxnreg`` / ``dkv_maxnreg`` of the backward kernels (``bwd``), with
    ``tiles.overrides("linear")``. Chosen so that nothing spills on sm_90 without a cap (triton 3.6,
    ``benchmarks/triton_sm90_report.py``): fp32 / fp16 (exact fp32 products on FMA units) take narrower tiles;
    bf16 keeps 64-row query tiles at D = 128 (its dQ products then run on wgmma: at the public SLA shape on an
    H200 the branch takes 1.92 ms forward and 3.35 backward against 2.06 and 3.62 on narrower tiles). The bf16
    ratios and caps were measured on an H200 (docs/triton_sla_pieces.md), except the D = 128 query-gradient cap
    (H100): reading the saved O_l, 128 registers (2 programs per SM, some spills) run it in 1.22 ms against 1.38
    uncapped. Programs over several query tiles (``dq_maxnreg_split``: 128-row query blocks under the gather
    strategy, whose ``D x D`` gradient stays live across the tiles; the dense strategy runs one program per tile;
    H200): D = 64 keeps 168 (0.50 ms against 0.56 uncapped, 240 registers), D = 128 runs uncapped (255
    registers: 1.55 ms against 2.49 under the cap of 128); the key-gradient cap for key blocks above 64 tokens is
    the one-tile cap (not measured)."""
    if device.type == "cpu":
        base = dict(TQ=16, TK=16, warps=4, stages=1, dense_ratio=DENSE_NEVER, dense_ratio_bwd=DENSE_NEVER)
    elif dtype != torch.bfloat16:
        rows = 32 if d <= 64 else 16
        base = dict(TQ=rows, TK=rows, warps=8, stages=2, dense_ratio=DENSE_NEVER, dense_ratio_bwd=DENSE_NEVER)
    elif d <= 64:
        base = dict(TQ=64, TK=64, warps=4, stages=3, dense_ratio=0.02, dense_ratio_bwd=0.005, dq_maxnreg=168,
                    dq_maxnreg_split=168)
    else:
        base = dict(TQ=64, TK=64, warps=8, stages=3, dense_ratio=0.005, dense_ratio_bwd=0.005, dq_maxnreg=128,
                    dkv_maxnreg=128, dkv_maxnreg_split=128)
    return with_overrides("linear", base, REGISTER_CAPS)


def dense(skipped: torch.Tensor, tk: int, tiles: dict, backward: bool = False) -> bool:
    """Whether the sums over key blocks run as block matmuls (``dense.py``) rather than gathers: when the
    skipped blocks per row reach ``tiles["dense_ratio"]`` (``"dense_ratio_bwd"`` for the ``backward``) of all key
    blocks. bf16 on GPUs: forward 2% at D <= 64 (below it the gathered bytes cost less than the matmul),
    0.5% above; backward 0.5% (the gather's deterministic CSC alone costs ~0.3 ms); never by default for fp32 /
    fp16 and on CPU. The two directions may differ: both produce and read the same query-block states."""
    ratio = tiles["dense_ratio_bwd" if backward else "dense_ratio"]
    return skipped.shape[-1] > 0 and skipped.shape[-1] >= ratio * tk


def split(block: int, cap: int) -> tuple[int, int]:
    """Tile rows for blocks of ``block`` tokens (a power of two in [16, max(cap, 16)]) and tiles per block."""
    rows = max(16, min(pow2(block), pow2(cap)))
    return rows, cdiv(block, rows)


def key_states(k: torch.Tensor, v: torch.Tensor, block_k: int, feature_map: str, tiles: dict, dtype: torch.dtype):
    """Per key block ``h (B, Hk, Tk, D, D)`` and ``z (B, Hk, Tk, D)`` in ``state_dtype(dtype)`` (dtype: the
    inputs' precision, q's). k, v: ``(B, Hk, Nk, D)`` contiguous."""
    bsz, kv_heads, nk, d = k.shape
    tk = cdiv(nk, block_k)
    dt = state_dtype(dtype)
    hs = k.new_empty(bsz, kv_heads, tk, d, d, dtype=dt)
    zs = k.new_empty(bsz, kv_heads, tk, d, dtype=dt)
    tile, n_split = split(block_k, tiles["TK"])
    launcher(_states_kernel)[(tk, bsz * kv_heads)](
        k, v, hs, zs, nk, tk, D=d, BD=pow2(d, 16), BLOCK_K=block_k, TILE=tile, SPLIT=n_split,
        FMAP=feature_code(feature_map), BF16=dtype == torch.bfloat16, num_warps=tiles["warps"])
    return hs, zs


class Mix(NamedTuple):
    """What the output kernel mixes into O_l (``linear_forward``'s ``mix``): ``o_s (B, H, Nq, D)`` contiguous,
    and either ``weight (D, D)`` (``nn.Linear`` layout) and ``bias (D,)`` (SLA: ``O_s + O_l W^T + b``) or
    ``alpha_logit (1 or H, Tq)`` (SLA2: ``O_l + alpha (O_s - O_l)``, ``alpha = sigmoid(alpha_logit)``), all
    contiguous, weight in q's dtype, bias and alpha_logit in any float dtype (the kernel rounds the bias and alpha,
    an fp32 sigmoid, to q's); ``store_linear``: also return the O_l that was mixed."""

    o_s: torch.Tensor
    weight: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    alpha_logit: torch.Tensor | None = None
    store_linear: bool = True


def _dense_sums(skipped: torch.Tensor, hs: torch.Tensor, zs: torch.Tensor):
    """The dense strategy's query-block states ``(H_i, Z_i)`` from the key-block states (``dense.py``)."""
    from .dense import query_sums
    return query_sums(skipped, hs, zs)


def dense_query_states(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, skipped: torch.Tensor, block_k: int,
                       feature_map: str, tiles: dict | None = None):
    """The query-block states ``H (B, H, Tq, D, D)`` in ``state_dtype`` and ``Z (B, H, Tq, D)`` fp32 when the sums
    run on the dense strategy (``dense``), else ``None`` (the gather strategy sums them in the output kernel).
    Arguments as ``linear_forward``'s."""
    tiles = tiles or linear_tiles(q.device, q.shape[-1], q.dtype)
    if not dense(skipped, cdiv(k.shape[2], block_k), tiles):
        return None
    return _dense_sums(skipped, *key_states(k, v, block_k, feature_map, tiles, q.dtype))


def linear_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, skipped: torch.Tensor, block_q: int,
                   block_k: int, feature_map: str, eps: float, tiles: dict | None = None, mix: Mix | None = None):
    """``o (B, H, Nq, D)`` in q's dtype and the query-block states ``H (B, H, Tq, D, D)`` in ``state_dtype`` and
    ``Z (B, H, Tq, D)`` fp32; with ``mix`` (``Mix``) ``o`` is the mixed output and a fourth result is O_l
    (``None`` unless ``mix.store_linear``).

    q: ``(B, H, Nq, D)``; k, v: ``(B, Hk, Nk, D)`` in q's dtype, all contiguous; skipped: ``(B, H, Tq, S)``
    int32 contiguous, the key blocks each query block leaves out.
    """
    bsz, heads, nq, d = q.shape
    tq, width = skipped.shape[2], skipped.shape[3]
    tiles = tiles or linear_tiles(q.device, d, q.dtype)
    hs, zs = key_states(k, v, block_k, feature_map, tiles, q.dtype)
    bf16, gather = q.dtype == torch.bfloat16, not dense(skipped, hs.shape[2], tiles)
    o = torch.empty_like(q)
    if gather:
        ht, zt = hs.sum(2, dtype=torch.float32), zs.sum(2, dtype=torch.float32)
        rows_h = q.new_empty(bsz, heads, tq, d, d, dtype=hs.dtype)
        rows_z = q.new_empty(bsz, heads, tq, d, dtype=torch.float32)
    else:
        ht, zt = hs, zs
        rows_h, rows_z = _dense_sums(skipped, hs, zs)
    tile, n_split = split(block_q, tiles["TQ"])
    code = 0 if mix is None else 1 if mix.weight is not None else 2
    o_l = torch.empty_like(q) if code and mix.store_linear else None
    unused = q  # the pointer of the slots the kernel leaves unused: an input (_runtime.registry.launcher)
    extra = (unused,) * 5 + (0,) if mix is None else (
        mix.o_s, unused if o_l is None else o_l, mix.weight if code == 1 else unused,
        mix.bias if code == 1 else unused, mix.alpha_logit if code == 2 else unused,
        tq if code == 2 and mix.alpha_logit.shape[0] > 1 else 0)
    launcher(_forward_kernel)[(tq, bsz * heads)](
        q, hs, zs, ht, zt, skipped, o, rows_h, rows_z, *extra, float(eps), nq, tq, hs.shape[2], width, heads,
        heads // k.shape[1],
        D=d, BD=pow2(d, 16), BLOCK_Q=block_q, TILE=tile, SPLIT=n_split, FMAP=feature_code(feature_map), BF16=bf16,
        GATHER=gather, STAGES=tiles["stages"], MIX=code, STORE_LINEAR=o_l is not None, num_warps=tiles["warps"])
    return (o, rows_h, rows_z) if mix is None else (o, rows_h, rows_z, o_l)
