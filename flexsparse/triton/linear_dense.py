"""Dense block-sum strategy of the masked linear branch: sums over kept key blocks as tensor-core matmuls.

The gather strategy (``linear_fwd`` / ``linear_bwd``) reads one ``D x D`` state per (query block, skipped key
block) pair: ``B H Tq S D^2`` bytes, bound by the L2 -> SM bandwidth. The same sums are block matmuls with the
0/1 map of kept blocks ``keep (B, H, Tq, Tk)``: ``[H_i | Z_i] = sum_j keep[i, j] [h_j | z_j]`` (forward) and
``d[h_j | z_j] = sum_{heads of kv, i} keep[i, j] d[H_i | Z_i]`` (backward, ``keep^T``): ``2 B H Tq Tk D^2``
flops on tensor cores, whatever S is. With bf16 states it wins once ``S / Tk`` exceeds a few percent (cost
model in docs/triton_sla_pieces.md; ``linear_tiles``' ``dense_ratio``). Each kept state enters the sum once
(no subtraction); fp32 accumulation, bf16 operands for bf16 inputs (keep is exact), exact fp32 otherwise.

``_block_sum_kernel``: ``C[c] = A[c] @ B[c // B_DIV]`` per batch entry c, fp32 out, with the column map
``col -> (col // CW) * CS + col % CW + C0`` (writes ``h`` and ``z`` straight into the packed ``(D, D + 1)``
rows). Both operands are plain row-major loads (the transposed map ``keep^T`` is materialised, 2 bytes per
block pair), so no dot reads a transposed shared-memory A operand.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import launcher
from .layout import cdiv


@triton.jit
def _block_sum_kernel(A, B, C, R, KD, A_ROW, M, B_DIV, C_ROW, CW, CS, C0, BM: tl.constexpr, BN: tl.constexpr,
                      BK: tl.constexpr, BF16: tl.constexpr, STAGES: tl.constexpr):
    pid = tl.program_id(0)
    c = tl.program_id(1).to(tl.int64)
    tiles_n = tl.cdiv(M, BN)
    pm = pid // tiles_n
    pn = pid - pm * tiles_n
    rows = pm * BM + tl.arange(0, BM)
    cols = pn * BN + tl.arange(0, BN)
    row_ok = rows < R
    col_ok = cols < M
    a_base = A + c * R * A_ROW
    b_base = B + (c // B_DIV) * KD * M
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in tl.range(0, KD, BK, num_stages=STAGES):
        ks = k0 + tl.arange(0, BK)
        a = tl.load(a_base + rows.to(tl.int64)[:, None] * A_ROW + ks[None, :],          # zero padded to A_ROW
                    mask=row_ok[:, None] & (ks < A_ROW)[None, :], other=0.0)
        b = tl.load(b_base + ks.to(tl.int64)[:, None] * M + cols[None, :],
                    mask=(ks < KD)[:, None] & col_ok[None, :], other=0.0)
        if BF16:
            acc += tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
        else:
            acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    out = (cols // CW) * CS + cols % CW + C0
    tl.store(C + c * R * C_ROW + rows.to(tl.int64)[:, None] * C_ROW + out[None, :], acc,
             mask=row_ok[:, None] & col_ok[None, :])


def dense_tiles(device: torch.device, bf16: bool) -> dict:
    """Matmul tiles ``BM x BN x BK``, warps and stages of ``_block_sum_kernel``."""
    if device.type == "cpu":
        return dict(BM=16, BN=16, BK=16, warps=4, stages=1)
    if bf16:
        return dict(BM=128, BN=128, BK=64, warps=8, stages=3)
    return dict(BM=64, BN=64, BK=32, warps=8, stages=2)


def block_sum(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, b_div: int, col_map: tuple[int, int, int],
              bf16: bool) -> torch.Tensor:
    """``out[c, r, map(m)] = sum_{k < Kd} a[c, r, k] b[c // b_div, k, m]`` (fp32). a: ``(C, R, >= Kd)``, zero past
    Kd (rows padded to ``pad16`` keep the loads aligned and unmasked along k); b: ``(C / b_div, Kd, M)``; out:
    ``(C, R, row)`` fp32; ``col_map = (CW, CS, C0)``: column m goes to ``(m // CW) CS + m % CW + C0``. All
    contiguous."""
    batch, rows, a_row = a.shape
    kd, m = b.shape[1], b.shape[2]
    t = dense_tiles(a.device, bf16)
    launcher(_block_sum_kernel)[(cdiv(rows, t["BM"]) * cdiv(m, t["BN"]), batch)](
        a, b, out, rows, kd, a_row, m, b_div, out.shape[2], *col_map, BM=t["BM"], BN=t["BN"], BK=t["BK"],
        BF16=bf16, STAGES=t["stages"], num_warps=t["warps"], num_stages=t["stages"])
    return out


def pad16(n: int) -> int:
    """``n`` rounded up to a multiple of 16 (row length of the keep maps: 16-byte aligned rows for any dtype)."""
    return cdiv(n, 16) * 16


def keep_map(skipped: torch.Tensor, tk: int, dtype: torch.dtype) -> torch.Tensor:
    """``(B, H, Tq, pad16(Tk))`` in ``dtype``: 1 on the key blocks a query block keeps, 0 on its skipped ones and
    on the padding."""
    keep = torch.ones(*skipped.shape[:3], pad16(tk), dtype=dtype, device=skipped.device)
    keep[..., tk:] = 0.0
    return keep.scatter_(-1, skipped.long(), 0.0)


def query_sums(keep: torch.Tensor, hs: torch.Tensor, zs: torch.Tensor, bf16: bool) -> torch.Tensor:
    """Packed ``rows (B, H, Tq, D (D + 1))`` fp32: ``[H_i | Z_i]`` = the kept key blocks' states summed.
    keep ``(B, H, Tq, pad16(Tk))`` (``keep_map``); hs ``(B, Hk, Tk, D, D)``, zs ``(B, Hk, Tk, D)`` (the KV head of
    each query head)."""
    bsz, heads, tq = keep.shape[:3]
    kv_heads, tk, d = hs.shape[1], hs.shape[2], hs.shape[-1]
    rows = keep.new_empty(bsz * heads, tq, d * (d + 1), dtype=torch.float32)
    a = keep.reshape(bsz * heads, tq, keep.shape[3])
    group = heads // kv_heads
    block_sum(a, hs.reshape(bsz * kv_heads, tk, d * d), rows, group, (d, d + 1, 0), bf16)
    block_sum(a, zs.reshape(bsz * kv_heads, tk, d), rows, group, (1, d + 1, d), bf16)
    return rows.view(bsz, heads, tq, d * (d + 1))


def key_sums(keep: torch.Tensor, d_hq: torch.Tensor, d_zq: torch.Tensor, kv_heads: int, tk: int, bf16: bool):
    """Key-block state gradients ``d_h (B, Hk, Tk, D, D)``, ``d_z (B, Hk, Tk, D)`` fp32: the query-block ones
    ``d_hq (B, H, Tq, D, D)``, ``d_zq (B, H, Tq, D)`` summed over the query blocks (all query heads of the KV
    head) that keep each key block. keep: ``keep_map``'s ``(B, H, Tq, pad16(Tk))``."""
    bsz, heads, tq = keep.shape[:3]
    d = d_hq.shape[-1]
    group = heads // kv_heads
    keep_t = keep.new_zeros(bsz * kv_heads, tk, pad16(group * tq))                       # (B Hk, Tk, G Tq)
    keep_t[..., :group * tq] = keep[..., :tk].reshape(bsz * kv_heads, group * tq, tk).transpose(1, 2)
    d_h = keep.new_empty(bsz * kv_heads, tk, d * d, dtype=torch.float32)
    d_z = keep.new_empty(bsz * kv_heads, tk, d, dtype=torch.float32)
    block_sum(keep_t, d_hq.reshape(bsz * kv_heads, group * tq, d * d), d_h, 1, (d, d, 0), bf16)
    block_sum(keep_t, d_zq.reshape(bsz * kv_heads, group * tq, d), d_z, 1, (d, d, 0), bf16)
    return d_h.view(bsz, kv_heads, tk, d, d), d_z.view(bsz, kv_heads, tk, d)
