"""Mean-pooling pyramid: levels 1..L of ``x (B, H, N, D)`` concatenated along the token dim.

Level l holds the true means of the real fine tokens under each span of ``b^l`` (fp32 sums, built
recursively from the previous level's sums, as ``naive.pool_pyramid`` does). One pass over x
makes levels 1 and 2 (a program sums the ``b x b`` fine tokens of one level-2 token: its ``b`` level-1 sums,
then their sum), so x is read once; each deeper level is one more pass over the level-2 sums. LLSA's q, k and v
take their first pass in one launch (``pool_qkv``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._runtime.registry import launcher
from .._runtime.sizes import cdiv, pow2
from ...masks.levels import SPAN, Levels
from .._runtime.tiles import with_overrides


@triton.jit
def pool_tokens(src, stride, SUMS, MEANS, LOW, pyr, pid, N, src_tokens, dst_off, dst_tokens, span, up_off, up_tokens,
                D: tl.constexpr, BD: tl.constexpr, BLOCK: tl.constexpr, TT: tl.constexpr, STEP: tl.constexpr,
                UP: tl.constexpr, KEEP_SUMS: tl.constexpr, HAS_MEANS: tl.constexpr, HAS_LOW: tl.constexpr):
    """Tokens ``pid * STEP ... + STEP`` of a level (means of ``BLOCK`` source rows each of ``src``, row stride
    ``stride``; ``TT >= STEP`` a power of two); with ``UP`` (``STEP == BLOCK``) also token ``pid`` of the level above
    (the mean of those), whose sums are stored with ``KEEP_SUMS``; without ``UP`` the level's sums are stored. Means
    go to ``MEANS`` with ``HAS_MEANS`` and, rounded to ``LOW``'s dtype, to ``LOW`` with ``HAS_LOW``; ``pyr`` is the
    pyramids' offset of this head."""
    r = tl.arange(0, TT)
    t = tl.where(r < STEP, pid * STEP + r, dst_tokens)
    dim = tl.arange(0, BD)
    total = tl.zeros([TT, BD], tl.float32)
    for j in tl.static_range(BLOCK):  # the j-th child of every token: independent loads, no cross-thread sum
        child = t * BLOCK + j
        ptr = src + child.to(tl.int64)[:, None] * stride + dim[None, :]
        total += tl.load(ptr, mask=(child < src_tokens)[:, None] & (dim[None, :] < D), other=0.0).to(tl.float32)
    count = tl.maximum(tl.minimum(N - t * span, span), 1).to(tl.float32)
    out = pyr + (dst_off + t).to(tl.int64)[:, None] * D + dim[None, :]
    out_mask = (t < dst_tokens)[:, None] & (dim[None, :] < D)
    if not UP:
        tl.store(SUMS + out, total, mask=out_mask)
    mean = total / count[:, None]
    if HAS_MEANS:
        tl.store(MEANS + out, mean.to(MEANS.dtype.element_ty), mask=out_mask)
    if HAS_LOW:
        tl.store(LOW + out, mean.to(LOW.dtype.element_ty), mask=out_mask)
    if UP:
        up = tl.sum(total, axis=0)
        up_span = span * BLOCK
        up_count = tl.maximum(tl.minimum(N - pid * up_span, up_span), 1).to(tl.float32)
        up_ptr = pyr + (up_off + pid).to(tl.int64) * D + dim
        up_ok = (pid < up_tokens) & (dim < D)
        if KEEP_SUMS:
            tl.store(SUMS + up_ptr, up, mask=up_ok)
        up_mean = up / up_count
        if HAS_MEANS:
            tl.store(MEANS + up_ptr, up_mean.to(MEANS.dtype.element_ty), mask=up_ok)
        if HAS_LOW:
            tl.store(LOW + up_ptr, up_mean.to(LOW.dtype.element_ty), mask=up_ok)


