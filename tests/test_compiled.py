"""``backends.compiled.StaticThenDynamic``: routing, separate dynamo caches of the twins, traced calls."""
from __future__ import annotations

import pytest
import torch

from flexsparse.backends.compiled import StaticThenDynamic, grad_flags


def _f(x):
    return torch.sin(x) * 2.0


def test_static_then_dynamic_twins_keep_separate_caches():
    """Two static lengths, then three on the dynamic twin and one seen before: at a recompile limit of 2 per
    code object this fails loudly unless each twin counts its own compiles."""
    torch._dynamo.reset()
    compiled = StaticThenDynamic(_f, name="f", budget=2, recompile_limit=2, fail_on_limit=True)
    with torch._dynamo.config.patch(recompile_limit=1):
        for n in (3, 4, 5, 6, 7, 3):
            x = torch.randn(n)
            torch.testing.assert_close(compiled(("n", n), x), _f(x))
    assert compiled.seen == {("n", 3), ("n", 4)}


def test_traced_calls_are_not_routed():
    """Inside a user's compiled region the plain function is traced: no variant is recorded (a guard on the
    mutated set would recompile the user's graph)."""
    torch._dynamo.reset()
    compiled = StaticThenDynamic(_f, name="f", budget=1)
    outer = torch.compile(lambda x: compiled(("n", x.shape[0]), x) + 1.0, fullgraph=True, backend="eager")
    x = torch.randn(5)
    torch.testing.assert_close(outer(x), _f(x) + 1.0)
    assert compiled.seen == set()


def test_hitting_the_recompile_limit_is_a_clear_error():
    """Static-only calls (key None, as flex on CPU) past the raised limit: a RuntimeError naming the knob, not
    an uncompiled run."""
    torch._dynamo.reset()
    compiled = StaticThenDynamic(_f, name="my.COMPILED", recompile_limit=2, fail_on_limit=True)
    with torch._dynamo.config.patch(recompile_limit=1):
        for n in (3, 4):
            compiled(None, torch.randn(n))
        with pytest.raises(RuntimeError, match=r"my\.COMPILED\.recompile_limit"):
            compiled(None, torch.randn(5))


def test_grad_flags_follow_grad_mode():
    a, b = torch.randn(2, requires_grad=True), torch.randn(2)
    assert grad_flags(a, b) == (True, False)
    with torch.no_grad():
        assert grad_flags(a, b) == (False, False)
