"""Mean-pooling pyramid: levels 1..L of ``x (B, H, N, D)`` concatenated along the token dim.

Level l holds the true means of the real fine tokens under each span of ``b^l`` (fp32 sums, built
recursively from the previous level's sums, as ``flexsparse.masks.pool_pyramid`` does).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import launcher
from .layout import Levels, cdiv, pow2


@triton.jit
def _pool_level_kernel(SRC, SUMS, MEANS, s_b, s_h, s_n, p_b, p_h,
                       H, N, src_tokens, src_off, dst_off, dst_tokens, span,
                       D: tl.constexpr, BD: tl.constexpr, BLOCK: tl.constexpr, BB: tl.constexpr,
                       TT: tl.constexpr, FROM_SUMS: tl.constexpr):
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh - b * H
    t = pid * TT + tl.arange(0, TT)
    j = tl.arange(0, BB)
    dim = tl.arange(0, BD)
    child = t[:, None] * BLOCK + j[None, :]
    ok = (j[None, :] < BLOCK) & (child < src_tokens)
    mask = ok[:, :, None] & (dim[None, None, :] < D)
    pyr = b.to(tl.int64) * p_b + h.to(tl.int64) * p_h
    if FROM_SUMS:
        ptr = SUMS + pyr + (src_off + child).to(tl.int64)[:, :, None] * D + dim[None, None, :]
    else:
        base = SRC + b.to(tl.int64) * s_b + h.to(tl.int64) * s_h
        ptr = base + child.to(tl.int64)[:, :, None] * s_n + dim[None, None, :]
    total = tl.sum(tl.load(ptr, mask=mask, other=0.0).to(tl.float32), axis=1)
    t_ok = t < dst_tokens
    count = tl.maximum(tl.minimum(N - t * span, span), 1).to(tl.float32)
    out = pyr + (dst_off + t).to(tl.int64)[:, None] * D + dim[None, :]
    out_mask = t_ok[:, None] & (dim[None, :] < D)
    tl.store(SUMS + out, total, mask=out_mask)
    tl.store(MEANS + out, (total / count[:, None]).to(MEANS.dtype.element_ty), mask=out_mask)


def pool_pyramid(x: torch.Tensor, levels: Levels, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Means of levels 1..L: ``x (B, H, N, D)`` (last dim contiguous) -> ``(B, H, T_1 + ... + T_L, D)``
    in ``dtype`` (the sums stay fp32)."""
    bsz, heads, n, d = x.shape
    means = x.new_empty(bsz, heads, levels.pyramid_tokens, d, dtype=dtype)
    sums = x.new_empty(bsz, heads, levels.pyramid_tokens, d, dtype=torch.float32)
    block = levels.block
    bb, bd = pow2(block), pow2(d)
    elems, warps = (4096, 4) if x.device.type == "cpu" else (16384, 8)
    tt = max(1, elems // (bb * bd))
    for level in range(1, levels.levels + 1):
        dst_tokens, dst_off = levels.rows[level][0], levels.rows[level][1]
        src_tokens, src_off = levels.rows[level - 1][0], levels.rows[level - 1][1]
        grid = (cdiv(dst_tokens, tt), bsz * heads)
        launcher(_pool_level_kernel)[grid](
            x, sums, means, x.stride(0), x.stride(1), x.stride(2), means.stride(0), means.stride(1),
            heads, n, src_tokens, src_off, dst_off, dst_tokens, block**level,
            D=d, BD=bd, BLOCK=block, BB=bb, TT=tt, FROM_SUMS=level > 1, num_warps=warps)
    return means