@triton.jit
def _pool_kernel(SRC, SUMS, MEANS, LOW, s_b, s_h, s_n, p_b, p_h, H, N, src_tokens, src_off, dst_off, dst_tokens, span,
                 up_off, up_tokens, D: tl.constexpr, BD: tl.constexpr, BLOCK: tl.constexpr, TT: tl.constexpr,
                 STEP: tl.constexpr, FROM_SUMS: tl.constexpr, UP: tl.constexpr, KEEP_SUMS: tl.constexpr,
                 HAS_LOW: tl.constexpr):
    """``pool_tokens`` of one head (``program_id(1)``) of x (``SRC``) or, with ``FROM_SUMS``, of the level below's
    sums (rows ``src_off ...`` of ``SUMS``)."""
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh - b * H
    pyr = b.to(tl.int64) * p_b + h.to(tl.int64) * p_h
    if FROM_SUMS:
        pool_tokens(SUMS + pyr + tl.cast(src_off, tl.int64) * D, D, SUMS, MEANS, LOW, pyr, pid, N, src_tokens,
                    dst_off, dst_tokens, span, up_off, up_tokens, D, BD, BLOCK, TT, STEP, UP, KEEP_SUMS, True,
                    HAS_LOW)  # tl.cast, not src_off.to: a constant in torch 2.11's analysis
    else:
        pool_tokens(SRC + b.to(tl.int64) * s_b + h.to(tl.int64) * s_h, s_n, SUMS, MEANS, LOW, pyr, pid, N,
                    src_tokens, dst_off, dst_tokens, span, up_off, up_tokens, D, BD, BLOCK, TT, STEP, UP, KEEP_SUMS,
                    True, HAS_LOW)


