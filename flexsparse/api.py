"""The functional entry point ``flexsparse.attention``."""
from __future__ import annotations

import contextlib
from typing import Any, Mapping

import torch

from . import backends
from ._checks import check_qkv, resolve_scale
from .config import Config
from .methods import method_module


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: "Mapping[str, Any] | Config", *,
              backend: str = "auto", scale: float | None = None, return_lse: bool = False,
              params: Mapping[str, torch.Tensor] | None = None):
    """Sparse attention shaped like ``F.scaled_dot_product_attention``.

    q: ``(B, H, Nq, D)``; k, v: ``(B, Hk, Nk, D)`` with ``H % Hk == 0`` (GQA).
    config: a dict such as ``{"method": "llsa", "block_size": 16, "topk": 8}`` or a ``Config``.
    backend: ``"reference"``, ``"torch"``, ``"flex"``, ``"triton"`` or ``"auto"``.
    params: learnable tensors of methods that have them (``SparseAttention`` passes its own).
    Returns ``o (B, H, Nq, D)`` in q's dtype, and with ``return_lse`` also the natural-log LSE
    ``(B, H, Nq)`` (fp32; fp64 for fp64 inputs) of the (sparse) softmax branch.
    """
    cfg = Config.from_dict(config)
    module = method_module(cfg.method)
    check_qkv(q, k, v, self_attention=module.SELF_ATTENTION)
    scale = resolve_scale(scale, q.shape[-1])
    needs_grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    blocks = tuple(getattr(cfg, name) for name in ("block_q", "block_k", "block_size") if hasattr(cfg, name))
    chosen = backends.resolve(backend, cfg.method, module.BACKENDS, q.device, needs_grad, needs_lse=return_lse,
                              dtype=q.dtype, blocks=blocks, head_dim=q.shape[-1], quant=getattr(cfg, "quant", None))
    # a strided view is copied once here, not by every op (and again in the backward). A method whose kernels read
    # views themselves (STRIDED_INPUTS) keeps them, except in a compiled graph that records gradients, where inductor
    # fuses the copies into their producers (compiled DiT-S training at N=65536 ran 4% faster so: docs/triton_llsa.md)
    if chosen == "triton" and (not getattr(module, "STRIDED_INPUTS", False)
                               or (needs_grad and torch.compiler.is_compiling())):
        from .backends.triton_sparse import contiguous_inputs
        q, k, v = contiguous_inputs(q, k, v)
    with _without_autocast(q.device.type):
        out, lse = module.forward(q, k, v, cfg, backend=chosen, scale=scale, params=params, need_lse=return_lse)
    if not return_lse:
        return out
    return out, (lse if lse.dtype == torch.float64 else lse.float())


def _without_autocast(device_type: str):
    """The precision follows the input dtypes (fp32 accumulation); an enclosing autocast region would
    recast the internal matmuls, selection scores included, to bf16/fp16."""
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()
