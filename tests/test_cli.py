"""The benchmark/demo behind ``python -m flexsparse`` (``flexsparse.bench``), on CPU at a tiny size."""
from __future__ import annotations

import torch

from flexsparse import bench


def test_run_times_forward_and_backward_and_checks_against_the_reference():
    rows = bench.run(["topk", "llsa"], [1024], torch.device("cpu"), torch.float32, batch=1, heads=2, dim=16,
                     backward=True, check=True, wanted_backends=["torch"])
    assert [(r.method, r.backend, r.n) for r in rows] == [("topk", "torch", 1024), ("llsa", "torch", 1024)]
    for row in rows:
        assert row.forward_ms > 0 and row.forward_backward_ms > 0 and row.sdpa_forward_backward_ms > 0
        assert row.max_error < 1e-5


def test_backward_timing_takes_no_gradient_of_the_inputs_into_grad():
    """Forward+backward is timed as ``autograd.grad`` with an upstream gradient: nothing accumulates into
    ``q.grad`` (in training q, k, v are activations; accumulating into leaves timed extra passes)."""
    q, k, v = bench.random_qkv(1, 2, 64, 8, torch.float32, "cpu", True)
    grads = bench._grads(torch.nn.functional.scaled_dot_product_attention, q, k, v, torch.randn_like(q))
    assert len(grads) == 3 and all(g.shape == q.shape for g in grads)
    assert q.grad is None and k.grad is None and v.grad is None


def test_a_config_that_does_not_fit_a_size_is_skipped_not_fatal():
    rows = bench.run(["topk", "llsa"], [256], torch.device("cpu"), torch.float32, batch=1, heads=2, dim=16,
                     backward=False, check=False, wanted_backends=["torch"])
    assert [(r.method, r.n) for r in rows] == [("llsa", 256)]     # topk's K=8 needs 8 blocks of 64
