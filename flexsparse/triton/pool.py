"""Mean-pooling pyramid: levels 1..L of ``x (B, H, N, D)`` concatenated along the token dim.

Level l holds the true means of the real fine tokens under each span of ``b^l`` (fp32 sums, built
recursively from the previous level's sums, as ``flexsparse.masks.pool_pyramid`` does). One pass over x
makes levels 1 and 2 (a program sums the ``b x b`` fine tokens of one level-2 token: its ``b`` level-1 sums,
then their sum), so x is read once; each deeper level is one more pass over the level-2 sums.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import launcher
from .layout import Levels, cdiv, pow2


@triton.jit
def _pool_kernel(SRC, SUMS, MEANS, LOW, s_b, s_h, s_n, p_b, p_h,
                 H, N, src_tokens, src_off, dst_off, dst_tokens, span, up_off, up_tokens,
                 D: tl.constexpr, BD: tl.constexpr, BLOCK: tl.constexpr, TT: tl.constexpr, STEP: tl.constexpr,
                 FROM_SUMS: tl.constexpr, UP: tl.constexpr, KEEP_SUMS: tl.constexpr, HAS_LOW: tl.constexpr):
    """Tokens ``pid * STEP ... + STEP`` of a level (means of ``BLOCK`` source tokens each; ``TT >= STEP`` a power
    of two); with ``UP`` (``STEP == BLOCK``) also token ``pid`` of the level above (the mean of those), whose
    sums are stored with ``KEEP_SUMS``. With ``HAS_LOW`` every mean is also stored rounded to ``LOW``'s dtype."""
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh - b * H
    r = tl.arange(0, TT)
    t = tl.where(r < STEP, pid * STEP + r, dst_tokens)
    dim = tl.arange(0, BD)
    pyr = b.to(tl.int64) * p_b + h.to(tl.int64) * p_h
    if FROM_SUMS:
        base = SUMS + pyr + tl.cast(src_off, tl.int64) * D  # not src_off.to: a constant in torch 2.11's analysis
        stride = D
    else:
        base = SRC + b.to(tl.int64) * s_b + h.to(tl.int64) * s_h
        stride = s_n
    total = tl.zeros([TT, BD], tl.float32)
    for j in tl.static_range(BLOCK):  # the j-th child of every token: independent loads, no cross-thread sum
        child = t * BLOCK + j
        ptr = base + child.to(tl.int64)[:, None] * stride + dim[None, :]
        total += tl.load(ptr, mask=(child < src_tokens)[:, None] & (dim[None, :] < D), other=0.0).to(tl.float32)
    t_ok = t < dst_tokens
    count = tl.maximum(tl.minimum(N - t * span, span), 1).to(tl.float32)
    out = pyr + (dst_off + t).to(tl.int64)[:, None] * D + dim[None, :]
    out_mask = t_ok[:, None] & (dim[None, :] < D)
    if not UP:
        tl.store(SUMS + out, total, mask=out_mask)
    mean = total / count[:, None]
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
        tl.store(MEANS + up_ptr, up_mean.to(MEANS.dtype.element_ty), mask=up_ok)
        if HAS_LOW:
            tl.store(LOW + up_ptr, up_mean.to(LOW.dtype.element_ty), mask=up_ok)


def pool_pyramid(x: torch.Tensor, levels: Levels, dtype: torch.dtype = torch.float32,
                 low: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Means of levels 1..L: ``x (B, H, N, D)`` (last dim contiguous) -> ``(B, H, T_1 + ... + T_L, D)``
    in ``dtype`` (the sums stay fp32). With ``low`` also the same means rounded to x's dtype, from the same pass:
    ``(means, low_means)``."""
    bsz, heads, n, d = x.shape
    means = x.new_empty(bsz, heads, levels.pyramid_tokens, d, dtype=dtype)
    low_means = torch.empty_like(means, dtype=x.dtype) if low else x  # x: LOW unused (common.launcher)
    block = levels.block
    bd, top = pow2(d), levels.levels
    up = top >= 2 and block * bd <= 8192  # the b level-1 tokens of one level-2 token in one tile
    sums = x.new_empty(bsz, heads, levels.pyramid_tokens if (top > 2 or not up) else 1, d, dtype=torch.float32)
    elems = 1024 if x.device.type == "cpu" else 4096  # tile elements (a load per child)
    common = dict(D=d, BD=bd, BLOCK=block, HAS_LOW=low)
    level = 1
    while level <= top:
        dst_tokens, dst_off = levels.rows[level][0], levels.rows[level][1]
        src_tokens, src_off = levels.rows[level - 1][0], levels.rows[level - 1][1]
        two = up and level == 1
        step = block if two else max(1, elems // bd)
        warps = max(1, min(8, pow2(step) * bd // 1024))  # 8 elements (16 bytes of bf16) per thread and load
        up_off, up_tokens = (levels.rows[2][1], levels.rows[2][0]) if two else (0, 0)
        launcher(_pool_kernel)[(cdiv(dst_tokens, step), bsz * heads)](
            x, sums, means, low_means, x.stride(0), x.stride(1), x.stride(2), means.stride(0), means.stride(1),
            heads, n, src_tokens, src_off, dst_off, dst_tokens, block**level, up_off, up_tokens,
            TT=pow2(step), STEP=step, FROM_SUMS=level > 1, UP=two, KEEP_SUMS=two and top > 2, num_warps=warps,
            **common)
        level += 2 if two else 1
    return (means, low_means) if low else means
