"""A pixel-space DiT like the LLSA paper's DiT-S: patch size 1 (one token per pixel, no VAE), 2D
axial RoPE on Z-ordered positions, qk-RMSNorm, adaLN-Zero, attention from a flexsparse config dict.

Tokens are put in Z-order (``flexsparse.masks.morton_order_2d``) before the blocks, so the pooling
blocks of the sparse methods are compact squares, and restored after. RoPE positions are rescaled to
``rope_size`` (``(p + 0.5) * rope_size / side - 0.5``, LLSA's linear resampling), so a model pretrained
at ``rope_size`` sees the same position range at any resolution.

With a ``flexsparse.ParallelConfig`` of degree P > 1 (sequence parallelism), each rank of the ``"ulysses"`` group
keeps a contiguous shard of the Z-ordered tokens (``torch.tensor_split``: lengths differ by at most one) through the
blocks, with the RoPE angles of those tokens' global positions; attention exchanges heads for tokens
(``flexsparse.parallel``) and the output shards are gathered back (``gather_sequence``), so every rank returns the
whole image.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import flexsparse
from flexsparse.masks import morton_order_2d


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float = 10000.0):
    """``cos, sin`` ``(N, head_dim / 2)`` of 2D axial RoPE for float ``positions (N, 2)``: the first half
    of the channel pairs rotates with the row, the second with the column."""
    if head_dim % 4:
        raise ValueError(f"2D RoPE needs a head dim divisible by 4, got {head_dim}")
    freqs = theta ** (-torch.arange(0, head_dim // 2, 2, dtype=torch.float64) / (head_dim // 2))
    angles = torch.cat([positions[:, :1].double() * freqs, positions[:, 1:].double() * freqs], dim=-1)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved channel pairs of ``x (B, H, N, D)`` by the angles of ``cos, sin (N, D/2)``."""
    pairs = x.float().unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2).to(x.dtype)


