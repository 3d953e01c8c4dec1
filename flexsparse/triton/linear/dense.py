"""Dense block-sum strategy of the masked linear branch: sums over kept key blocks as batched matmuls.

The gather strategy (``fwd`` / ``bwd``) reads one ``D x D`` state per (query block, skipped key
block) pair: ``B H Tq S D^2`` bytes, bound by the L2 -> SM bandwidth. The same sums are block matmuls with the
0/1 map of kept blocks ``keep (B, H, Tq, Tk)``: ``H_i = sum_j keep[i, j] h_j``, ``Z_i = sum_j keep[i, j] z_j``
(forward) and ``d h_j = sum_{heads of kv, i} keep[i, j] d H_i`` (backward, ``keep^T``): ``2 B H Tq Tk D^2`` flops
on tensor cores, whatever S is. With bf16 states it wins once ``S / Tk`` exceeds a few percent (measured thresholds in
docs/triton_sla_pieces.md; ``linear_tiles``' ``dense_ratio``). Each kept state enters the sum once (no
subtraction), with fp32 accumulation (``keep`` is exact in bf16).

The matmuls are ``torch.bmm`` (cuBLAS on GPUs: 0.43 ms at B2 H16 Tq=Tk=512 D=128 on an H200, where a Triton
matmul with 128 x 128 x 64 tiles takes 0.93 ms writing fp32); the query heads of a KV head are folded into the rows,
so GQA needs no copy, and ``keep^T`` is a transposed view. Small sums (``SMALL_SUMS`` products at most, where the
call's host time exceeds its GPU work) take one Triton launch for both (``_sums_kernel``): bf16 on an H200, host
22 us per call against 27-31 for the two ``bmm``, GPU 5.5-9.3 us against 9.5-15 up to 2.7e8 products (B2 H8 N4096
D64), 17 against 19 at 1.1e9, 34 against 31 at 4.4e9 (``do_bench`` medians of ``block_sums`` both ways). Sums of
``h`` come out in the states' dtype (bf16 for bf16 inputs: every kernel that reads them rounds them to bf16 for its
tensor-core products anyway), sums of ``z`` in fp32 (the normaliser is an fp32 dot). The sums kernel makes the
0/1 map's tiles itself from the skipped lists (``S`` compares per map entry; S is a few percent of Tk), so a small
call is one launch each way; the cuBLAS path takes the map from one kernel (``keep_rows``: a fill and a scatter,
with the backward's repeated rows), where ``masks.keep_map`` and ``sizes.repeat_rows`` take four or five ATen ops.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._runtime.registry import launcher
from .._runtime.sizes import MAX_GRID_YZ, cdiv, pow2
from ..common.inputs import use_kernels

SMALL_SUMS = 1 << 29   # multiply-adds of both sums up to which they take _sums_kernel rather than two cuBLAS bmm
KEEP_GIVEN, KEEP_ROWS, KEEP_COLUMNS = 0, 1, 2   # _sums_kernel's 0/1 map: given, or made from skipped lists


def matmul(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``a @ b`` batched (``(C, M, K) @ (C, K, N)``, one dtype) with fp32 (or wider) accumulation, the result in
    ``dtype`` (on CPU, where ``bmm`` has no ``out_dtype``, through inputs cast to ``dtype``)."""
    if dtype == a.dtype:
        return torch.bmm(a, b)
    if a.is_cuda:
        return torch.bmm(a, b, out_dtype=dtype)
    return torch.bmm(a.to(dtype), b.to(dtype))


