"""``flexsparse.triton.registry``: plain eager calls run the op body directly (no dispatcher, plain launches);
calls that need autograd or are traced go through the registered op."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from flexsparse.triton import registry  # noqa: E402

CALLS = []


@registry.triton_op("flexsparse_test::scaled")
def scaled(x: torch.Tensor, factor: float) -> torch.Tensor:
    """``x * factor``, recording whether kernels would launch directly."""
    CALLS.append(registry.launching_directly())
    return x * factor


def _backward(ctx, grad):
    return grad * ctx.factor, None


def _setup(ctx, inputs, output):
    ctx.factor = inputs[1]


scaled.register_autograd(_backward, setup_context=_setup)


def _run(x, factor=3.0):
    CALLS.clear()
    out = scaled(x, factor)
    return out, list(CALLS)


def test_plain_eager_call_runs_the_body_directly():
    x = torch.randn(5)
    out, calls = _run(x)
    torch.testing.assert_close(out, x * 3.0)
    assert calls == [True] and not registry.launching_directly()


def test_inputs_needing_gradients_go_through_the_op():
    x = torch.randn(5, requires_grad=True)
    out, calls = _run(x)
    assert calls == [False]
    out.sum().backward()
    torch.testing.assert_close(x.grad, torch.full_like(x, 3.0))
    with torch.no_grad():
        assert _run(x)[1] == [True]


def test_traced_calls_go_through_the_op():
    compiled = torch.compile(lambda x: scaled(x, 2.0), fullgraph=True, backend="eager")
    CALLS.clear()
    x = torch.randn(4)
    torch.testing.assert_close(compiled(x), x * 2.0)
    assert True not in CALLS
    torch.library.opcheck(scaled.op, (x, 2.0))


def test_direct_flag_is_restored_after_an_error():
    with pytest.raises(TypeError):
        scaled(torch.randn(2), "not a number")
    assert not registry.launching_directly()