@triton.jit
def _pool_qkv_kernel(Q, K, V, SQ, SK, SV, QM, KM, KL, VL, q_b, q_h, q_n, k_b, k_h, k_n, v_b, v_h, v_n, pq_b, pq_h,
                     pk_b, pk_h, H, HK, N, dst_tokens, up_off, up_tokens, D: tl.constexpr, BD: tl.constexpr,
                     BLOCK: tl.constexpr, TT: tl.constexpr, STEP: tl.constexpr, UP: tl.constexpr,
                     KEEP_SUMS: tl.constexpr):
    """The first pass of ``_pool_kernel`` (level 1 from the tokens, with ``UP`` level 2 too) for q, k and v at once
    (``program_id(2)``): q's means to ``QM`` (fp32), k's to ``KM`` (fp32) and ``KL`` (k's dtype), v's to ``VL``;
    sums (for later passes) to ``SQ``, ``SK``, ``SV``. ``program_id(1)`` runs over q's heads; k and v programs past
    their ``HK`` heads return."""
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    which = tl.program_id(2)
    if which == 0:
        b = bh // H
        h = bh - b * H
        pyr = b.to(tl.int64) * pq_b + h.to(tl.int64) * pq_h
        pool_tokens(Q + b.to(tl.int64) * q_b + h.to(tl.int64) * q_h, q_n, SQ, QM, QM, pyr, pid, N, N, 0, dst_tokens,
                    BLOCK, up_off, up_tokens, D, BD, BLOCK, TT, STEP, UP, KEEP_SUMS, True, False)
    elif bh < (tl.num_programs(1) // H) * HK:
        b = bh // HK
        h = bh - b * HK
        pyr = b.to(tl.int64) * pk_b + h.to(tl.int64) * pk_h
        if which == 1:
            pool_tokens(K + b.to(tl.int64) * k_b + h.to(tl.int64) * k_h, k_n, SK, KM, KL, pyr, pid, N, N, 0,
                        dst_tokens, BLOCK, up_off, up_tokens, D, BD, BLOCK, TT, STEP, UP, KEEP_SUMS, True, True)
        else:
            pool_tokens(V + b.to(tl.int64) * v_b + h.to(tl.int64) * v_h, v_n, SV, VL, VL, pyr, pid, N, N, 0,
                        dst_tokens, BLOCK, up_off, up_tokens, D, BD, BLOCK, TT, STEP, UP, KEEP_SUMS, False, True)


ELEMENTS = {"cpu": 1024, "cuda": 4096}  # tile elements of a pass (a load per child)


def sums_step(d: int, device: torch.device) -> int:
    """Tokens per program of a pass that does not make two levels at once: ``ELEMENTS`` of the device's tile."""
    return max(1, ELEMENTS.get(device.type, 4096) // pow2(d))


PASS_PROGRAMS = {"cuda": 1024}  # a pass from sums takes fewer tokens per program until it has this many programs:
# with whole tiles, level 3 at N262144 (64 tokens a head) would run one program per head: 22.7 us a pass against
# 2-4 (H200)


def pass_step(d: int, device: torch.device, tokens: int, heads: int) -> int:
    """Tokens per program of a pass from sums making ``tokens`` tokens of each of ``heads`` heads: ``sums_step``,
    halved while the pass has fewer than ``PASS_PROGRAMS`` programs (a power of two, at least 1)."""
    step = sums_step(d, device)
    while step > 1 and heads * cdiv(tokens, step) < PASS_PROGRAMS.get(device.type, 0):
        step //= 2
    return step


def warps_for(step: int, bd: int) -> int:
    """Warps of a pass of ``step`` tokens per program: a warp per 1024 elements of its ``(step, bd)`` tile (32 per
    thread and load), at least 2 and at most 8 (the first pass at b=16, D=64, B2 H8 N65536: 153 us against 164 on
    one warp, H100; 4 warps 155; at D=128, 4 warps measured 338 against 311)."""
    return max(2, min(8, pow2(step) * bd // 1024))


def first_pass_warps(step: int, bd: int, keep_sums: bool) -> int:
    """Warps of the first pass: ``warps_for``, but 4 where the pass keeps sums for a third level on tiles of 1024
    elements (b=16, D=64). H200, B2 H8 bf16, the pass in a graph-replayed forward: N262144 L3 418 us against 526
    on 2 warps (the op alone at N1048576: 1680 against 2108); not at D=32 (223 against 216 us there), nor at L=2
    (N65536 117.9 against 114.5 us, the op alone) or D=128 (282 against 216 at L=2, 1112 against 850 at L=3, the op
    alone)."""
    return 4 if pow2(step) * bd == 1024 and keep_sums else warps_for(step, bd)


def first_pass(levels: Levels, d: int, device: torch.device) -> tuple[int, int, tuple[int, int, int], dict]:
    """The first pass over the tokens, shared by ``_pool_kernel`` and ``_pool_qkv_kernel``: level 1, and level 2 too
    (``UP``) where the ``b`` level-1 tokens of one level-2 token fit one tile. Returns ``(programs per head, the
    first level the passes from sums make, (dst_tokens, up_off, up_tokens), constants and warps)``."""
    bd = pow2(d)
    up = levels.levels >= 2 and levels.block * bd <= 8192
    step = levels.block if up else sums_step(d, device)
    (up_tokens, up_off), dst_tokens = (levels.rows[2][:2] if up else (0, 0)), levels.rows[1][0]
    keep = up and levels.levels > 2
    constants = dict(D=d, BD=bd, BLOCK=levels.block, TT=pow2(step), STEP=step, UP=up, KEEP_SUMS=keep,
                     num_warps=with_overrides("pool", {}, ("warps",)).get("warps", first_pass_warps(step, bd, keep)))
    return cdiv(dst_tokens, step), 3 if up else 2, (dst_tokens, up_off, up_tokens), constants


def deeper_levels(x: torch.Tensor, sums: torch.Tensor, means: torch.Tensor, low: torch.Tensor, levels: Levels,
                  level: int, has_low: bool) -> None:
    """Levels ``level ..L`` of ``x``'s pyramid (its level ``level - 1`` sums in ``sums``), one pass each from the sums
    below (``x`` gives the shape and is the unused source pointer)."""
    bsz, heads, n, d = x.shape
    bd, block = pow2(d), levels.block
    for level in range(level, levels.levels + 1):
        (dst_tokens, dst_off), (src_tokens, src_off) = levels.rows[level][:2], levels.rows[level - 1][:2]
        step, span = pass_step(d, x.device, dst_tokens, bsz * heads), levels.rows[level][SPAN]
        launcher(_pool_kernel)[(cdiv(dst_tokens, step), bsz * heads)](
            x, sums, means, low, x.stride(0), x.stride(1), x.stride(2), means.stride(0), means.stride(1), heads, n,
            src_tokens, src_off, dst_off, dst_tokens, span, 0, 0, D=d, BD=bd, BLOCK=block, TT=pow2(step),
            STEP=step, FROM_SUMS=True, UP=False, KEEP_SUMS=False, HAS_LOW=has_low, num_warps=warps_for(step, bd))


def pool_pyramid(x: torch.Tensor, levels: Levels) -> torch.Tensor:
    """Means of levels 1..L: ``x (B, H, N, D)`` (last dim contiguous) -> ``(B, H, T_1 + ... + T_L, D)`` fp32."""
    bsz, heads, n, d = x.shape
    means = x.new_empty(bsz, heads, levels.pyramid_tokens, d, dtype=torch.float32)
    programs, next_level, (dst_tokens, up_off, up_tokens), constants = first_pass(levels, d, x.device)
    sums = _sums(x, levels, constants)
    launcher(_pool_kernel)[(programs, bsz * heads)](
        x, sums, means, x, x.stride(0), x.stride(1), x.stride(2), means.stride(0), means.stride(1), heads, n, n, 0,
        levels.rows[1][1], dst_tokens, levels.block, up_off, up_tokens, FROM_SUMS=False, HAS_LOW=False,
        **constants)  # x: LOW unused (_runtime.registry.launcher)
    deeper_levels(x, sums, means, x, levels, next_level, False)
    return means


def _sums(x: torch.Tensor, levels: Levels, constants: dict) -> torch.Tensor:
    """fp32 sums the passes after the first read (a placeholder where there are none), for ``first_pass``'s
    ``constants``."""
    bsz, heads, _, d = x.shape
    rows = levels.pyramid_tokens if (constants["KEEP_SUMS"] or not constants["UP"]) else 1
    return x.new_empty(bsz, heads, rows, d, dtype=torch.float32)


def pool_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             levels: Levels) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """LLSA's pyramids from one first pass over q, k and v (``(B, H, N, D)``, ``(B, Hk, N, D)``, last dims
    contiguous): q's and k's means in fp32 (the selection's scores) and k's and v's in their dtype (what the
    attention reads), ``(B, H or Hk, T_1 + ... + T_L, D)`` each; the same values as ``pool_pyramid``."""
    bsz, heads, n, d = q.shape
    kv_heads = k.shape[1]
    q_means = q.new_empty(bsz, heads, levels.pyramid_tokens, d, dtype=torch.float32)
    k_means = q.new_empty(bsz, kv_heads, levels.pyramid_tokens, d, dtype=torch.float32)
    k_low, v_low = torch.empty_like(k_means, dtype=k.dtype), torch.empty_like(k_means, dtype=v.dtype)
    programs, next_level, first_args, constants = first_pass(levels, d, q.device)
    sums = [_sums(x, levels, constants) for x in (q, k, v)]
    launcher(_pool_qkv_kernel)[(programs, bsz * heads, 3)](
        q, k, v, *sums, q_means, k_means, k_low, v_low, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
        *q_means.stride()[:2], *k_means.stride()[:2], heads, kv_heads, n, *first_args, **constants)
    deeper_levels(q, sums[0], q_means, q, levels, next_level, False)
    deeper_levels(k, sums[1], k_means, k_low, levels, next_level, True)
    deeper_levels(v, sums[2], v_low, v, levels, next_level, False)
    return q_means, k_means, k_low, v_low
