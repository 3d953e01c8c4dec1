"""Small eager calls through CUDA graphs (``flexsparse.eager_graphs``): every method on ``backend="triton"`` gives the
outputs, LSE and gradients (q, k, v and the parameters) of the eager path with the graphs off, on fresh inputs at
every call, with forwards of several calls run before their backwards (the layers of a model), ``no_grad``
evaluation between training steps, and the version check of saved tensors. The graphs run on CUDA only; on CPU
the calls stay eager."""
from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint

from flexsparse import eager_graphs
from flexsparse.bench.measure import build_module
from flexsparse.methods import METHODS
from triton_support import fp8_methods, gpu, triton_methods

HEADS, DIM = 4, 64


@pytest.fixture
def graphs(monkeypatch):
    """A fresh graph cache; ``graphs(on)`` turns the graphs on or off."""
    eager_graphs.clear()
    yield lambda on: monkeypatch.setenv("FLEXSPARSE_EAGER_GRAPHS", "1" if on else "0")
    eager_graphs.clear()


def _inputs(n: int, batch: int = 2, dtype=torch.bfloat16):
    return [torch.randn(batch, HEADS, n, DIM, device="cuda", dtype=dtype) for _ in range(4)]


def _step(module, q, k, v, grad, return_lse=False):
    """Output (and LSE) and the gradients of q, k, v and the trainable parameters of one call."""
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    params = [p for p in module.parameters() if p.requires_grad]
    result = module(*leaves, return_lse=return_lse)
    outputs = result if return_lse else (result,)
    loss = (outputs[0].float() * grad.float()).sum() + (outputs[1].sum() if return_lse else 0)
    return [x.detach() for x in outputs], torch.autograd.grad(loss, leaves + params)


def _assert_same(got, want):
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.float(), b.float(), atol=1e-2, rtol=1e-2)


def _captured() -> list:
    return [entry for entry in eager_graphs._CALLS.values() if isinstance(entry, eager_graphs.CapturedCall)]


@gpu
@pytest.mark.parametrize("n", [4096, 1000])
@pytest.mark.parametrize("method", triton_methods())
def test_gpu_graphed_calls_equal_eager(method, n, graphs):
    """Training calls and ``no_grad`` evaluation alternate; every call on fresh inputs."""
    module = build_module(METHODS[method].example, "triton", DIM, HEADS, n, "cuda")
    for call in range(6):     # per key: eager, capture, replay
        q, k, v, grad = _inputs(n)
        graphs(False)
        want = _step(module, q, k, v, grad, return_lse=call % 2 == 1)
        with torch.no_grad():
            want_eval = module(q, k, v)
        graphs(True)
        got = _step(module, q, k, v, grad, return_lse=call % 2 == 1)
        with torch.no_grad():
            got_eval = module(q, k, v)
        _assert_same(got[0] + list(got[1]), want[0] + list(want[1]))
        _assert_same([got_eval], [want_eval])
    assert len(_captured()) == 3      # evaluation, training with and without the LSE


@gpu
@pytest.mark.parametrize("method", fp8_methods())
def test_gpu_graphed_fp8_calls_equal_eager(method, graphs):
    """The FP8 sparse branch (``quant``): training calls and ``no_grad`` evaluation on fresh inputs."""
    pytest.importorskip("torchao")
    n = 4096
    module = build_module({**METHODS[method].example, "quant": {}}, "triton", DIM, HEADS, n, "cuda")
    for _ in range(3):
        q, k, v, grad = _inputs(n)
        graphs(False)
        want = _step(module, q, k, v, grad)
        with torch.no_grad():
            want_eval = module(q, k, v)
        graphs(True)
        got = _step(module, q, k, v, grad)
        with torch.no_grad():
            got_eval = module(q, k, v)
        _assert_same(got[0] + list(got[1]) + [got_eval], want[0] + list(want[1]) + [want_eval])
    assert len(_captured()) == 2


