"""flexsparse.attention inside an autocast region computes as outside it (precision follows the inputs)."""
import pytest
import torch

import flexsparse
from helpers import qkv

N = 1024
CONFIGS = [{"method": "llsa", "block_size": 16, "topk": 4},
           {"method": "topk", "block_size": 32, "topk": 4},
           {"method": "vsa", "block_size": 32, "topk": 4},
           *(method.example for method in flexsparse.METHODS.values())]   # every registered method's example


def _params(config):
    """The method's learnable parameters moved off their initial values (so that each part counts), or None."""
    cfg = flexsparse.Config.from_dict(config)
    init = flexsparse.METHODS[cfg.method].init_params(cfg, 32, 2, N)
    gen = torch.Generator().manual_seed(0)
    return {name: p + 0.1 * torch.randn(p.shape, generator=gen) for name, p in init.items()} or None


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c["method"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_autocast_does_not_change_the_result(config, dtype):
    q, k, v = qkv(batch=1, heads=2, n=N, d=32, dtype=dtype)
    params = _params(config)
    expected = flexsparse.attention(q, k, v, config, backend="torch", params=params)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = flexsparse.attention(q, k, v, config, backend="torch", params=params)
    assert got.dtype == dtype
    assert torch.equal(got, expected)
