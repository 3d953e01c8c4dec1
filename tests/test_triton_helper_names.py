"""Every ``@triton.jit`` helper a kernel calls is bound under its own function name.

Under ``torch.compile`` inductor emits a user kernel's source with each helper it calls, spliced from the helper's
own ``def`` (``symbol.src``), and the kernel calls it by the name it has in the kernel's globals. A helper bound
under another name (``helper = triton.jit(_helper)``, ``from .x import helper as other``) then fails to compile
with a ``NameError``, but only where the call is not under a false constexpr branch, so only some configurations
find it on a GPU. This checks every kernel and helper of ``flexsparse.triton`` on CPU, the way inductor walks them
(``torch/_inductor/codegen/wrapper.py``, ``user_defined_kernel_grid_fn_code``'s ``traverse``).
"""
from __future__ import annotations

import importlib
import pkgutil

from triton.runtime.jit import JITFunction

import flexsparse.triton as package


def jit_functions() -> dict[str, JITFunction]:
    """Every Triton/Gluon jit function defined or imported in a ``flexsparse.triton`` module, by qualified name."""
    found = {}
    for info in pkgutil.walk_packages(package.__path__, "flexsparse.triton."):
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if isinstance(obj, JITFunction):
                found[f"{info.name}.{name}"] = obj
    return found


def misnamed_calls(kernel: JITFunction) -> list[str]:
    """``caller -> name (def helper)`` for each jit function reachable from ``kernel`` whose global name differs
    from its ``def``'s."""
    bad, seen, stack = [], set(), [kernel]
    while stack:
        current = stack.pop()
        for name in current.fn.__code__.co_names:
            symbol = current.fn.__globals__.get(name)
            if not isinstance(symbol, JITFunction):
                continue
            if symbol.fn.__name__ != name:                    # every call site, also of a helper already walked
                bad.append(f"{current.fn.__name__} -> {name} (def {symbol.fn.__name__})")
            if id(symbol) not in seen:
                seen.add(id(symbol))
                stack.append(symbol)
    return bad


def test_kernels_call_helpers_by_their_own_names():
    functions = jit_functions()
    assert len(functions) > 50                               # the walk found the kernels
    bad = sorted({call for kernel in functions.values() for call in misnamed_calls(kernel)})
    assert not bad, bad


def test_the_walk_finds_an_alias(tmp_path, monkeypatch):
    """A helper bound under another name is reported (the check above cannot pass vacuously)."""
    (tmp_path / "aliased_helper.py").write_text(
        "import triton\nimport triton.language as tl\n\n\ndef _helper(x):\n    return x + 1\n\n\n"
        "helper = triton.jit(_helper)\n\n\n@triton.jit\ndef kernel(X):\n    tl.store(X, helper(tl.load(X)))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("aliased_helper")
    assert misnamed_calls(module.kernel) == ["kernel -> helper (def _helper)"]
