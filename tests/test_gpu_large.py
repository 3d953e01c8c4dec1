"""GPU: the Triton kernels at a million tokens with more than 2^31 elements per tensor.

One call on ``(1, 34, 2^20, 64)`` bf16 tensors (2.3e9 elements: the offsets of the last two heads do not fit
in int32) whose last head is a copy of the first: selection and attention run per head, so the last head
must come out exactly like the first (output and gradients; ``deterministic=True`` fixes the order of the
key-major sums). A 32-bit offset shows as a mismatch or a crash, not as noise. Needs 45-90 GiB of free GPU
memory (skipped otherwise); run this file on its own, not under ``pytest -n``.

Every method of the registry on ``backend="triton"`` (its example with K = 8 key blocks, deterministic) but
``vsa``, whose coarse branch runs SDPA: its flash backward adds dQ with atomics, so two equal heads need not get
the same bits there.
"""
from __future__ import annotations

import pytest
import torch

import flexsparse
import triton_support as ts
from flexsparse.config import Config
from flexsparse.masks import num_blocks
from flexsparse.methods import METHODS
from triton_support import HAS_CUDA, gpu

SHAPE = (1, 34, 1 << 20, 64)
GIB = {"llsa": 45, "topk": 45, "sla": 70}   # GPU memory a call needs (measured); other methods are given 90


def _config(name: str) -> dict:
    """The method's example, deterministic, with 8 key blocks per query block (``topk`` or its ratio)."""
    cfg = ts.example_config(name, topk=8, deterministic=True)
    if "topk_ratio" in cfg:
        cfg["topk_ratio"] = 8 / num_blocks(SHAPE[2], Config.from_dict(cfg).block_k)
    return cfg


CASES = [(_config(name), GIB.get(name, 90)) for name in ts.triton_methods() if name != "vsa"]  # (config, GiB)


def _free_gib() -> float:
    """Free GPU memory, the caching allocator's blocks of earlier cases released first."""
    if not HAS_CUDA:
        return 0.0
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0] / 2**30


@gpu
@pytest.mark.parametrize("cfg,gib", CASES, ids=lambda c: c["method"] if isinstance(c, dict) else "")
def test_gpu_head_past_int32_offsets_equals_first_head(cfg, gib):
    if _free_gib() < gib:
        pytest.skip(f"needs ~{gib} GiB of free GPU memory, {_free_gib():.0f} free")
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, grad = (torch.randn(SHAPE, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
    for x in (q, k, v, grad):
        x[:, -1] = x[:, 0]
    # the method's parameters with random noise (sla's zero projection so reaches output and gradients), equal for
    # the first and the last head where they have one row per head
    initial = METHODS[cfg["method"]].init_params(Config.from_dict(cfg), SHAPE[-1], SHAPE[1], SHAPE[2])
    params = {name: p.cuda() + torch.randn(p.shape, device="cuda", generator=gen) / SHAPE[-1]**0.5
              for name, p in initial.items()} or None
    for p in (params or {}).values():
        if p.dim() and p.shape[0] == SHAPE[1]:
            p[-1] = p[0]
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = flexsparse.attention(q, k, v, cfg, backend="triton", params=params)
    out.backward(grad)
    for name, x in (("out", out.detach()), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
        assert torch.isfinite(x[:, -1]).all(), name
        assert x[:, 0].abs().amax() > 0, name
        torch.testing.assert_close(x[:, -1], x[:, 0], rtol=0, atol=0, msg=lambda m, name=name: f"{name}: {m}")
