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
so GQA needs no copy, and ``keep^T`` is a transposed view. Sums of ``h`` come out in the states' dtype (bf16 for bf16
inputs: every kernel that reads them rounds them to bf16 for its tensor-core products anyway), sums of ``z`` in
fp32 (the normaliser is an fp32 dot). The 0/1 map comes from one kernel (``keep_rows``: a fill and a scatter,
with the backward's repeated rows), where ``masks.keep_map`` and ``sizes.repeat_rows`` take four or five ATen ops.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._runtime.registry import launcher
from .._runtime.sizes import pow2


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


def query_sums(keep: torch.Tensor, hs: torch.Tensor, zs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kept key blocks' states summed per query block: ``H (B, H, Tq, D, D)`` in hs's dtype and ``Z (B, H, Tq,
    D)`` fp32. keep ``(B, H, Tq, Tk)`` (``keep_rows``, hs's dtype); hs ``(B, Hk, Tk, D, D)``, zs
    ``(B, Hk, Tk, D)`` (the KV head of each query head), contiguous."""
    bsz, heads, tq = keep.shape[:3]
    kv_heads, tk, d = hs.shape[1], hs.shape[2], hs.shape[-1]
    a = _folded_keep(keep, kv_heads)
    rows_h = matmul(a, hs.view(bsz * kv_heads, tk, d * d), hs.dtype)
    rows_z = matmul(a, zs.view(bsz * kv_heads, tk, d), torch.float32)
    return rows_h.view(bsz, heads, tq, d, d), rows_z.view(bsz, heads, tq, d)


def key_sums(keep: torch.Tensor, d_hq: torch.Tensor, d_zq: torch.Tensor, kv_heads: int):
    """Key-block state gradients ``d_h (B, Hk, Tk, D, D)`` in d_hq's dtype and ``d_z (B, Hk, Tk, D)`` fp32: the
    query-block ones ``d_hq (B, H, Tq, D, D)``, ``d_zq (B, H, Tq, D)`` (contiguous, keep's dtype) summed over the
    query blocks (all query heads of the KV head) that keep each key block. keep: ``keep_rows``'s
    ``(B, H, Tq, Tk)``."""
    bsz, heads, tq, tk = keep.shape
    d = d_hq.shape[-1]
    a = _folded_keep(keep, kv_heads).transpose(1, 2)                                 # (B Hk, Tk, G Tq)
    rows = heads // kv_heads * tq
    d_h = matmul(a, d_hq.view(bsz * kv_heads, rows, d * d), d_hq.dtype)
    d_z = matmul(a, d_zq.view(bsz * kv_heads, rows, d), torch.float32)
    return d_h.view(bsz, kv_heads, tk, d, d), d_z.view(bsz, kv_heads, tk, d)


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
