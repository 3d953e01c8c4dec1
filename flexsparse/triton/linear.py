"""Gather-subtract of per-block linear-attention states: the O(N K) core of SLA's masked linear branch.

A state is a flat fp32 vector of ``M`` numbers per block (the masked branch packs ``[h_j | z_j]``,
``D x (D + 1)``). For every output row r of every output head:

    ``out[r] = total - sum_{e in list(r)} src[ids[e]]``

with the list either a CSR row of a fixed-width table (the forward: query block i, its skipped key
blocks, ``src`` the key-block states of its KV head) or a CSC segment (the backward: key block j, the
query blocks that skipped it, ``src`` the query-block gradients, summed over the query heads of the KV
head). Each listed state is read once and accumulated in fp32 in list order (deterministic); programs
are (row, head, column chunk), rows fastest, so concurrent programs share one head's states in L2.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import launcher
from .layout import cdiv

_BM, _U = 1024, 4  # state columns per program, listed states loaded per step


@triton.jit
def _gather_subtract_kernel(TOTAL, SRC, IDS, OFFSETS, OUT, HO, GROUP, SRC_DIV, TOT_DIV, ROWS, SRC_ROWS,
                            LIST_LEN, WIDTH, M, CSR: tl.constexpr, U: tl.constexpr, BM: tl.constexpr):
    r = tl.program_id(0)
    bho = tl.program_id(1)
    b = bho // HO
    ho = bho - b * HO
    cols = tl.program_id(2) * BM + tl.arange(0, BM)
    col_ok = cols < M
    acc = tl.zeros([BM], tl.float32)
    for g in range(GROUP):
        head = (b * HO + ho) * GROUP + g                       # list head (b, ho * GROUP + g)
        src = SRC + (head // SRC_DIV).to(tl.int64) * SRC_ROWS * M
        ids = IDS + head.to(tl.int64) * LIST_LEN
        if CSR:
            start = r * WIDTH
            end = start + WIDTH
        else:
            start = tl.load(OFFSETS + head.to(tl.int64) * (ROWS + 1) + r)
            end = tl.load(OFFSETS + head.to(tl.int64) * (ROWS + 1) + r + 1)
        for e in range(start, end, U):
            u = e + tl.arange(0, U)
            ok = u < end
            j = tl.load(ids + u, mask=ok, other=0)
            tile = tl.load(src + j.to(tl.int64)[:, None] * M + cols[None, :], mask=ok[:, None] & col_ok[None, :],
                           other=0.0)
            acc += tl.sum(tile.to(tl.float32), axis=0)
    total = tl.load(TOTAL + ((b * HO + ho) // TOT_DIV).to(tl.int64) * M + cols, mask=col_ok, other=0.0)
    tl.store(OUT + (bho.to(tl.int64) * ROWS + r) * M + cols, total - acc, mask=col_ok)


def _launch(total, src, ids, offsets, out, heads_out: int, group: int, src_div: int, tot_div: int, rows: int,
            src_rows: int, list_len: int, width: int, csr: bool) -> torch.Tensor:
    m = src.shape[-1]
    launcher(_gather_subtract_kernel)[(rows, out.shape[0] * heads_out, cdiv(m, _BM))](
        total, src, ids, offsets, out, heads_out, group, src_div, tot_div, rows, src_rows, list_len, width, m,
        CSR=csr, U=_U, BM=_BM)
    return out


def query_states(total: torch.Tensor, states: torch.Tensor, skipped: torch.Tensor) -> torch.Tensor:
    """``total[kv] - sum_{j in skipped[b, h, i]} states[b, kv, j]`` per query block: ``(B, H, Tq, M)`` fp32.

    total: ``(B, Hk, M)`` fp32; states: ``(B, Hk, Tk, M)`` (fp32, or any float dtype read as fp32);
    skipped: ``(B, H, Tq, S)`` int32 ids (kv = the KV head of query head h under GQA).
    """
    bsz, heads, tq, width = skipped.shape
    kv_heads, tk, m = states.shape[1:]
    group = heads // kv_heads
    out = states.new_empty(bsz, heads, tq, m, dtype=torch.float32)
    return _launch(total.contiguous(), states.contiguous(), skipped.contiguous(), skipped, out, heads, 1, group,
                   group, tq, tk, tq * width, width, True)


def key_states(total: torch.Tensor, grads: torch.Tensor, offsets: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``total[b, kv] - sum_{h of kv} sum_{i in csc[b, h, j]} grads[b, h, i]`` per key block: ``(B, Hk, Tk, M)``.

    total: ``(B, Hk, M)`` fp32; grads: ``(B, H, Tq, M)``; the key-major lists of query heads h, ``offsets``
    ``(B, H, Tk + 1)`` and ``rows`` ``(B, H, L)`` int32 (``flexsparse.masks.CSC``).
    """
    bsz, heads, tq, m = grads.shape
    kv_heads, tk = total.shape[1], offsets.shape[2] - 1
    out = grads.new_empty(bsz, kv_heads, tk, m, dtype=torch.float32)
    return _launch(total.contiguous(), grads.contiguous(), rows.contiguous(), offsets.contiguous(), out, kv_heads,
                   heads // kv_heads, 1, 1, tk, tq, rows.shape[2], 0, False)
