"""Block selection and the sparse branch shared by the single-level block methods (``topk``, ``vsa``, ``sla``,
``sla2``)."""
from __future__ import annotations

from functools import partial

import torch

from .._checks import check_topk_fits
from ..backends import sparse_primitives
from ..config import QuantConfig
from ..masks import BlockSelection, block_topk, mean_pool, num_blocks
from ..quant import qat_attention, quantize_kv, quantizes_p, unsupported_reason
from ..reference import topk_dense


def select_blocks(q: torch.Tensor, k: torch.Tensor, cfg, pooled: tuple[torch.Tensor, torch.Tensor] | None = None
                  ) -> BlockSelection:
    """Top ``cfg.topk`` key blocks per query block from raw-dot pooled scores (fp32, no grad). ``pooled``:
    ``(mean_pool(q, block_q), mean_pool(k, block_k))`` when the caller has them."""
    check_topk_fits("topk", cfg.topk, num_blocks(k.shape[2], cfg.block_k), "key blocks")
    with torch.no_grad():
        q_bar, k_bar = pooled if pooled is not None else (mean_pool(q, cfg.block_q), mean_pool(k, cfg.block_k))
        top, _ = block_topk(q_bar.detach(), k_bar.detach(), cfg.topk)
    return BlockSelection(top, cfg.block_q, cfg.block_k, q.shape[2], k.shape[2])


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, selection: BlockSelection, scale: float, *,
                    backend: str, deterministic: bool = False,
                    quant: QuantConfig | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Softmax attention of each query block over its selected key blocks on ``backend`` (``reference``:
    the dense spec); with ``quant`` an FP8 fake-quantized forward and straight-through backward
    (``flexsparse.quant.qat_attention``; ``triton``: the quantized forward in one FP8 kernel, the gradients of
    its bf16 kernels). ``deterministic`` (the config key) makes the ``triton`` backward
    bitwise reproducible; the other backends ignore it. Returns ``o (B, H, N, D)`` and ``lse (B, H, N)``."""
    if backend == "reference":
        return topk_dense(q, k, v, selection, scale, quant=quant)
    primitives = sparse_primitives(backend)
    options = {"deterministic": deterministic} if backend == "triton" else {}
    if quant is None:
        return primitives.block_sparse_attention(q, k, v, selection, scale, **options)
    dtype = q.dtype

    def attend(q, k, v, quant):
        if quant is None:
            return primitives.block_sparse_attention(q, k, v, selection, scale, **options)
        k, v = quantize_kv(k, v, quant, selection.block_k)
        if backend == "flex":               # flex computes in the input dtype: fake-quantized values rounded to it
            q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        return primitives.block_sparse_attention(q, k, v, selection, scale, quantize_p=quantizes_p(quant))

    fused = getattr(primitives, "fp8_block_sparse_attention", None)   # one FP8 kernel of the quantized forward
    if fused is not None:
        reason = unsupported_reason(backend, quant)
        if reason is not None:              # resolve() checks it too; this guards direct calls
            raise ValueError(f"backend {backend!r} cannot run config key 'quant': {reason}")
        fused = partial(fused, selection=selection, scale=scale)
    return qat_attention(attend, q, k, v, quant, block_q=selection.block_q, scale=scale, fused=fused)