@gpu
@pytest.mark.parametrize("method", triton_methods())
def test_gpu_graphed_gqa_equals_eager(method, graphs):
    """k and v with half of q's heads, fp16."""
    n = 2048
    module = build_module(METHODS[method].example, "triton", DIM, HEADS, n, "cuda").half()
    for _ in range(3):
        q, grad = (torch.randn(1, HEADS, n, DIM, device="cuda", dtype=torch.float16) for _ in range(2))
        k, v = (torch.randn(1, HEADS // 2, n, DIM, device="cuda", dtype=torch.float16) for _ in range(2))
        graphs(False)
        want = _step(module, q, k, v, grad)
        graphs(True)
        got = _step(module, q, k, v, grad)
        _assert_same(got[0] + list(got[1]), want[0] + list(want[1]))
    assert len(_captured()) == 1


@gpu
@pytest.mark.parametrize("method", triton_methods())
def test_gpu_graphed_forwards_before_backwards(method, graphs):
    """Three layers of one shape: every forward runs before the first backward, as in a model."""
    n = 2048
    module = build_module(METHODS[method].example, "triton", DIM, HEADS, n, "cuda")
    params = [p for p in module.parameters() if p.requires_grad]
    steps = [[x.requires_grad_(i < 3) for i, x in enumerate(_inputs(n))] for _ in range(3)]

    def run():
        outs = [module(q, k, v) for q, k, v, _ in steps]
        loss = sum((out.float() * grad.float()).sum() for out, (*_, grad) in zip(outs, steps))
        leaves = [x for q, k, v, _ in steps for x in (q, k, v)]
        return [out.detach() for out in outs] + list(torch.autograd.grad(loss, leaves + params))

    graphs(False)
    want = run()
    graphs(True)
    for _ in range(3):     # the first call of the key runs eagerly, the second captures
        got = run()
    _assert_same(got, want)
    assert len(_captured()) == 1


@gpu
@pytest.mark.parametrize("method", triton_methods())
def test_gpu_graph_replays_never_synchronize(method, graphs):
    """After a key's eager call and its capture (which synchronizes once), its replays make no synchronizing call
    (``test_gpu_no_sync`` checks the eager kernels)."""
    n = 4096
    module = build_module(METHODS[method].example, "triton", DIM, HEADS, n, "cuda")
    q, k, v, grad = _inputs(n)
    q.requires_grad_()

    def calls():
        module(q, k, v).backward(grad)
        with torch.no_grad():
            module(q, k, v)

    calls()
    calls()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        calls()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert len(_captured()) == 2


@gpu
@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("method", ["topk", "sla2"])
def test_gpu_graphs_under_activation_checkpointing(method, reentrant, graphs):
    """Non-reentrant checkpointing (saved-tensor hooks) keeps the calls eager; reentrant checkpointing runs its
    forward without gradients and recomputes with them, both through graphs."""
    n = 2048
    module = build_module(METHODS[method].example, "triton", DIM, HEADS, n, "cuda")
    q, k, v, grad = _inputs(n)
    q.requires_grad_()
    params = [p for p in module.parameters() if p.requires_grad]

    def step():     # .backward(): reentrant checkpointing does not take autograd.grad
        for x in (q, *params):
            x.grad = None
        out = torch.utils.checkpoint.checkpoint(module, q, k, v, use_reentrant=reentrant)
        (out.float() * grad.float()).sum().backward()
        return [out.detach(), *(x.grad for x in (q, *params))]

    graphs(False)
    want = step()
    graphs(True)
    for _ in range(3):
        got = step()
    _assert_same(got, want)
    assert len(_captured()) == (2 if reentrant else 0)


@gpu
def test_gpu_graphed_call_checks_saved_versions(graphs):
    module = build_module(METHODS["topk"].example, "triton", DIM, HEADS, 1024, "cuda")
    q, k, v, grad = _inputs(1024)
    q.requires_grad_()
    for _ in range(2):
        module(q, k, v).backward(grad)
    assert len(_captured()) == 1
    out = module(q, k, v)
    with torch.no_grad():
        q.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward(grad)


@gpu
def test_gpu_large_calls_stay_eager(graphs):
    n = eager_graphs.MAX_QUERY_ROWS // HEADS + 64
    module = build_module(METHODS["topk"].example, "triton", DIM, HEADS, n, "cuda")
    q, k, v, _ = _inputs(n, batch=1)
    with torch.no_grad():
        for _ in range(3):
            module(q, k, v)
    assert not eager_graphs._CALLS


def test_cpu_calls_stay_eager(graphs):
    import flexsparse
    q, k, v = (torch.randn(1, 2, 128, 32) for _ in range(3))
    for _ in range(3):
        flexsparse.attention(q, k, v, {"method": "topk", "block_size": 32, "topk": 2}, backend="torch")
    assert not eager_graphs.applies(q, [q, k, v])
    assert not eager_graphs._CALLS


class _StandIn:
    """A ``CapturedCall`` stand-in: records its captures, replays by calling the steps (CPU)."""

    captures: list = []

    def __init__(self, steps, inputs):
        if getattr(steps, "fails", False):
            raise RuntimeError("operation not permitted when stream is capturing")
        self.steps = steps
        _StandIn.captures.append(steps)

    def __call__(self, inputs):
        return ("replayed", *self.steps(*inputs))


def test_cpu_first_call_eager_second_captures_then_replays(graphs, monkeypatch):
    monkeypatch.setattr(eager_graphs, "CapturedCall", _StandIn)
    _StandIn.captures = []
    steps = lambda x: (x + 1, None)    # noqa: E731
    x = torch.zeros(2)
    assert eager_graphs.run(("a",), steps, [x])[1] is None          # eager: a plain result
    assert eager_graphs.run(("a",), steps, [x])[0] == "replayed"    # captured, then replayed
    assert eager_graphs.run(("a",), steps, [x])[0] == "replayed"
    assert _StandIn.captures == [steps]

    def failing(x):
        return (x, None)
    failing.fails = True
    eager_graphs.run(("b",), failing, [x])
    with pytest.warns(RuntimeWarning, match="capture failed"):
        assert eager_graphs.run(("b",), failing, [x])[1] is None
    assert eager_graphs.run(("b",), failing, [x])[1] is None        # eager from then on, no second capture try
    assert len(_StandIn.captures) == 1


def test_cpu_cache_keeps_the_most_recent_keys(graphs, monkeypatch):
    monkeypatch.setattr(eager_graphs, "CapturedCall", _StandIn)
    x = torch.zeros(1)
    for key in range(eager_graphs.CACHE_SIZE + 3):
        eager_graphs.run((key,), lambda x: (x, None), [x])
    eager_graphs.run((3,), lambda x: (x, None), [x])
    assert list(eager_graphs._CALLS) == [(key,) for key in [*range(4, eager_graphs.CACHE_SIZE + 3), 3]]
