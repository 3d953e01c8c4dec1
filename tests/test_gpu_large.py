"""GPU: the Triton kernels at a million tokens with more than 2^31 elements per tensor.

One call on ``(1, 34, 2^20, 64)`` bf16 tensors (2.3e9 elements: the offsets of the last two heads do not fit
in int32) whose last head is a copy of the first: selection and attention run per head, so the last head
must come out exactly like the first (output and gradients; ``deterministic=True`` fixes the order of the
key-major sums). A 32-bit offset shows as a mismatch or a crash, not as noise. Needs 45-70 GiB of free GPU
memory (skipped otherwise); run this file on its own, not under ``pytest -n``.
"""
from __future__ import annotations

import pytest
import torch

import flexsparse
from triton_support import HAS_CUDA, gpu

SHAPE = (1, 34, 1 << 20, 64)
CASES = [  # (config, GiB of GPU memory the call needs)
    ({"method": "llsa", "block_size": 16, "topk": 8, "deterministic": True}, 45),
    ({"method": "topk", "block_size": 64, "topk": 8, "deterministic": True}, 45),
    ({"method": "sla", "block_size": 64, "topk_ratio": 8 / 16384, "deterministic": True}, 70),
]


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
    params = None
    if cfg["method"] == "sla":  # a random projection, so that the linear branch reaches output and gradients
        d = SHAPE[-1]
        params = {"proj_weight": torch.randn(d, d, device="cuda", generator=gen) / d**0.5,
                  "proj_bias": torch.randn(d, device="cuda", generator=gen)}
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = flexsparse.attention(q, k, v, cfg, backend="triton", params=params)
    out.backward(grad)
    for name, x in (("out", out.detach()), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
        assert torch.isfinite(x[:, -1]).all(), name
        assert x[:, 0].abs().amax() > 0, name
        torch.testing.assert_close(x[:, -1], x[:, 0], rtol=0, atol=0, msg=lambda m, name=name: f"{name}: {m}")
