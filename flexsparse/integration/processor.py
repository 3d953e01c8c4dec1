"""``FlexSparseAttnProcessor``: a diffusers attention processor that runs a flexsparse method.

It does what diffusers' ``AttnProcessor2_0`` does (``to_q``/``to_k``/``to_v``, per-head ``norm_q``/
``norm_k``, ``to_out``, optional ``spatial_norm``/``group_norm``/``norm_cross``, residual and output
rescale) with the SDPA call replaced by a ``SparseSDPA``. The stock processors attend ``encoder_hidden_states`` as
cross-attention keys, never joined with the image tokens, so its calls pass no ``joint``. It is an ``nn.Module``,
so after ``attn.set_processor(FlexSparseAttnProcessor(...))`` its learned parameters are in ``attn``'s
``state_dict`` (under ``processor.flexsparse.``). Under diffusers' context parallelism
(``model.enable_parallelism``, which sets ``_parallel_config``) it exchanges the sequence shards itself
(``flexsparse.integration.context_parallel``).
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
from torch import nn

from ..config import Config
from ..parallel import ParallelConfig
from .context_parallel import processor_parallel
from .sdpa import SparseSDPA


class FlexSparseAttnProcessor(nn.Module):
    """``processor(attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None)``
    with ``hidden_states (B, N, C)`` or ``(B, C, H, W)``; arguments of ``SparseSDPA`` (``strict`` and ``name``
    included: its dense fallbacks are logged, or raise under ``strict``, as ``SparseSDPA``'s). It calls its
    ``SparseSDPA`` itself, never diffusers' attention dispatch, so no diffusers attention backend bypasses it."""

    _parallel_config = None   # a diffusers ParallelConfig, set by model.enable_parallelism (context parallelism)

    def __init__(self, config: "Mapping[str, Any] | Config", *, head_dim: int, num_heads: int,
                 seq_len: int | None = None, backend: str = "auto", dense_warmup_steps: int = 0,
                 token_grid: Sequence[int] | None = None, parallel: ParallelConfig | None = None,
                 strict: bool = False, name: str | None = None):
        super().__init__()
        self.flexsparse = SparseSDPA(config, head_dim=head_dim, num_heads=num_heads, seq_len=seq_len,
                                     backend=backend, dense_warmup_steps=dense_warmup_steps, token_grid=token_grid,
                                     parallel=parallel, strict=strict, name=name)

    def __call__(self, attn: nn.Module, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, temb: torch.Tensor | None = None) -> torch.Tensor:
        residual = hidden_states
        if getattr(attn, "spatial_norm", None) is not None:
            hidden_states = attn.spatial_norm(hidden_states, temb)
        image = hidden_states.dim() == 4
        if image:
            batch, channels, height, width = hidden_states.shape
            hidden_states = hidden_states.view(batch, channels, height * width).transpose(1, 2)
        batch, context_len = (hidden_states if encoder_hidden_states is None else encoder_hidden_states).shape[:2]
        if attention_mask is not None:
            attention_mask = attn.prepare_attention_mask(attention_mask, context_len, batch)
            attention_mask = attention_mask.view(batch, attn.heads, -1, attention_mask.shape[-1])
        if getattr(attn, "group_norm", None) is not None:
            hidden_states = attn.group_norm(hidden_states.transpose(1, 2)).transpose(1, 2)
        query = attn.to_q(hidden_states)
        context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        if encoder_hidden_states is not None and getattr(attn, "norm_cross", None):
            context = attn.norm_encoder_hidden_states(context)
        key, value = attn.to_k(context), attn.to_v(context)
        head_dim = key.shape[-1] // attn.heads
        query, key, value = (x.view(batch, -1, attn.heads, head_dim).transpose(1, 2) for x in (query, key, value))
        if getattr(attn, "norm_q", None) is not None:
            query = attn.norm_q(query)
        if getattr(attn, "norm_k", None) is not None:
            key = attn.norm_k(key)
        parallel = processor_parallel(self.flexsparse, self, attn, encoder_hidden_states)
        out = self.flexsparse(query, key, value, attn_mask=attention_mask, parallel=parallel)
        out = out.transpose(1, 2).reshape(batch, -1, attn.heads * head_dim).to(query.dtype)
        out = attn.to_out[1](attn.to_out[0](out))
        if image:
            out = out.transpose(-1, -2).reshape(batch, channels, height, width)
        if getattr(attn, "residual_connection", False):
            out = out + residual
        return out / getattr(attn, "rescale_output_factor", 1.0)
