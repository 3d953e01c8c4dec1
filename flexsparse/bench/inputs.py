"""Structured q, k, v for the benchmark scripts and tests (the runner's own inputs are ``measure.random_qkv``)."""
from __future__ import annotations

import math

import torch


def offset_qkv(batch: int, heads: int, n: int, dim: int, device, seed: int = 0) -> list[torch.Tensor]:
    """bf16 iid normal q, k, v ``(B, H, N, D)``, the keys with a per-head offset like real keys (drawn on
    ``device`` from ``seed``)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    shape = (batch, heads, n, dim)
    q, k, v = (torch.randn(shape, generator=gen, device=device) for _ in range(3))
    k = k + 0.5 * torch.randn(1, heads, 1, dim, generator=gen, device=device)
    return [x.to(torch.bfloat16) for x in (q, k, v)]


def structured_qkv(batch, heads, n, dim, *, gain=1.5, seed=0, device="cpu", dtype=torch.float32):
    """q, k, v ``(B, H, N, D)`` with the structure of image-token attention (docs/methods.md "FP8 QAT"):
    low-rank smooth token signals (8 sinusoids along the sequence) plus noise, q and k RMS-normalised with
    ``gain`` (the logit spread), k with a per-head offset, v with a per-head mean and low rank."""
    gen = torch.Generator().manual_seed(seed)
    t = torch.linspace(0, 1, n)
    freq, phase = torch.rand(8, generator=gen) * 20, torch.rand(8, generator=gen) * 6
    basis = torch.sin(2 * math.pi * freq * t[:, None] + phase)

    def tokens(offset):
        x = basis @ torch.randn(batch, heads, 8, dim, generator=gen)
        x = x + 0.5 * torch.randn(batch, heads, n, dim, generator=gen)
        x = x + offset * torch.randn(1, heads, 1, dim, generator=gen)
        return x / x.pow(2).mean(-1, keepdim=True).sqrt() * gain

    v = basis @ torch.randn(batch, heads, 8, dim, generator=gen) + torch.randn(1, heads, 1, dim, generator=gen)
    v = v + 0.3 * torch.randn(batch, heads, n, dim, generator=gen)
    return [x.to(device, dtype) for x in (tokens(0.0), tokens(1.0), v)]
