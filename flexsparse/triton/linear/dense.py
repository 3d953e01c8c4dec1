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
fp32 (the normaliser is an fp32 dot).
"""
from __future__ import annotations

import torch


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
    D)`` fp32. keep ``(B, H, Tq, Tk)`` (``masks.keep_map``, hs's dtype); hs ``(B, Hk, Tk, D, D)``, zs
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
    query blocks (all query heads of the KV head) that keep each key block. keep: ``masks.keep_map``'s
    ``(B, H, Tq, Tk)``."""
    bsz, heads, tq, tk = keep.shape
    d = d_hq.shape[-1]
    a = _folded_keep(keep, kv_heads).transpose(1, 2)                                 # (B Hk, Tk, G Tq)
    rows = heads // kv_heads * tq
    d_h = matmul(a, d_hq.view(bsz * kv_heads, rows, d * d), d_hq.dtype)
    d_z = matmul(a, d_zq.view(bsz * kv_heads, rows, d), torch.float32)
    return d_h.view(bsz, kv_heads, tk, d, d), d_z.view(bsz, kv_heads, tk, d)
