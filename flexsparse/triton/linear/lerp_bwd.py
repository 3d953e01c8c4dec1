"""Backward of SLA2's combine ``out = O_l + alpha (O_s - O_l)`` (``alpha = sigmoid(alpha_logit)`` per query
block, rounded to the input dtype as the forward mixed) in one pass over the tokens: ``dO_s = alpha dO`` and
``dO_l = (1 - alpha) dO`` (fp32 products, one rounding to the input dtype each: ``dO - dO_s`` in the input dtype
would cancel) and the per-(batch, head, query block) partial sums of ``dO . (O_s - O_l)`` times the sigmoid's
derivative ``alpha (1 - alpha)`` (fp32 alpha) for the logit's gradient, fp32.

One program per (query block, batch x head), walking the block's tokens in chunks of ``CHUNK`` rows; tokens past
N and padded head dims are masked. One pass instead of four in PyTorch (a product, two differences, a batched
dot).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._runtime.registry import launcher
from .._runtime.sizes import pow2


@triton.jit
def _lerp_grad_kernel(DOUT, OS, OL, LOGIT, DOS, DOL, PART, H, N, TQ, LOGIT_ROWS, BLOCK_Q: tl.constexpr,
                      CHUNK: tl.constexpr, D: tl.constexpr, BD: tl.constexpr):
    qb = tl.program_id(0)
    bh = tl.program_id(1)
    row = tl.where(LOGIT_ROWS > 1, bh % H, 0)
    alpha = tl.sigmoid(tl.load(LOGIT + row * TQ + qb).to(tl.float32))
    a = alpha.to(DOUT.dtype.element_ty).to(tl.float32)
    base = bh.to(tl.int64) * N * D
    dim = tl.arange(0, BD)
    total = tl.zeros([CHUNK, BD], tl.float32)
    for c in tl.range(0, BLOCK_Q, CHUNK):
        local = c + tl.arange(0, CHUNK)
        rows = qb * BLOCK_Q + local
        ok = ((local < BLOCK_Q) & (rows < N))[:, None] & (dim < D)[None, :]
        offs = base + rows.to(tl.int64)[:, None] * D + dim[None, :]
        g = tl.load(DOUT + offs, mask=ok, other=0.0).to(tl.float32)
        tl.store(DOS + offs, (g * a).to(DOS.dtype.element_ty), mask=ok)
        tl.store(DOL + offs, (g * (1.0 - a)).to(DOL.dtype.element_ty), mask=ok)
        o_s = tl.load(OS + offs, mask=ok, other=0.0).to(tl.float32)
        o_l = tl.load(OL + offs, mask=ok, other=0.0).to(tl.float32)
        diff = (o_s - o_l).to(OS.dtype.element_ty).to(tl.float32)
        total += g * diff
    tl.store(PART + bh.to(tl.int64) * TQ + qb, tl.sum(tl.sum(total, axis=1), axis=0) * (alpha * (1.0 - alpha)))


def lerp_backward(dout: torch.Tensor, o_s: torch.Tensor, o_l: torch.Tensor, alpha_logit: torch.Tensor,
                  block_q: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dO_s, dO_l, partial)``: dO_s, dO_l ``(B, H, N, D)`` in dout's dtype, partial ``(B, H, Tq)`` fp32 with
    ``sum(partial over B (and H for one logit row)) = d alpha_logit``. dout, o_s, o_l: ``(B, H, N, D)`` contiguous,
    one dtype; alpha_logit: ``(1 or H, Tq)`` contiguous, any float dtype (alpha, its fp32 sigmoid, rounded to
    dout's: the value the forward mixed with)."""
    bsz, heads, n, d = dout.shape
    tq = alpha_logit.shape[-1]
    d_os, d_ol = torch.empty_like(dout), torch.empty_like(dout)
    part = dout.new_empty(bsz, heads, tq, dtype=torch.float32)
    bd = pow2(d, 16)
    chunk = max(16, min(pow2(block_q), 4096 // bd))
    launcher(_lerp_grad_kernel)[(tq, bsz * heads)](
        dout, o_s, o_l, alpha_logit, d_os, d_ol, part, heads, n, tq, alpha_logit.shape[0], BLOCK_Q=block_q,
        CHUNK=chunk, D=d, BD=bd, num_warps=4)
    return d_os, d_ol, part
