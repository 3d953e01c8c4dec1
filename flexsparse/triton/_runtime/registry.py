"""Custom ops of the Triton kernels, with a direct eager path.

``triton_op(name)`` registers a function like ``torch.library.triton_op`` (``wrap_triton`` launches, so
``torch.compile(fullgraph=True)`` traces the kernels; the body is its own fake implementation) and returns an
``Op``. Calling an ``Op`` on plain eager tensors with no autograd graph to record runs the body directly, with
plain kernel launches: through the dispatcher (custom-op and autograd wrappers, dynamo's disable guard) each
call cost ~30-50 us of host time (2-core CPU VM), about half the host time of an eager LLSA forward, which at
small N is slower than the GPU work. Everything else (``torch.compile``, fake or functional tensors, inputs that
need gradients) goes through the op.
"""
from __future__ import annotations

import functools
import threading
from typing import Callable

import torch

from .compile_cache import tag_compile_caches

_STATE = threading.local()
tag_compile_caches()  # the ops' traced bodies are not in torch.compile's cache keys (compile_cache)


def launching_directly() -> bool:
    """Whether kernels launch without ``wrap_triton`` (inside the body of an ``Op`` run directly)."""
    return getattr(_STATE, "direct", False)


def _plain_eager(values) -> bool:
    """No tracing, plain ``torch.Tensor`` inputs, and no input that needs a gradient recorded."""
    if torch.compiler.is_compiling():
        return False
    tensors = [x for x in values if isinstance(x, torch.Tensor)]
    if any(type(x) is not torch.Tensor for x in tensors):
        return False
    return not (torch.is_grad_enabled() and any(x.requires_grad for x in tensors))


class Op:
    """A ``torch.library.triton_op`` (``.op``, e.g. for ``torch.library.opcheck``) whose plain eager calls run
    its body directly (module docstring)."""

    def __init__(self, name: str, body: Callable, mutates_args: tuple[str, ...]):
        self.op = torch.library.triton_op(name, body, mutates_args=mutates_args)
        self.body = body
        functools.update_wrapper(self, body)

    def __call__(self, *args, **kwargs):
        if not _plain_eager([*args, *kwargs.values()]):
            return self.op(*args, **kwargs)
        previous = launching_directly()
        _STATE.direct = True
        try:
            return self.body(*args, **kwargs)
        finally:
            _STATE.direct = previous

    def register_autograd(self, backward: Callable, *, setup_context: Callable) -> None:
        self.op.register_autograd(backward, setup_context=setup_context)


def triton_op(name: str, mutates_args: tuple[str, ...] = ()) -> Callable[[Callable], Op]:
    """Decorator: the function registered as the custom op ``name`` (``namespace::op``), wrapped in an ``Op``."""
    return lambda body: Op(name, body, mutates_args)


def launcher(kernel):
    """``kernel`` made traceable by ``torch.compile`` (``wrap_triton``); as it is when interpreted or launched
    directly from an op body run eagerly (``registry``). A pointer a launch leaves unused is one of its inputs,
    never an alias of a tensor it writes: were torch's write analysis to fail, it would take every pointer as
    written, and the copies of two aliased "outputs" would overwrite each other."""
    from triton.runtime.jit import JITFunction
    if isinstance(kernel, JITFunction) and not launching_directly():
        return torch.library.wrap_triton(kernel)
    return kernel
