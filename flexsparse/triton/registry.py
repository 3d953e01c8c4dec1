"""Custom ops of the Triton kernels, with a direct eager path.

``triton_op(name)`` registers a function like ``torch.library.triton_op`` (``wrap_triton`` launches, so
``torch.compile(fullgraph=True)`` traces the kernels; the body is its own fake implementation) and returns an
``Op``. Calling an ``Op`` on plain eager tensors runs the body directly, with plain kernel launches; when an
input needs a gradient, through a plain ``torch.autograd.Function`` made of the op's registered
``setup_context`` and ``backward``. Through the dispatcher (custom-op and autograd wrappers, aliasing checks,
dynamo's disable guard) each call cost ~30-50 us of host time without gradients (2-core CPU VM) and 0.2-0.4 ms
with them (H200 host, cProfile), more than the GPU work of an eager call at small N. Everything else
(``torch.compile``, fake or functional tensors) goes through the op.
"""
from __future__ import annotations

import functools
import inspect
import threading
from typing import Callable

import torch

_STATE = threading.local()


def launching_directly() -> bool:
    """Whether kernels launch without ``wrap_triton`` (inside the body of an ``Op`` run directly)."""
    return getattr(_STATE, "direct", False)


def _plain_tensors(values) -> bool:
    """No tracing, and every tensor a plain ``torch.Tensor``."""
    if torch.compiler.is_compiling():
        return False
    return all(type(x) is torch.Tensor for x in values if isinstance(x, torch.Tensor))


def _records_grad(values) -> bool:
    """Whether autograd would record a call on ``values``: grad mode on and some tensor requires grad."""
    return torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in values)


class Op:
    """A ``torch.library.triton_op`` (``.op``, e.g. for ``torch.library.opcheck``) whose plain eager calls run
    its body directly (module docstring)."""

    def __init__(self, name: str, body: Callable, mutates_args: tuple[str, ...]):
        self.op = torch.library.triton_op(name, body, mutates_args=mutates_args)
        self.body = body
        self.signature = inspect.signature(body)
        self.direct_autograd: type[torch.autograd.Function] | None = None
        functools.update_wrapper(self, body)

    def __call__(self, *args, **kwargs):
        values = [*args, *kwargs.values()]
        if not _plain_tensors(values):
            return self.op(*args, **kwargs)
        if _records_grad(values):
            if self.direct_autograd is None:
                return self.op(*args, **kwargs)
            bound = self.signature.bind(*args, **kwargs)    # all inputs positional, as setup_context sees them
            bound.apply_defaults()
            return self.direct_autograd.apply(*bound.args)
        return self.run_body(*args, **kwargs)

    def run_body(self, *args, **kwargs):
        """The body with plain kernel launches."""
        previous = launching_directly()
        _STATE.direct = True
        try:
            return self.body(*args, **kwargs)
        finally:
            _STATE.direct = previous

    def register_autograd(self, backward: Callable, *, setup_context: Callable) -> None:
        """``backward`` and ``setup_context`` for the op (``torch.library``'s contract) and for its direct eager
        calls, as one ``torch.autograd.Function``."""
        self.op.register_autograd(backward, setup_context=setup_context)
        run_body = self.run_body

        def forward(*args):
            return run_body(*args)

        def setup(ctx, inputs, output):
            setup_context(ctx=ctx, inputs=inputs, output=output)

        def backward_fn(ctx, *grads):
            return backward(ctx, *grads)

        methods = {"forward": staticmethod(forward), "setup_context": staticmethod(setup),
                   "backward": staticmethod(backward_fn)}
        self.direct_autograd = type(f"Direct_{self.body.__name__}", (torch.autograd.Function,), methods)


def triton_op(name: str, mutates_args: tuple[str, ...] = ()) -> Callable[[Callable], Op]:
    """Decorator: the function registered as the custom op ``name`` (``namespace::op``), wrapped in an ``Op``."""
    return lambda body: Op(name, body, mutates_args)
