"""SLA2's router projections of the pooled q and k in one launch: ``(q_bar P_q^T, k_bar P_k^T)``.

Two fp32 matmuls of a few hundred rows by a ``D x D`` map, where the call is small: two cuBLAS ``mm`` took ~28 us of
host time each at B1 H1 N4096 on an H200 host (``torch.profiler``), the one launch 20-35 us through ``fast_launch``.
A program maps ``BM`` rows of one of the two (``program_id(0)`` below ``q_tiles``: q's rows, else k's) with fp32
FMA products (``input_precision="ieee"``, as cuBLAS's fp32 GEMM; the order of the sums differs, so the scores may
differ from the PyTorch path's in the last bits).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._runtime.registry import launcher
from .._runtime.sizes import cdiv, pow2

MAX_KERNEL_D = 128   # head dims above take the PyTorch matmuls
_BM, _BK = 32, 16


@triton.jit
def _project_rows(X, P, OUT, tile, ROWS, D: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    """Rows ``tile * BM ...`` of ``OUT = X P^T`` (``X``, ``OUT`` ``(ROWS, D)`` fp32 contiguous; ``P`` ``(D, D)``
    contiguous, any float dtype)."""
    rows = tile * BM + tl.arange(0, BM)
    cols = tl.arange(0, BD)
    acc = tl.zeros([BM, BD], tl.float32)
    for k0 in range(0, BD, BK):
        ks = k0 + tl.arange(0, BK)
        x = tl.load(X + rows.to(tl.int64)[:, None] * D + ks[None, :], mask=(rows[:, None] < ROWS) & (ks[None, :] < D),
                    other=0.0)
        p_t = tl.load(P + cols[None, :] * D + ks[:, None], mask=(ks[:, None] < D) & (cols[None, :] < D), other=0.0)
        acc = tl.dot(x, p_t.to(tl.float32), acc, input_precision="ieee")
    tl.store(OUT + rows.to(tl.int64)[:, None] * D + cols[None, :], acc,
             mask=(rows[:, None] < ROWS) & (cols[None, :] < D))


@triton.jit
def _project_pair_kernel(QB, KB, PQ, PK, OUT_Q, OUT_K, ROWS_Q, ROWS_K, Q_TILES, D: tl.constexpr, BD: tl.constexpr,
                         BM: tl.constexpr, BK: tl.constexpr):
    """Tile ``program_id(0)`` of q's rows (below ``Q_TILES``) or of k's (``project_pair``)."""
    pid = tl.program_id(0)
    if pid < Q_TILES:
        _project_rows(QB, PQ, OUT_Q, pid, ROWS_Q, D, BD, BM, BK)
    else:
        _project_rows(KB, PK, OUT_K, pid - Q_TILES, ROWS_K, D, BD, BM, BK)


def project_pair(q_bar: torch.Tensor, k_bar: torch.Tensor, proj_q: torch.Tensor,
                 proj_k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q_bar P_q^T, k_bar P_k^T)`` fp32: q_bar ``(B, H, Tq, D)`` and k_bar ``(B, Hk, Tk, D)`` fp32 contiguous,
    the projections ``(D, D)`` contiguous (any float dtype, read in fp32); D <= ``MAX_KERNEL_D``."""
    d = q_bar.shape[-1]
    rows_q, rows_k = q_bar.numel() // d, k_bar.numel() // d
    out_q, out_k = torch.empty_like(q_bar), torch.empty_like(k_bar)
    q_tiles = cdiv(rows_q, _BM)
    launcher(_project_pair_kernel)[(q_tiles + cdiv(rows_k, _BM),)](
        q_bar, k_bar, proj_q, proj_k, out_q, out_k, rows_q, rows_k, q_tiles, D=d, BD=pow2(d, 16), BM=_BM, BK=_BK)
    return out_q, out_k