def timestep_embedding(t: torch.Tensor, dim: int = 256, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal embedding ``(B, dim)`` of timesteps ``t (B,)``."""
    freqs = torch.exp(-math.log(max_period) * torch.arange(dim // 2, device=t.device) / (dim // 2))
    args = t.float()[:, None] * freqs[None]
    return torch.cat([args.cos(), args.sin()], dim=-1)


def shard_lengths(n: int, parts: int) -> list[int]:
    """Token counts of ``parts`` contiguous shards of ``n`` tokens (``torch.tensor_split``'s split: the first
    ``n % parts`` hold one more)."""
    return [n // parts + (rank < n % parts) for rank in range(parts)]


def gather_sequence(x: torch.Tensor, lengths: list[int], group) -> torch.Tensor:
    """``(B, n_rank, C)`` shards of the ranks of ``group`` (lengths ``lengths`` in rank order) -> ``(B, N, C)``
    on every rank. The backward adds up the gradients that every rank's copy sends back to this rank's shard
    (an all-to-all, so shards may differ in length)."""
    bsz, _, channels = x.shape
    sizes = [bsz * n * channels for n in lengths]
    send = x.contiguous().flatten().repeat(len(lengths))
    received = flexsparse.parallel.all_to_all(send, sizes, [x.numel()] * len(lengths), group)
    return torch.cat([piece.view(bsz, n, channels) for piece, n in zip(received.split(sizes), lengths)], dim=1)


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


class Attention(nn.Module):
    """qkv -> per-head RMSNorm of q, k -> RoPE -> flexsparse attention (``full``: dense SDPA) -> proj."""

    def __init__(self, hidden: int, heads: int, attn: dict, seq_len: int, backend: str,
                 parallel: flexsparse.ParallelConfig | None = None):
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.q_norm, self.k_norm = nn.RMSNorm(self.head_dim, eps=1e-5), nn.RMSNorm(self.head_dim, eps=1e-5)
        dense = attn["method"] == "full" and parallel is None
        self.attention = None if dense else flexsparse.SparseAttention(
            attn, head_dim=self.head_dim, num_heads=heads, seq_len=seq_len, backend=backend, parallel=parallel)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, n, hidden = x.shape
        q, k, v = self.qkv(x).view(batch, n, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = apply_rope(self.q_norm(q), cos, sin).to(v.dtype), apply_rope(self.k_norm(k), cos, sin).to(v.dtype)
        out = F.scaled_dot_product_attention(q, k, v) if self.attention is None else self.attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(batch, n, hidden))


class Block(nn.Module):
    """adaLN-Zero transformer block: attention and a 4x GELU MLP, each shifted/scaled/gated by the
    timestep embedding (the modulation starts at zero, so each block starts as the identity)."""

    def __init__(self, hidden: int, heads: int, mlp_ratio: float, attn: dict, seq_len: int, backend: str,
                 parallel: flexsparse.ParallelConfig | None = None):
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(hidden, heads, attn, seq_len, backend, parallel)
        self.norm2 = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        width = int(hidden * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(hidden, width), nn.GELU(approximate="tanh"), nn.Linear(width, hidden))
        self.ada = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 6 * hidden))

    def forward(self, x, c, cos, sin):
        shift1, scale1, gate1, shift2, scale2, gate2 = self.ada(c).chunk(6, dim=-1)
        x = x + gate1.unsqueeze(1) * self.attn(modulate(self.norm1(x), shift1, scale1), cos, sin)
        return x + gate2.unsqueeze(1) * self.mlp(modulate(self.norm2(x), shift2, scale2))


class DiT(nn.Module):
    """``forward(x (B, 3, S, S), t (B,)) -> (B, 3, S, S)`` velocity for timesteps ``t`` in ``[0, 1000]``.

    image_size: the side S (the token order, RoPE table and SLA2's per-block parameters depend on it).
    attn: flexsparse config dict of every block's attention (``{"method": "full"}``: dense SDPA).
    rope_size: the side the RoPE positions are rescaled to (the pretraining resolution).
    checkpointing: recompute each block in the backward pass instead of keeping its activations
    (about 12x less activation memory for ~1/3 more compute).
    parallel: sequence parallelism over its ``"ulysses"`` ranks (degree 1 or ``None``: none); every rank of the
    group must call ``forward`` with the same ``x`` and ``t``. The heads must be divisible by the degree.
    """

    def __init__(self, image_size: int, attn: Mapping[str, Any], *, hidden: int = 384, heads: int = 6,
                 depth: int = 12, mlp_ratio: float = 4.0, rope_size: int | None = None, backend: str = "auto",
                 checkpointing: bool = False, channels: int = 3, parallel: flexsparse.ParallelConfig | None = None):
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden={hidden} must be divisible by heads={heads}")
        self.parallel = parallel if parallel is not None and parallel.ulysses_degree > 1 else None
        if self.parallel is not None and heads % self.parallel.ulysses_degree:
            raise ValueError(f"heads={heads} must be divisible by the sequence-parallel degree "
                             f"{self.parallel.ulysses_degree} (each rank attends over the whole sequence for "
                             f"heads / degree heads)")
        attn = flexsparse.Config.from_dict(attn).to_dict()
        self.image_size, self.rope_size, self.checkpointing = image_size, rope_size or image_size, checkpointing
        n = image_size * image_size
        order = morton_order_2d(image_size, image_size)
        self.register_buffer("perm", order.perm, persistent=False)
        self.register_buffer("inverse", order.inverse, persistent=False)
        positions = ((order.positions.double() + 0.5) * self.rope_size / image_size - 0.5).clamp(0, self.rope_size - 1)
        cos, sin = rope_tables(positions, hidden // heads)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.embed = nn.Linear(channels, hidden)
        self.t_embed = nn.Sequential(nn.Linear(256, hidden), nn.SiLU(), nn.Linear(hidden, hidden))
        self.blocks = nn.ModuleList(Block(hidden, heads, mlp_ratio, attn, n, backend, self.parallel)
                                    for _ in range(depth))
        self.final_norm = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.final_ada = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 2 * hidden))
        self.out = nn.Linear(hidden, channels)
        self._init_weights()

    def _init_weights(self) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                nn.init.zeros_(module.bias)
        nn.init.normal_(self.t_embed[0].weight, std=0.02)
        nn.init.normal_(self.t_embed[2].weight, std=0.02)
        for ada in [block.ada for block in self.blocks] + [self.final_ada]:
            nn.init.zeros_(ada[1].weight)
            nn.init.zeros_(ada[1].bias)
        nn.init.zeros_(self.out.weight)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        batch, channels, height, width = x.shape
        if height != self.image_size or width != self.image_size:
            raise ValueError(f"this DiT was built for {self.image_size}x{self.image_size} images, got {height}x{width}")
        perm, cos, sin = self.token_shard()
        tokens = self.embed(x.flatten(2).transpose(1, 2)[:, perm])
        c = self.t_embed(timestep_embedding(t))
        for block in self.blocks:
            if self.checkpointing and torch.is_grad_enabled():
                tokens = checkpoint(block, tokens, c, cos, sin, use_reentrant=False)
            else:
                tokens = block(tokens, c, cos, sin)
        shift, scale = self.final_ada(c).chunk(2, dim=-1)
        out = self.out(modulate(self.final_norm(tokens), shift, scale))
        if self.parallel is not None:
            out = gather_sequence(out, self.shard_lengths(), self.parallel.ulysses_group)
        return out[:, self.inverse].transpose(1, 2).reshape(batch, channels, height, width)

    def shard_lengths(self) -> list[int]:
        """Token counts of the sequence-parallel ranks' shards, in rank order."""
        return shard_lengths(self.perm.numel(), self.parallel.ulysses_degree)

    def token_shard(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``perm, cos, sin`` of the tokens this rank keeps: pixel indices ``(n,)`` in Z-order and their RoPE
        tables ``(n, head_dim / 2)`` (global positions); all ``N`` tokens without sequence parallelism."""
        if self.parallel is None:
            return self.perm, self.rope_cos, self.rope_sin
        lengths = self.shard_lengths()
        start = sum(lengths[:self.parallel.ulysses_rank])
        shard = slice(start, start + lengths[self.parallel.ulysses_rank])
        return self.perm[shard], self.rope_cos[shard], self.rope_sin[shard]
