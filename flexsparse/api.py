"""The functional entry point ``flexsparse.attention``: validate, pick the backend, then the method's select and
attend steps on it."""
from __future__ import annotations

import contextlib
from typing import Any, Mapping

import torch

from . import backends
from ._checks import check_qkv, resolve_scale
from .config import Config
from .methods import METHODS


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
    method = METHODS[cfg.method]
    check_qkv(q, k, v, self_attention=method.self_attention)
    scale = resolve_scale(scale, q.shape[-1])
    needs_grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    blocks = tuple(getattr(cfg, name) for name in ("block_q", "block_k", "block_size") if hasattr(cfg, name))
    chosen = backends.resolve(backend, method, q.device, needs_grad, needs_lse=return_lse, dtype=q.dtype,
                              blocks=blocks, head_dim=q.shape[-1], quant=getattr(cfg, "quant", None))
    q, k, v = chosen.prepare_inputs(q, k, v, keep_views=method.keeps_views, needs_grad=needs_grad)
    with _without_autocast(q.device.type):
        params = method.check_params(cfg, q, params)
        selection = method.select(q, k, v, cfg, chosen, params)
        out, lse = chosen.attend(method, q, k, v, selection, cfg, scale=scale, params=params, need_lse=return_lse)
    if not return_lse:
        return out
    return out, (lse if lse.dtype == torch.float64 else lse.float())


def _without_autocast(device_type: str):
    """The precision follows the input dtypes (fp32 accumulation); an enclosing autocast region would
    recast the internal matmuls, selection scores included, to bf16/fp16."""
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()
