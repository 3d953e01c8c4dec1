"""Custom ops of the Triton kernels, with a direct eager path.

``triton_op(name)`` registers a function like ``torch.library.triton_op`` (``wrap_triton`` launches, so
``torch.compile(fullgraph=True)`` traces the kernels; the body is its own fake implementation) and returns an
``Op``. Calling an ``Op`` eagerly on plain tensors (``torch.Tensor`` or ``nn.Parameter``) runs the body directly,
with plain kernel launches: with no autograd graph to record, the body itself; with one, a
``torch.autograd.Function`` built from the op's registered backward and ``setup_context`` (the same autograd
formula). Through the dispatcher (custom-op and autograd wrappers, dynamo's disable guard) a call cost ~30 us
more host time without gradients and ~60-100 us more with its backward (2-core CPU VM, a trivial op); an eager
LLSA forward is a few such calls, and at small N the host time exceeds the GPU work. Everything else
(``torch.compile``, fake, functional or other subclassed tensors, functorch transforms) goes through the op.
"""
from __future__ import annotations

import functools
import inspect
import threading
from typing import Callable

import torch

from .compile_cache import tag_compile_caches

_STATE = threading.local()
tag_compile_caches()  # the ops' traced bodies are not in torch.compile's cache keys (compile_cache)


def launching_directly() -> bool:
    """Whether kernels launch without ``wrap_triton`` (inside the body of an ``Op`` run directly)."""
    return getattr(_STATE, "direct", False)


def register_cap(cap: int | None) -> dict:
    """``{"maxnreg": cap}`` for a launch where ``cap`` is set and the kernel launches directly, else ``{}``:
    ``wrap_triton`` takes no ``maxnreg``, so traced launches run uncapped (same results)."""
    return {"maxnreg": cap} if cap and launching_directly() else {}


PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def _eager_plain(tensors: list[torch.Tensor]) -> bool:
    """No tracing, no functorch transform, and only plain tensors (no subclass such as fake or functional ones)."""
    if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        return False
    return all(type(x) in PLAIN_TENSORS for x in tensors)


class Op:
    """A ``torch.library.triton_op`` (``.op``, e.g. for ``torch.library.opcheck``) whose plain eager calls run
    its body directly, through an ``autograd.Function`` of the registered formula when gradients are recorded
    (module docstring)."""

    def __init__(self, name: str, body: Callable, mutates_args: tuple[str, ...]):
        self.op = torch.library.triton_op(name, body, mutates_args=mutates_args)
        self.name, self.body = name, body
        self._signature = inspect.signature(body)
        self._function = None
        functools.update_wrapper(self, body)

    def __call__(self, *args, **kwargs):
        tensors = [x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor)]
        if not _eager_plain(tensors):
            return self.op(*args, **kwargs)
        if torch.is_grad_enabled() and any(x.requires_grad for x in tensors):
            if self._function is None:
                return self.op(*args, **kwargs)
            if kwargs or len(args) != len(self._signature.parameters):
                bound = self._signature.bind(*args, **kwargs)
                bound.apply_defaults()
                args = bound.args
            return self._function.apply(*args)
        return self.direct(*args, **kwargs)

    def direct(self, *args, **kwargs):
        """The body with plain kernel launches (``launching_directly``)."""
        return directly(self.body, *args, **kwargs)

    def register_autograd(self, backward: Callable, *, setup_context: Callable) -> None:
        """The op's autograd formula (``torch.library``'s), also run by the direct path's ``autograd.Function``."""
        self.op.register_autograd(backward, setup_context=setup_context)
        self._function = _autograd_function(self, backward, setup_context)


def directly(function: Callable, *args, **kwargs):
    """``function(*args, **kwargs)`` with plain kernel launches (``launching_directly``)."""
    previous = launching_directly()
    _STATE.direct = True
    try:
        return function(*args, **kwargs)
    finally:
        _STATE.direct = previous


def _autograd_function(op: Op, backward: Callable, setup_context: Callable) -> type:
    """An ``autograd.Function`` whose forward is ``op.direct`` followed by the op's registered ``setup_context``
    (all arguments positional, defaults filled in, as the op's ``setup_context`` sees them) and whose backward is
    the op's, with plain kernel launches where the gradients are plain tensors outside tracing (a formula that
    launches a kernel itself, not through another ``Op``, would take Triton's own launch path: 60 us of host time
    per launch on an H200 host against 43). The forward takes ``ctx`` itself: a separate ``setup_context``
    staticmethod makes every ``apply`` bind its arguments through ``inspect.signature`` (~80 us of host time per
    call on a 2-core VM)."""

    def forward(ctx, *args):
        output = op.direct(*args)
        setup_context(ctx, args, output)
        return output

    def differentiate(ctx, *grads):
        if _eager_plain([grad for grad in grads if grad is not None]):
            return directly(backward, ctx, *grads)
        return backward(ctx, *grads)

    members = {"forward": staticmethod(forward), "backward": staticmethod(differentiate)}
    return type(op.name.split("::")[-1], (torch.autograd.Function,), members)   # its nodes: "<op name>Backward"


def triton_op(name: str, mutates_args: tuple[str, ...] = ()) -> Callable[[Callable], Op]:
    """Decorator: the function registered as the custom op ``name`` (``namespace::op``), wrapped in an ``Op``."""
    return lambda body: Op(name, body, mutates_args)


def launcher(kernel):
    """``kernel`` made traceable by ``torch.compile`` (``wrap_triton``); launched through ``fast_launch`` from an
    op body run eagerly (``registry``) and always for a Gluon kernel (``wrap_triton`` does not take them: their ops
    are opaque); as it is when interpreted. A pointer a launch leaves unused is one of its inputs, never an alias of
    a tensor it writes: were torch's write analysis to fail, it would take every pointer as written, and the copies
    of two aliased "outputs" would overwrite each other."""
    if launching_directly():     # the common case first: an eager launch of a kernel launched before
        fast = getattr(kernel, "__dict__", {}).get("_flexsparse_fast")
        if fast is not None:
            return fast
    from triton.runtime.jit import JITFunction
    if not isinstance(kernel, JITFunction):
        return kernel
    if not kernel.is_gluon() and not launching_directly():
        return torch.library.wrap_triton(kernel)
    fast = kernel.__dict__.get("_flexsparse_fast")
    if fast is None:
        from .fast_launch import FastLaunch
        fast = kernel._flexsparse_fast = FastLaunch(kernel)
    return fast
