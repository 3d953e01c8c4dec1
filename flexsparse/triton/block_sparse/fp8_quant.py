"""FP8 (e4m3) pre-pass of the FP8 block-sparse forward (``fwd_fp8``): Q per query block, K (smoothed or not)
per key block, V per channel stored transposed (docs/methods.md "FP8 QAT", "FP8 Triton forward"). The Triton FP8
kernels quantize Q's blocks themselves as they load them (``fwd_fp8.quantized_query``, ``block_scale``), the same
values; the Gluon ones take ``quantize_blocks``'.

Scales are ``flexsparse.quant.formats``'s bit for bit: ``s = 448 / max(amax, 1e-12)`` divided in fp64 and
rounded to fp32 (torchao's ``amax_to_scale``), values ``e4m3(clamp(x * s, -448, 448))`` with ``x * s`` in
fp32, round to nearest even. K is smoothed first, ``k - mean_N(k)`` per KV head (mean in fp32).

K's mean comes from the caller where its selection pooled the keys (the block sums it has: no pass over K), else
from ``pooling.naive.key_mean``; it is ``k.mean(dtype=float32)``'s up to fp32 rounding, and any mean gives the same
attention up to quantization (the LSE takes the shift back; zeros: K unsmoothed). V's amax over N is taken by the
programs that quantize K's blocks (per key block, then torch over the blocks; no launch of its own): bit for bit
``channel_scales``'s amax. Q needs no mean, so the selection's pooling pass quantizes it (``pool_quantize_queries``:
the block means and sums the selection wants, and e4m3 Q with its scales from the launch that pools q); unsmoothed,
K needs none either (``pool_quantize``: K's e4m3 blocks and V's amax from the launch that pools k), and only V^T is
left to the pre-pass.

V^T's keys may be stored permuted within aligned groups of 16 (``PERMUTED_KEYS``, ``key_slot``): the forward
kernels then permute P's columns alike by relabelling (``permuted_columns``), which moves P from the score
accumulator's layout into the fp8 MMA's operand layout without cross-thread shuffles, and ``P V`` is unchanged.

Storage: ``float8_e4m3fn`` on CUDA. The Triton interpreter (CPU) mis-rounds fp8 casts, so there the
quantized tensors are an **fp16 stand-in**: fp16 tensors holding exactly the e4m3 grid values (every
e4m3 value is an fp16 value), rounded by ``e4m3_round`` in fp32 arithmetic; the attention kernel then
runs its products on fp16 operands with the same values.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...masks import num_blocks
from ...quant.formats import E4M3, amax_to_scale
from .._runtime.registry import launcher
from ..common.jit import token_tile
from ..pooling.naive import key_mean
from .._runtime.sizes import cdiv, pow2

# Whether V^T's keys are stored in ``key_slot`` order (for key blocks of whole 16-key groups, ``permutes_keys``):
# no SHFL.IDX, SEL or PRMT to move P (sm_90 SASS per key step, triton 3.7.1: 328 -> 301 instructions in the Triton
# FP8 forward at D=64, 436 -> 412 in the Gluon one at D=128); the default FP8 kernel 1.848 -> 1.738 ms at D=64,
# 2.970 -> 2.784 at D=128 (B2 H8 N65536, 5 % of 64-key blocks, H200).
PERMUTED_KEYS = True


@triton.jit
def e4m3_round(x):
    """``x`` (fp32, ``|x| <= 448``) rounded to nearest even onto the e4m3 grid, in fp32, without fp8 casts:
    normals (``|x| >= 2^-6``) keep 3 mantissa bits (integer rounding of the fp32 bits, carries into the
    exponent), subnormals are multiples of ``2^-9`` (``|x| + 2^14`` rounds to that step in fp32)."""
    a = tl.abs(x)
    bits = a.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576              # -1048576 = 0xFFF00000
    normal = bits.to(tl.float32, bitcast=True)
    sub = (a + 16384.0) - 16384.0
    r = tl.where(a < 0.015625, sub, normal)
    return tl.where(x < 0, -r, r)


@triton.jit
def to_e4m3(x, EMULATE: tl.constexpr, CLAMP: tl.constexpr = True):
    """Saturating e4m3 of fp32 ``x``: ``float8e4nv`` (round to nearest even), or with ``EMULATE`` the fp16
    stand-in holding the same value. ``CLAMP=False`` for ``x`` in [0, 448] up to fp32 rounding (P): the
    hardware cast saturates and ``e4m3_round`` takes anything below 464 to 448."""
    if CLAMP:
        x = tl.minimum(tl.maximum(x, -448.0), 448.0)
    if EMULATE:
        return e4m3_round(x).to(tl.float16)
    else:
        return x.to(tl.float8e4nv)


def permutes_keys(block_k: int) -> bool:
    """Whether V^T's keys are stored in ``key_slot`` order for key blocks of ``block_k`` tokens: with
    ``PERMUTED_KEYS``, where the blocks are whole 16-key groups (a kernel's key tile then holds whole groups)."""
    return PERMUTED_KEYS and block_k % 16 == 0


def key_slot(t):
    """The stored column of key ``t`` in the permuted order: bits 0-3 of ``t`` (b0, b1, b2, b3) placed as (b0, b2,
    b3, b1), the rest kept. Column ``k`` then holds the key whose bits are (k0, k2, k3, k1): the score
    accumulator's column of the fp8 operand's column ``k`` in the same thread (``permuted_columns``, which also
    stores V^T in this order). Plain integer arithmetic on torch tensors."""
    return (t & -16) | (t & 1) | (((t >> 3) & 1) << 1) | (((t >> 1) & 1) << 2) | (((t >> 2) & 1) << 3)


@triton.jit
def permuted_columns(p, BM: tl.constexpr, BN: tl.constexpr):
    """``p (BM, BN)`` with its columns permuted as V^T's keys are stored (``key_slot``): column ``k`` takes
    column (k0, k2, k3, k1) of its 16-group. A relabelling: no data moves where ``p`` is in a wgmma accumulator's
    layout and the result feeds an fp8 ``dot`` as its first operand. Gluon kernels take ``gluon.jit`` of its
    ``fn``."""
    x = tl.reshape(p, [BM, BN // 16, 2, 2, 2, 2])                 # m, group, c3, c2, c1, c0
    return tl.reshape(tl.permute(x, (0, 1, 3, 4, 2, 5)), [BM, BN])  # m, group, k3 = c2, k2 = c1, k1 = c3, k0 = c0


def stored_keys(n: int) -> torch.Tensor:
    """``(n,)`` int64 for ``n`` a multiple of 16: the key each column of a V^T stored in ``key_slot`` order holds."""
    return torch.argsort(key_slot(torch.arange(n)))


@triton.jit
def block_scale(amax):
    """The e4m3 scale of an fp32 ``amax``: ``448 / max(amax, 1e-12)`` divided in fp64, rounded to fp32 (torchao's
    ``amax_to_scale``)."""
    return (tl.full([], 448.0, tl.float64) / tl.maximum(amax.to(tl.float64), tl.full([], 1e-12, tl.float64))).to(
        tl.float32)


@triton.jit
def quantize_block(X, MEAN, OUT, SCALE, V, V_AMAX, SUMS, MEANS, x_b, x_h, x_n, v_b, v_h, v_n, b, h, bh, blk, N, T,
                   BLOCK: tl.constexpr, BB: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, SMOOTH: tl.constexpr,
                   HAS_V: tl.constexpr, HAS_MEANS: tl.constexpr, HAS_SUMS: tl.constexpr, QUANT: tl.constexpr,
                   EMULATE: tl.constexpr):
    """Block ``blk`` of head ``(b, h)`` (flat ``bh``) of x ``(B, H, N, D)`` (strides ``x_b, x_h, x_n, 1``): with
    ``QUANT`` its e4m3 values (``MEAN`` subtracted with ``SMOOTH``) to ``OUT`` (contiguous) and its scale to ``SCALE``
    ``(B * H, T)``; with ``HAS_MEANS`` the fp32 mean of its real rows (before any smoothing) at ``[bh, blk]`` of
    ``MEANS`` ``(B * H, T, D)``, with ``HAS_SUMS`` their sum in ``SUMS`` alike; with ``HAS_V`` the column amax of
    |V| over the same rows at ``[bh, :, blk]`` of ``V_AMAX`` ``(B * H, D, T)`` fp32 (blocks innermost: torch then
    reduces rows)."""
    local = tl.arange(0, BB)
    rows = blk * BLOCK + local
    dim = tl.arange(0, BD)
    ok = ((local < BLOCK) & (rows < N))[:, None] & (dim < D)[None, :]
    row = rows.to(tl.int64)[:, None]
    x = tl.load(X + b.to(tl.int64) * x_b + h.to(tl.int64) * x_h + row * x_n + dim[None, :], mask=ok,
                other=0.0).to(tl.float32)
    if HAS_MEANS:
        total = tl.sum(x, axis=0)
        count = tl.maximum(tl.minimum(N - blk * BLOCK, BLOCK), 1).to(tl.float32)
        at = (bh.to(tl.int64) * T + blk) * D + dim
        tl.store(MEANS + at, total / count, mask=dim < D)
        if HAS_SUMS:
            tl.store(SUMS + at, total, mask=dim < D)
    if HAS_V:
        v = tl.load(V + b.to(tl.int64) * v_b + h.to(tl.int64) * v_h + row * v_n + dim[None, :], mask=ok, other=0.0)
        amax_v = tl.max(tl.abs(v.to(tl.float32)), axis=0)
        tl.store(V_AMAX + (bh.to(tl.int64) * D + dim) * T + blk, amax_v, mask=dim < D)
    if QUANT:
        if SMOOTH:
            mean = tl.load(MEAN + bh.to(tl.int64) * D + dim, mask=dim < D, other=0.0)
            x = tl.where(ok, x - mean[None, :], 0.0)
        scale = block_scale(tl.max(tl.max(tl.abs(x), axis=1), axis=0))
        dst = OUT + bh.to(tl.int64) * N * D + row * D + dim[None, :]
        tl.store(dst, to_e4m3(x * scale, EMULATE), mask=ok)
        tl.store(SCALE + bh.to(tl.int64) * T + blk, scale)


@triton.jit
def _quant_blocks_kernel(X, MEAN, OUT, SCALE, V, V_AMAX, SUMS, MEANS, x_b, x_h, x_n, v_b, v_h, v_n, H, N, T,
                         BLOCK: tl.constexpr, BB: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                         SMOOTH: tl.constexpr, HAS_V: tl.constexpr, HAS_MEANS: tl.constexpr, HAS_SUMS: tl.constexpr,
                         QUANT: tl.constexpr, EMULATE: tl.constexpr):
    """Program ``(block, b * H + h)``: ``quantize_block``. V's blocks in programs of their own (a third grid axis)
    took the K launch from 150 to 168 µs at D=64 and from 377 to 404 at D=128 (B2 H8 N65536, H200). One launch for
    Q's and K's blocks together (the third axis choosing the tensor, warps for K's) took 505 µs for ``sla2``'s
    128-query blocks at D=128 against 154 + 277 of the passes it replaced (H200)."""
    blk = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    quantize_block(X, MEAN, OUT, SCALE, V, V_AMAX, SUMS, MEANS, x_b, x_h, x_n, v_b, v_h, v_n, b, bh - b * H, bh, blk,
                   N, T, BLOCK, BB, D, BD, SMOOTH, HAS_V, HAS_MEANS, HAS_SUMS, QUANT, EMULATE)


@triton.jit
def _quant_v_kernel(V, SCALE, OUT, v_b, v_h, v_n, H, N, NP, TILE: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                    EMULATE: tl.constexpr, PERMUTE: tl.constexpr):
    bh, rows, dim, ok, src, _ = token_tile(v_b, v_h, v_n, H, N, D, BD, TILE)
    x = tl.load(V + src, mask=ok, other=0.0).to(tl.float32)
    scale = tl.load(SCALE + bh.to(tl.int64) * D + dim, mask=dim < D, other=1.0)
    y = to_e4m3(tl.trans(x * scale[None, :]), EMULATE)                        # (BD, TILE), zeros past N
    if PERMUTE:
        y = permuted_columns(y, BD, TILE)    # in registers: contiguous stores (scattered bytes: ~0.9 ms more, D=64)
    dst = OUT + bh.to(tl.int64) * D * NP + dim.to(tl.int64)[:, None] * NP + rows[None, :]
    tl.store(dst, y, mask=(dim < D)[:, None] & (rows < NP)[None, :])


def storage_dtype(device: torch.device) -> torch.dtype:
    """``float8_e4m3fn`` on CUDA, the fp16 stand-in in the interpreter (CPU)."""
    return E4M3 if device.type == "cuda" else torch.float16


def quantize_blocks(x: torch.Tensor, block: int, mean: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 ``x (B, H, N, D)`` per block of ``block`` tokens x D, after subtracting ``mean (B, H, D)`` fp32 when
    given. Returns the values ``(B, H, N, D)`` contiguous (``storage_dtype``) and fp32 scales ``(B, H, T)``,
    ``T = ceil(N / block)`` (``flexsparse.quant.block_scales``, the smoothing done in fp32 first)."""
    return _launch_blocks(x, block, mean)[:2]


def quantize_keys(k: torch.Tensor, v: torch.Tensor, block: int,
                  mean: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``quantize_blocks(k, block, mean)`` and, from the same pass, ``max_N |v| (B, Hk, D)`` fp32 of ``v`` (k's
    shape): ``(k8, k_scales, v_amax)``."""
    return _launch_blocks(k, block, mean, v)[:3]


def _launch_blocks(x: torch.Tensor, block: int, mean: torch.Tensor | None = None, v: torch.Tensor | None = None,
                   means: bool = False, sums: bool = False, quantize: bool = True):
    """``_quant_blocks_kernel`` over ``x``: ``(values, scales, v_amax, block_means, block_sums)``, None where not
    asked for (``v`` None, ``means`` / ``sums`` false, ``quantize`` false for the first two)."""
    bsz, heads, n, d = x.shape
    t = num_blocks(n, block)

    def buffer(wanted: bool, *shape, dtype=torch.float32):
        return torch.empty(*shape, device=x.device, dtype=dtype) if wanted else None

    storage = storage_dtype(x.device)
    out = buffer(quantize, bsz, heads, n, d, dtype=storage)
    scales = buffer(quantize, bsz, heads, t)
    v_amax = buffer(v is not None, bsz, heads, d, t)
    block_means, block_sums = buffer(means, bsz, heads, t, d), buffer(sums, bsz, heads, t, d)
    bb, bd = pow2(block, 16), pow2(d, 16)
    v_src, v_strides = (x, (0, 0, 0)) if v is None else (v, v.stride()[:3])
    slots = [x if y is None else y for y in (out, scales, v_amax, block_sums, block_means)]   # x: unused slots
    launcher(_quant_blocks_kernel)[(t, bsz * heads)](
        x, x if mean is None else mean.contiguous(), slots[0], slots[1], v_src, *slots[2:], *x.stride()[:3],
        *v_strides, heads, n, t, BLOCK=block, BB=bb, D=d, BD=bd, SMOOTH=mean is not None, HAS_V=v is not None,
        HAS_MEANS=means, HAS_SUMS=sums, QUANT=quantize, EMULATE=storage != E4M3,
        num_warps=block_warps(bb * bd, v is not None))
    return out, scales, None if v_amax is None else v_amax.amax(dim=3), block_means, block_sums


def block_warps(elements: int, with_v: bool) -> int:
    """Warps of a ``_quant_blocks_kernel`` program of ``elements`` per block: with V's amax one per 4096 (at least
    2), else 4 up to 8192 and 8 beyond. B2 H8 N65536 64-token blocks, H200, µs by 2 / 4 / 8 warps: K and V at D=64
    90 / 104 / 167, at D=128 176 / 190 / 279; K alone at D=64 54 / 53 / 62, at D=128 101 / 100 / 108."""
    if with_v:
        return max(2, elements // 4096)
    return 4 if elements <= 8192 else 8


def quantize_v_transposed(v: torch.Tensor, amax: torch.Tensor, permute: bool = False) -> tuple[torch.Tensor,
                                                                                                torch.Tensor]:
    """e4m3 ``v (B, Hk, N, D)`` per channel of ``amax = max_N |v| (B, Hk, D)`` (``flexsparse.quant.channel_scales``),
    stored transposed: values ``(B, Hk, D, NP)`` with ``NP = N`` rounded up to a multiple of 16 (zeros past N; the
    keys of ``P V`` are contiguous, as Hopper's fp8 MMA wants its second operand) and fp32 scales ``(B, Hk, D)``.
    ``permute``: the keys in ``key_slot`` order (column ``k`` holds key ``stored_keys(NP)[k]``)."""
    bsz, heads, n, d = v.shape
    scales = amax_to_scale(amax)                                              # (B, Hk, D), contiguous
    np_ = cdiv(n, 16) * 16
    out = torch.empty(bsz, heads, d, np_, device=v.device, dtype=storage_dtype(v.device))
    tile = 64
    launcher(_quant_v_kernel)[(cdiv(np_, tile), bsz * heads)](
        v, scales, out, v.stride(0), v.stride(1), v.stride(2), heads, n, np_, TILE=tile, D=d, BD=pow2(d, 16),
        EMULATE=out.dtype != E4M3, PERMUTE=permute, num_warps=8 if tile * pow2(d, 16) >= 8192 else 4)
    return out, scales


def pool_quantize(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_q: int, block_k: int):
    """The selection's block pooling and the unsmoothed FP8 pre-pass of Q and K, one launch each
    (``_quant_blocks_kernel``): ``((q_means, k_means, k_sums), quantized)``, the means ``(B, H, Tq, D)`` /
    ``(B, Hk, Tk, D)`` and k's block sums in fp32 (``Backend.block_pooling``'s), ``quantized = [q8, q_scales, k8,
    k_scales, v_amax]``: ``quantize_blocks(q, block_q)``, ``quantize_keys(k, v, block_k, None)``.

    q: ``(B, H, Nq, D)``; k, v: ``(B, Hk, Nk, D)``; last dims contiguous."""
    q8, q_scales, _, q_means, _ = _launch_blocks(q, block_q, means=True)
    k8, k_scales, v_amax, k_means, k_sums = _launch_blocks(k, block_k, v=v, means=True, sums=True)
    return (q_means, k_means, k_sums), [q8, q_scales, k8, k_scales, v_amax]


def pool_quantize_queries(q: torch.Tensor, k: torch.Tensor, block_q: int, block_k: int):
    """``pool_quantize`` for smoothed keys: the same pooling, and e4m3 Q per block from the launch that pools q
    (K's quantization needs the mean over all of K, so the FP8 pre-pass takes K): ``((q_means, k_means, k_sums),
    [q8, q_scales])``. q: ``(B, H, Nq, D)``; k: ``(B, Hk, Nk, D)``; last dims contiguous."""
    q8, q_scales, _, q_means, _ = _launch_blocks(q, block_q, means=True)
    _, _, _, k_means, k_sums = _launch_blocks(k, block_k, means=True, sums=True, quantize=False)
    return (q_means, k_means, k_sums), [q8, q_scales]


def quantize_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_q: int, block_k: int,
                 k_mean: torch.Tensor | None = None, pooled: list[torch.Tensor] | None = None):
    """The whole pre-pass: ``(q8, q_scales, k8, k_scales, k_mean, vt8, v_scales)``, ``quantize_blocks(q, block_q)``
    (``pooled``'s where given: ``pool_quantize``'s five or ``pool_quantize_queries``' two operands) and
    ``quantize_kv``'s five. The Triton FP8 kernels take ``quantize_kv``'s and quantize Q's blocks themselves or load
    ``pooled``'s."""
    q_part = pooled[:2] if pooled else quantize_blocks(q, block_q)
    return (*q_part, *quantize_kv(k, v, block_k, k_mean, pooled))


def quantize_kv(k: torch.Tensor, v: torch.Tensor, block_k: int, k_mean: torch.Tensor | None = None,
                pooled: list[torch.Tensor] | None = None):
    """The pre-pass of K and V: ``(k8, k_scales, k_mean, vt8, v_scales)`` (see ``quantize_keys``,
    ``quantize_v_transposed``, V^T's keys permuted where ``permutes_keys(block_k)``).
    ``k_mean``: the smoothing mean ``mean_N(k)`` ``(B, Hk, 1, D)`` or ``(B, Hk, D)`` fp32 where the caller has it
    (module docstring; zeros: K unsmoothed), else taken here; returned ``(B, Hk, D)`` contiguous. ``pooled``:
    ``pool_quantize``'s quantized operands of these k, v (then K's pass is skipped; ``k_mean`` must be zeros), or
    ``pool_quantize_queries``' (Q's alone: K's pass runs)."""
    bsz, kv_heads, _, d = k.shape
    pooled_keys = pooled[2:] if pooled else []
    if k_mean is None:
        if pooled_keys:
            raise ValueError("quantize_kv with pooled (unsmoothed) operands needs k_mean: zeros of (B, Hk, D)")
        with torch.no_grad():
            k_mean = key_mean(k, block_k)
    elif k_mean.numel() != bsz * kv_heads * d:
        raise ValueError(f"k_mean must hold one mean per batch, KV head and channel of k {tuple(k.shape)}, "
                         f"(B, Hk, 1, D) or (B, Hk, D); got shape {tuple(k_mean.shape)}")
    k_mean = k_mean.reshape(bsz, kv_heads, d).to(torch.float32).contiguous()
    if pooled_keys:
        k8, k_scales, v_amax = pooled_keys
    else:
        k8, k_scales, v_amax = quantize_keys(k, v, block_k, k_mean)
    vt8, v_scales = quantize_v_transposed(v, v_amax, permutes_keys(block_k))
    return k8, k_scales, k_mean, vt8, v_scales
