"""GPU: every method on ``backend="triton"`` under CUDA graphs, in a training loop that switches between training
steps and ``no_grad`` evaluation: ``torch.compile(mode="reduce-overhead")`` and ``torch.cuda.make_graphed_callables``,
outputs and gradients (of q, k, v and the parameters) equal to eager on the same inputs.

The loop resets the parameters' gradients each step (as ``optimizer.zero_grad()`` does): under ``reduce-overhead``
a gradient accumulated from the previous step's graph output is overwritten by the next replay (the same for any
``nn.Module`` with parameters, e.g. ``nn.Linear``)."""
from __future__ import annotations

import pytest
import torch

from flexsparse.bench.measure import build_module
from flexsparse.methods import METHODS
from triton_support import gpu, triton_methods

HEADS, DIM, N = 4, 64, 4096


def _eager(module, q, k, v, grad):
    """Eager output and gradients of q, k, v and the trainable parameters."""
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    params = [p for p in module.parameters() if p.requires_grad]
    out = module(*leaves)
    return out.detach(), torch.autograd.grad(out, leaves + params, grad)


def _loop(step_fn, module, q, k, v, grad, steps=3):
    """``steps`` training steps (gradients reset, forward, backward) each followed by a ``no_grad`` evaluation;
    the last step's output, gradients and evaluation output (cloned out of the graphs' memory)."""
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    params = [p for p in module.parameters() if p.requires_grad]
    for _ in range(steps):
        torch.compiler.cudagraph_mark_step_begin()
        for x in leaves + params:
            x.grad = None
        out = step_fn(*leaves)
        out.backward(grad)
        trained = out.detach().clone(), [x.grad.clone() for x in leaves + params]
        torch.compiler.cudagraph_mark_step_begin()
        with torch.no_grad():
            evaluated = step_fn(*(x.detach() for x in leaves)).clone()
    return trained, evaluated


@gpu
@pytest.mark.parametrize("graphs", ["reduce-overhead", "make_graphed_callables"])
@pytest.mark.parametrize("method", triton_methods())
def test_gpu_cuda_graphs_train_and_evaluate_like_eager(method, graphs):
    torch._dynamo.reset()
    module = build_module(METHODS[method].example, "triton", DIM, HEADS, N, "cuda")   # parameters off init
    q, k, v, grad = (torch.randn(2, HEADS, N, DIM, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    want_out, want_grads = _eager(module, q, k, v, grad)
    if graphs == "reduce-overhead":
        step_fn = torch.compile(module, mode="reduce-overhead")
    else:
        sample = tuple(x.detach().clone().requires_grad_() for x in (q, k, v))
        step_fn = torch.cuda.make_graphed_callables(module, sample)
    (out, grads), evaluated = _loop(step_fn, module, q, k, v, grad)
    tol = dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out, want_out, **tol)
    torch.testing.assert_close(evaluated, want_out, **tol)
    assert len(grads) == len(want_grads)
    for got, want in zip(grads, want_grads):
        torch.testing.assert_close(got.float(), want.float(), **tol)