def _folded_keep(keep: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """keep ``(B, H, Tq, Tk)`` as ``(B Hk, G Tq, Tk)`` (a view: the query heads of a KV head are adjacent)."""
    bsz, heads, tq, tk = keep.shape
    return keep.view(bsz * kv_heads, heads // kv_heads * tq, tk)


def query_sums(skipped: torch.Tensor, hs: torch.Tensor, zs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kept key blocks' states summed per query block: ``H (B, H, Tq, D, D)`` in hs's dtype and ``Z (B, H, Tq,
    D)`` fp32. skipped ``(B, H, Tq, S)`` int32 (the key blocks each query block leaves out); hs ``(B, Hk, Tk, D, D)``,
    zs ``(B, Hk, Tk, D)`` (the KV head of each query head), contiguous."""
    bsz, heads, tq, width = skipped.shape
    kv_heads, tk, d = hs.shape[1], hs.shape[2], hs.shape[-1]
    c, rows = bsz * kv_heads, heads // kv_heads * tq
    h, z = hs.view(c, tk, d * d), zs.view(c, tk, d)
    if _kernel_sums(h, c, rows, tk, d):
        rows_h, rows_z = _launch_sums(skipped, h, z, rows, tk, width, KEEP_ROWS)
    else:
        rows_h, rows_z = block_sums(_folded_keep(keep_rows(skipped, tk, hs.dtype), kv_heads), h, z)
    return rows_h.view(bsz, heads, tq, d, d), rows_z.view(bsz, heads, tq, d)


def key_sums(skipped: torch.Tensor, d_hq: torch.Tensor, d_zq: torch.Tensor, kv_heads: int, num_k_blocks: int,
             repeat: int = 1):
    """Key-block state gradients ``d_h (B, Hk, Tk, D, D)`` in d_hq's dtype and ``d_z (B, Hk, Tk, D)`` fp32: the
    query-block ones ``d_hq (B, H, Tq repeat, D, D)``, ``d_zq (B, H, Tq repeat, D)`` (contiguous, one dtype; each
    query block's ``repeat`` partials adjacent) summed over the query blocks (all query heads of the KV head) that
    keep each key block. skipped ``(B, H, Tq, S)`` int32 as ``query_sums``'."""
    bsz, heads, tq, width = skipped.shape
    d = d_hq.shape[-1]
    c, rows = bsz * kv_heads, heads // kv_heads * tq * repeat
    dh, dz = d_hq.view(c, rows, d * d), d_zq.view(c, rows, d)
    if _kernel_sums(dh, c, num_k_blocks, rows, d):
        d_h, d_z = _launch_sums(skipped, dh, dz, num_k_blocks, rows, width, KEEP_COLUMNS, repeat)
    else:
        keep = keep_rows(skipped, num_k_blocks, d_hq.dtype, repeat)
        d_h, d_z = block_sums(_folded_keep(keep, kv_heads).transpose(1, 2), dh, dz)    # (B Hk, Tk, G Tq repeat)
    return d_h.view(bsz, kv_heads, num_k_blocks, d, d), d_z.view(bsz, kv_heads, num_k_blocks, d)


def _kernel_sums(h: torch.Tensor, c: int, m: int, k: int, d: int) -> bool:
    """Whether ``c`` sums of ``(m, k) @ (k, D^2 + D)`` take ``_sums_kernel``: where the kernels run, up to
    ``SMALL_SUMS`` products and ``MAX_GRID_YZ`` batches (the grid's z)."""
    return use_kernels(h) and c <= MAX_GRID_YZ and c * m * k * (d * d + d) <= SMALL_SUMS


def block_sums(a: torch.Tensor, h: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(a @ h in h's dtype, a @ z fp32)``, fp32 accumulation (fp64 for fp64). a ``(C, M, K)`` (any strides), h
    ``(C, K, D^2)`` and z ``(C, K, D)`` contiguous, one dtype. One ``_sums_kernel`` launch where ``_kernel_sums``,
    else ``matmul`` twice."""
    c, m, k = a.shape
    d = z.shape[-1]
    if not _kernel_sums(h, c, m, k, d):
        return matmul(a, h, h.dtype), matmul(a, z, torch.float32)
    return _launch_sums(a, h, z, m, k, 0, KEEP_GIVEN)


def _launch_sums(a: torch.Tensor, h: torch.Tensor, z: torch.Tensor, m: int, k: int, width: int, keep: int,
                 repeat: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``_sums_kernel`` on ``h (C, K, D^2)``, ``z (C, K, D)`` with the 0/1 map ``a``: ``KEEP_GIVEN``: ``a (C, M, K)``
    itself; ``KEEP_ROWS``: ``a`` is skipped ``(B, H, Tq, width)`` and the map's rows are the folded query blocks
    (``query_sums``); ``KEEP_COLUMNS``: the same skipped lists, the map's columns the folded query blocks, each
    ``repeat`` times (``key_sums``)."""
    c, d = h.shape[0], z.shape[-1]
    out_h = h.new_empty(c, m, h.shape[-1])
    out_z = z.new_empty(c, m, d, dtype=torch.float32)
    bm, bn, bk = 64, 128, 32
    h_tiles = cdiv(h.shape[-1], bn)
    strides = a.stride() if keep == KEEP_GIVEN else (0, 0, 0)
    launcher(_sums_kernel)[(cdiv(m, bm), h_tiles + cdiv(d, bn), c)](
        a, h, z, out_h, out_z, m, k, width, *strides, DD=h.shape[-1], D=d, H_TILES=h_tiles, BM=bm, BN=bn, BK=bk,
        IEEE=h.dtype == torch.float32, KEEP=keep, REPEAT=repeat, num_warps=4)
    return out_h, out_z


@triton.jit
def _map_tile(a_ptr, rows, ks, M, K, S, stride_am, stride_ak, dtype: tl.constexpr, KEEP: tl.constexpr,
              REPEAT: tl.constexpr):
    """The ``(rows, ks)`` tile of the 0/1 map in ``dtype`` (``_launch_sums``' ``KEEP`` modes; ``a_ptr``: the batch's
    map, or its skipped lists ``(rows of the map or its columns / REPEAT, S)``), zeros outside ``(M, K)``."""
    ok = (rows[:, None] < M) & (ks[None, :] < K)
    if KEEP == 0:
        return tl.load(a_ptr + rows[:, None] * stride_am + ks[None, :] * stride_ak, mask=ok, other=0.0)
    keep = ok
    for s in range(S):
        if KEEP == 1:                   # rows: query blocks, ks: key blocks
            ids = tl.load(a_ptr + rows.to(tl.int64) * S + s, mask=rows < M, other=-1)
            keep &= ks[None, :] != ids[:, None]
        else:                           # rows: key blocks, ks: query blocks, each REPEAT times
            ids = tl.load(a_ptr + (ks // REPEAT).to(tl.int64) * S + s, mask=ks < K, other=-1)
            keep &= rows[:, None] != ids[None, :]
    return keep.to(dtype)


@triton.jit
def _tile_sum(a_ptr, b_ptr, out_ptr, rows, cols, M, K, S, WIDTH, stride_am, stride_ak, BK: tl.constexpr,
              IEEE: tl.constexpr, KEEP: tl.constexpr, REPEAT: tl.constexpr):
    """``out[rows, cols] = a[rows, :] @ b[:, cols]`` for ``b``, ``out`` of ``WIDTH`` columns (row-major), fp32
    accumulation (IEEE fp32 products for fp32 inputs), one rounding to out's dtype; ``a`` the map of ``_map_tile``."""
    acc = tl.zeros([rows.shape[0], cols.shape[0]], tl.float32)
    for k0 in range(0, K, BK):
        ks = k0 + tl.arange(0, BK)
        a = _map_tile(a_ptr, rows, ks, M, K, S, stride_am, stride_ak, b_ptr.dtype.element_ty, KEEP, REPEAT)
        b = tl.load(b_ptr + ks[:, None] * WIDTH + cols[None, :], mask=(ks[:, None] < K) & (cols[None, :] < WIDTH),
                    other=0.0)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    tl.store(out_ptr + rows[:, None] * WIDTH + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols[None, :] < WIDTH))


@triton.jit
def _sums_kernel(A, H, Z, OUT_H, OUT_Z, M, K, S, stride_ab, stride_am, stride_ak, DD: tl.constexpr,
                 D: tl.constexpr, H_TILES: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 IEEE: tl.constexpr, KEEP: tl.constexpr, REPEAT: tl.constexpr):
    """Column tile ``program_id(1)`` of ``a @ h`` (the first ``H_TILES``) or of ``a @ z`` (the rest), rows tile
    ``program_id(0)``, batch ``program_id(2)`` (``_launch_sums``)."""
    pid_n = tl.program_id(1)
    c = tl.program_id(2).to(tl.int64)
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    if KEEP == 0:
        a_ptr = A + c * stride_ab
    elif KEEP == 1:
        a_ptr = A + c * M * S
    else:
        a_ptr = A + c * (K // REPEAT) * S
    if pid_n < H_TILES:
        _tile_sum(a_ptr, H + c * K * DD, OUT_H + c * M * DD, rows, pid_n * BN + tl.arange(0, BN), M, K, S, DD,
                  stride_am, stride_ak, BK, IEEE, KEEP, REPEAT)
    else:
        _tile_sum(a_ptr, Z + c * K * D, OUT_Z + c * M * D, rows, (pid_n - H_TILES) * BN + tl.arange(0, BN), M, K,
                  S, D, stride_am, stride_ak, BK, IEEE, KEEP, REPEAT)


@triton.jit
def _keep_kernel(SKIPPED, KEEP, S, TK, REPEAT: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_T: tl.constexpr):
    """The ``REPEAT`` rows of query block ``program_id(0)`` of head ``program_id(1)``: ones, then zeros at its ``S``
    skipped key blocks, after a barrier (a zero must land after the one its column got from another thread)."""
    row = tl.program_id(1).to(tl.int64) * tl.num_programs(0) + tl.program_id(0)
    out = KEEP + row * REPEAT * TK
    cols = tl.arange(0, BLOCK_T)
    for start in range(0, REPEAT * TK, BLOCK_T):          # the block's REPEAT rows are adjacent
        tl.store(out + start + cols, tl.full([BLOCK_T], 1, KEEP.dtype.element_ty), mask=start + cols < REPEAT * TK)
    slot = tl.arange(0, BLOCK_S)
    ids = tl.load(SKIPPED + row * S + slot, mask=slot < S, other=0)
    tl.debug_barrier()
    for r in tl.static_range(REPEAT):
        tl.store(out + r * TK + ids, tl.zeros([BLOCK_S], KEEP.dtype.element_ty), mask=slot < S)


def keep_rows(skipped: torch.Tensor, num_k_blocks: int, dtype: torch.dtype, repeat: int = 1) -> torch.Tensor:
    """``masks.keep_map(skipped, num_k_blocks, dtype)`` with each query block's row repeated ``repeat`` times
    (``sizes.repeat_rows``): ``(B, H, Tq * repeat, Tk)``, contiguous, in one launch. skipped ``(B, H, Tq, S)`` int32
    contiguous, ids below ``num_k_blocks``."""
    bsz, heads, tq, width = skipped.shape
    keep = skipped.new_empty(bsz, heads, tq * repeat, num_k_blocks, dtype=dtype)
    launcher(_keep_kernel)[(tq, bsz * heads)](skipped, keep, width, num_k_blocks, REPEAT=repeat,
                                              BLOCK_S=pow2(width), BLOCK_T=min(1024, pow2(repeat * num_k_blocks)))
    return keep
