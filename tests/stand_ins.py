"""Small stand-ins of the attention modules ``flexsparse.patch`` knows: diffusers-style (stock and custom
processor), timm-style, and a generic module that calls SDPA; ``TinyModel`` stacks them in blocks, ``TinyViT`` puts
a class token before its tokens."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.functional import scaled_dot_product_attention as imported_sdpa


class AttnProcessor2_0:
    """Named like diffusers' stock processor; the same computation (without masks and image inputs)."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None):
        batch = hidden_states.shape[0]
        context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        q, k, v = attn.to_q(hidden_states), attn.to_k(context), attn.to_v(context)
        q, k, v = (x.view(batch, -1, attn.heads, x.shape[-1] // attn.heads).transpose(1, 2) for x in (q, k, v))
        q, k = attn.norm_q(q), attn.norm_k(k)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)
        return attn.to_out[1](attn.to_out[0](out.transpose(1, 2).flatten(2)))


class ShiftProcessor:
    """A custom processor with an extra argument (like a RoPE table): patch routes its SDPA call."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, shift=0.0):
        return AttnProcessor2_0()(attn, hidden_states + shift, encoder_hidden_states, attention_mask)


class DiffusersStyleAttention(nn.Module):
    """``to_q``/``to_k``/``to_v``/``to_out``, ``heads``, ``norm_q``/``norm_k``, ``set_processor``."""

    def __init__(self, dim: int, heads: int, cross_dim: int | None = None, processor=None):
        super().__init__()
        self.heads, self.is_cross_attention = heads, cross_dim is not None
        self.to_q = nn.Linear(dim, dim)
        self.to_k, self.to_v = nn.Linear(cross_dim or dim, dim), nn.Linear(cross_dim or dim, dim)
        self.to_out = nn.ModuleList([nn.Linear(dim, dim), nn.Dropout(0.0)])
        self.norm_q, self.norm_k = nn.RMSNorm(dim // heads), nn.RMSNorm(dim // heads)
        self.set_processor(processor or AttnProcessor2_0())

    def set_processor(self, processor) -> None:
        if isinstance(getattr(self, "processor", None), nn.Module) and not isinstance(processor, nn.Module):
            del self._modules["processor"]
        self.processor = processor

    def forward(self, hidden_states, encoder_hidden_states=None, attention_mask=None, **kwargs):
        return self.processor(self, hidden_states, encoder_hidden_states, attention_mask, **kwargs)


class TimmStyleAttention(nn.Module):
    """timm's ``Attention``: ``qkv``, ``num_heads``, ``q_norm``/``k_norm``, ``fused_attn``, ``proj``."""

    def __init__(self, dim: int, num_heads: int, fused_attn: bool = True):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.scale, self.fused_attn = self.head_dim ** -0.5, fused_attn
        self.qkv = nn.Linear(dim, dim * 3)
        self.q_norm, self.k_norm = nn.RMSNorm(self.head_dim), nn.RMSNorm(self.head_dim)
        self.attn_drop, self.proj, self.proj_drop = nn.Dropout(0.0), nn.Linear(dim, dim), nn.Dropout(0.0)

    def forward(self, x, attn_mask=None):
        batch, n, dim = x.shape
        q, k, v = self.qkv(x).reshape(batch, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        if self.fused_attn:
            x = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask,
                                               dropout_p=self.attn_drop.p if self.training else 0.0)
        else:
            attn = (q * self.scale) @ k.transpose(-2, -1)
            if attn_mask is not None:
                attn = attn + attn_mask
            x = self.attn_drop(attn.softmax(dim=-1)) @ v
        return self.proj_drop(self.proj(x.transpose(1, 2).reshape(batch, n, dim)))


class GenericAttention(nn.Module):
    """Own code that calls an imported ``scaled_dot_product_attention``; geometry in ``dim``/``n_heads``."""

    def __init__(self, dim: int, n_heads: int):
        super().__init__()
        self.dim, self.n_heads = dim, n_heads
        self.wqkv, self.wo = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        batch, n, _ = x.shape
        q, k, v = self.wqkv(x).view(batch, n, 3, self.n_heads, -1).permute(2, 0, 3, 1, 4)
        return self.wo(imported_sdpa(q, k, v).transpose(1, 2).flatten(2))


ATTENTIONS = {
    "diffusers": lambda dim, heads: DiffusersStyleAttention(dim, heads),
    "diffusers_custom": lambda dim, heads: DiffusersStyleAttention(dim, heads, processor=ShiftProcessor()),
    "timm": lambda dim, heads: TimmStyleAttention(dim, heads),
    "timm_unfused": lambda dim, heads: TimmStyleAttention(dim, heads, fused_attn=False),
    "generic": lambda dim, heads: GenericAttention(dim, heads),
}


class Block(nn.Module):
    def __init__(self, kind: str, dim: int, heads: int, cross_dim: int | None):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn = ATTENTIONS[kind](dim, heads)
        self.cross = DiffusersStyleAttention(dim, heads, cross_dim=cross_dim) if cross_dim else None
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x, context=None):
        x = x + self.attn(self.norm(x))
        if self.cross is not None:
            x = x + self.cross(x, context)
        return x + self.mlp(x)


class TinyModel(nn.Module):
    """``depth`` blocks of one attention kind (plus diffusers-style cross-attention with ``cross_dim``)."""

    def __init__(self, kind: str, depth: int = 3, dim: int = 32, heads: int = 2, cross_dim: int | None = None):
        super().__init__()
        self.blocks = nn.ModuleList(Block(kind, dim, heads, cross_dim) for _ in range(depth))

    def forward(self, x, context=None):
        for block in self.blocks:
            x = block(x, context)
        return x


class TinyViT(nn.Module):
    """A ViT's token layout: a learned class token before the patch tokens ``(B, N, dim)``, announced as timm's
    VisionTransformer does (``num_prefix_tokens``), then ``depth`` blocks of timm-style attention."""

    def __init__(self, depth: int = 2, dim: int = 32, heads: int = 2):
        super().__init__()
        self.num_prefix_tokens = 1
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim))
        self.blocks = nn.ModuleList(Block("timm", dim, heads, None) for _ in range(depth))

    def forward(self, x):
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        for block in self.blocks:
            x = block(x)
        return x
