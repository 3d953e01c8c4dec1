"""``torch.library`` ops of the block-sparse attention kernels: ``flexsparse::block_attn`` (O, LSE;
differentiable), ``flexsparse::block_attn_bwd`` and ``flexsparse::block_attn_fp8`` (the FP8 forward of the
quantized branch, differentiable by ``block_attn``'s backward evaluated at its own O and LSE: the QAT gradient of
``flexsparse.quant.qat_attention``, with no second, unquantized forward), ``flexsparse::pool_quantize`` (a
selection's pooling with the FP8 operands of unsmoothed Q and K) and ``flexsparse::pool_quantize_queries`` (the same
with Q's alone, for smoothed keys).

Registered with ``triton_op`` (``triton_op`` + ``wrap_triton``, so ``torch.compile(fullgraph=True)`` sees the
kernels; the op bodies are their own fake implementations). Bodies branch on the device: CUDA runs the
kernels, CPU runs them through the Triton interpreter when ``TRITON_INTERPRET=1`` is set (eager only),
else the PyTorch implementation runs (``naive``: the attention and its written-out backward; ``block_attn_fp8``:
the fake-quantized branch). fp64 always takes the PyTorch path. The index table is ``(B, H, Tq, K)`` int32,
ascending key-block ids per row.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ...config import QuantConfig
from ...masks import BlockSelection, num_blocks
from ...quant import E4M3, qat_attention, quantize_kv
from ...quant.formats import quantize_blocks
from .._runtime.registry import triton_op
from ..common.inputs import contiguous, row_views, use_kernels
from ..pooling import naive as pooling_naive
from . import naive


def _selection(indices: Tensor, block_q: int, block_k: int, q: Tensor, k: Tensor) -> BlockSelection:
    return BlockSelection(indices, block_q, block_k, q.shape[2], k.shape[2])


@triton_op("flexsparse::block_attn")
def block_attn(q: Tensor, k: Tensor, v: Tensor, indices: Tensor, block_q: int, block_k: int, scale: float,
               deterministic: bool) -> tuple[Tensor, Tensor]:
    """Block-sparse attention ``o (B, H, Nq, D)`` (q's dtype) and natural-log LSE ``(B, H, Nq)`` fp32.

    q: ``(B, H, Nq, D)``; k, v: ``(B, Hk, Nk, D)`` in q's dtype; indices ``(B, H, ceil(Nq / block_q), K)``
    int32. ``deterministic`` makes dK/dV bitwise reproducible (the backward's CSC lists are sorted).
    """
    if not use_kernels(q):
        return naive.block_sparse_attention(q, k, v, _selection(indices, block_q, block_k, q, k), scale)
    from .fwd import block_forward
    return block_forward(*contiguous(q, k, v, indices), block_q, block_k, scale)


@triton_op("flexsparse::block_attn_bwd")
def block_attn_bwd(do: Tensor, dlse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, indices: Tensor, o: Tensor,
                   lse: Tensor, block_q: int, block_k: int, scale: float,
                   deterministic: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients ``(dq, dk, dv)`` of ``block_attn`` from ``do`` and ``dlse`` (None: no gradient reaches the LSE)."""
    if not use_kernels(q):
        return naive.block_sparse_attention_backward(do, dlse, q, k, v, _selection(indices, block_q, block_k, q, k),
                                                     scale, o, lse)
    from ..common.csc import block_csc
    from .bwd import backward_tiles, block_backward, dkv_blocks
    do, q, k, v, indices, o, lse = contiguous(do, q, k, v, indices, o, lse)
    tile = backward_tiles(q.device, q.shape[3], q.dtype)["DKV_BM"]
    per_tile, dkv_block_q = dkv_blocks(indices, block_q, q.shape[2], tile)   # dK/dV walks query tiles
    offsets, rows = block_csc(per_tile, num_blocks(k.shape[2], block_k), deterministic)
    dlse = None if dlse is None else dlse.contiguous()
    return block_backward(do, dlse, q, k, v, indices, offsets, rows, o, lse, block_q, block_k, scale,
                          dkv_block_q=dkv_block_q)


@triton_op("flexsparse::block_attn_fp8")
def block_attn_fp8(q: Tensor, k: Tensor, v: Tensor, indices: Tensor, block_q: int, block_k: int, scale: float,
                   deterministic: bool, k_mean: Optional[Tensor] = None, smooth_keys: bool = True,
                   # five optional tensors, not a list: torch.library takes no optional list of tensors
                   q8: Optional[Tensor] = None, q_scales: Optional[Tensor] = None, k8: Optional[Tensor] = None,
                   k_scales: Optional[Tensor] = None, v_amax: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """FP8 forward of the quantized block-sparse branch (docs/methods.md "FP8 QAT"; e4m3 Q and K per block, K
    smoothed by its mean with ``smooth_keys``, V per channel, P with the static scale 448): ``o (B, H, Nq, D)``
    (q's dtype) and the natural-log LSE ``(B, H, Nq)`` fp32 of the unsmoothed logits. Arguments as ``block_attn``;
    ``k_mean``: the smoothing mean ``mean_N k`` ``(B, Hk, 1, D)`` fp32 where the caller has it (the kernels'
    pre-pass then reads K once; the PyTorch path takes its own, the same up to fp32 rounding); ``q8 ... v_amax``:
    ``fp8_quant.pool_quantize``'s operands of these q, k, v (K unsmoothed) where the caller has them: the kernels'
    pre-pass then quantizes V alone; or ``q8`` and ``q_scales`` alone (``pool_quantize_queries``'). Gradients:
    ``block_attn_bwd`` on the unquantized q, k, v with this forward's o and LSE (SLA2's "backward(dO_s, O_s, Q, K,
    V)")."""
    pooled = checked_pooled(smooth_keys, q8, q_scales, k8, k_scales, v_amax)
    if not use_kernels(q):
        return _fake_quant_block_attn(q, k, v, _selection(indices, block_q, block_k, q, k), scale, smooth_keys)
    from .fwd_fp8 import block_forward_fp8
    return block_forward_fp8(*contiguous(q, k, v, indices), block_q, block_k, scale,
                             k_mean=fp8_key_shift(k, k_mean, smooth_keys), pooled=pooled)


POOLED_NAMES = ("q8", "q_scales", "k8", "k_scales", "v_amax")


def checked_pooled(smooth_keys: bool, *pooled: Optional[Tensor]) -> Optional[list[Tensor]]:
    """``[q8, q_scales, k8, k_scales, v_amax]`` (``pool_quantize``'s) where all five are given and ``smooth_keys`` is
    off (they are of unsmoothed keys), ``[q8, q_scales]`` (``pool_quantize_queries``') where only those two are,
    None where none is; ValueError otherwise."""
    given = [x is not None for x in pooled]
    if not any(given):
        return None
    if all(given) and not smooth_keys:
        return list(pooled)
    if given == [True, True, False, False, False]:
        return list(pooled[:2])
    raise ValueError("the FP8 ops take pool_quantize's five operands (q8, q_scales, k8, k_scales, v_amax) together "
                     "and with smooth_keys=False, or pool_quantize_queries' q8 and q_scales alone; got "
                     f"{sum(given)} of them ({', '.join(n for n, g in zip(POOLED_NAMES, given) if g)}), "
                     f"smooth_keys={smooth_keys}")


def fp8_key_shift(k: Tensor, k_mean: Optional[Tensor], smooth_keys: bool) -> Optional[Tensor]:
    """What the FP8 kernels' pre-pass subtracts from K ``(B, Hk, N, D)``: ``k_mean`` (None: the pre-pass takes the
    mean) with ``smooth_keys``, else zeros ``(B, Hk, 1, D)`` fp32."""
    if smooth_keys:
        return k_mean
    return k.new_zeros(k.shape[0], k.shape[1], 1, k.shape[3], dtype=torch.float32)


@triton_op("flexsparse::pool_quantize")
def pool_quantize(q: Tensor, k: Tensor, v: Tensor, block_q: int,
                  block_k: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """A block selection's pooling and the FP8 operands of unsmoothed Q and K in one pass
    (``fp8_quant.pool_quantize``): ``(q_means, k_means, k_sums, q8, q_scales, k8, k_scales, v_amax)``, the first
    three ``block_pooling``'s (fp32), then ``block_attn_fp8``'s ``q8 ... v_amax``. q: ``(B, H, Nq, D)``; k, v:
    ``(B, Hk, Nk, D)`` (strided rows read in place). No gradient (a selection's inputs)."""
    if not use_kernels(q):
        return _pool_quantize_reference(q, k, v, block_q, block_k)
    from .fp8_quant import pool_quantize as launch
    pooled, quantized = launch(*row_views(q, k, v), block_q, block_k)
    return (*pooled, *quantized)


@triton_op("flexsparse::pool_quantize_queries")
def pool_quantize_queries(q: Tensor, k: Tensor, block_q: int,
                          block_k: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``pool_quantize`` for smoothed keys (``fp8_quant.pool_quantize_queries``): ``(q_means, k_means, k_sums, q8,
    q_scales)``, the pooling and Q's FP8 operands alone (K's need the mean over all of K). q: ``(B, H, Nq, D)``;
    k: ``(B, Hk, Nk, D)`` (strided rows read in place). No gradient."""
    if not use_kernels(q):
        return _pool_queries_reference(q, k, block_q, block_k)
    from .fp8_quant import pool_quantize_queries as launch
    pooled, quantized = launch(*row_views(q, k), block_q, block_k)
    return (*pooled, *quantized)


def _pool_quantize_reference(q: Tensor, k: Tensor, v: Tensor, block_q: int, block_k: int):
    """``pool_quantize`` in PyTorch (``_pool_queries_reference``, then K's e4m3 blocks and V's amax)."""
    return (*_pool_queries_reference(q, k, block_q, block_k), *_e4m3_blocks(k, block_k),
            v.abs().amax(dim=2).float())


def _pool_queries_reference(q: Tensor, k: Tensor, block_q: int, block_k: int):
    """``pool_quantize_queries`` in PyTorch: ``pooling.naive.block_pooling``'s three in fp32, Q's e4m3 blocks."""
    return (*(t.float() for t in pooling_naive.block_pooling(q, k, block_q, block_k)), *_e4m3_blocks(q, block_q))


def _e4m3_blocks(x: Tensor, block: int) -> tuple[Tensor, Tensor]:
    """``quantize_blocks(x, block)``'s values in ``float8_e4m3fn`` on CUDA, as fp16 elsewhere (the kernels' stand-in,
    ``fp8_quant.storage_dtype``), and its scales ``(B, H, T)``."""
    values, scales = quantize_blocks(x, block)
    return values.to(E4M3 if x.device.type == "cuda" else torch.float16), scales[..., 0]


def _fake_quant_block_attn(q: Tensor, k: Tensor, v: Tensor, selection: BlockSelection, scale: float,
                           smooth_keys: bool):
    """The ``torch`` backend's fake-quantized branch (``qat_attention`` with the default ``QuantConfig``, K smoothed
    with ``smooth_keys``)."""
    def attend(q, k, v, quant):
        k, v = quantize_kv(k, v, quant, selection.block_k)
        return naive.block_sparse_attention(q, k, v, selection, scale, quantize_p=True)

    with torch.no_grad():
        return qat_attention(attend, q, k, v, QuantConfig(smooth_keys=smooth_keys), block_q=selection.block_q,
                             scale=scale)


def _setup(ctx, inputs, output):
    q, k, v, indices, block_q, block_k, scale, deterministic = inputs[:8]
    ctx.save_for_backward(q, k, v, indices, *output)
    ctx.args = (block_q, block_k, scale, deterministic)
    ctx.set_materialize_grads(False)  # an unused LSE gets no zero-filled gradient (dlse=None skips it)


def _backward(ctx, do, dlse):
    q, k, v, indices, o, lse = ctx.saved_tensors
    if do is None:                                  # only the LSE reaches the loss
        do = torch.zeros_like(o)
    dq, dk, dv = block_attn_bwd(do, dlse, q, k, v, indices, o, lse, *ctx.args)
    return dq, dk, dv, None, None, None, None, None


def _fp8_backward(ctx, do, dlse):
    """``_backward``, the same formula at the quantized O and LSE; no gradient to ``k_mean`` (a constant shift) or the
    pooled operands."""
    return *_backward(ctx, do, dlse), *(None,) * 7


block_attn.register_autograd(_backward, setup_context=_setup)
block_attn_fp8.register_autograd(_fp8_backward, setup_context=_setup)
