"""flexsparse.attention inside an autocast region computes as outside it (precision follows the inputs)."""
import pytest
import torch

import flexsparse
from helpers import qkv


@pytest.mark.parametrize("config", [{"method": "llsa", "block_size": 16, "topk": 4},
                                    {"method": "topk", "block_size": 32, "topk": 4},
                                    {"method": "vsa", "block_size": 32, "topk": 4}], ids=lambda c: c["method"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_autocast_does_not_change_the_result(config, dtype):
    q, k, v = qkv(batch=1, heads=2, n=1024, d=32, dtype=dtype)
    expected = flexsparse.attention(q, k, v, config, backend="torch")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = flexsparse.attention(q, k, v, config, backend="torch")
    assert got.dtype == dtype
    assert torch.equal(got, expected)
