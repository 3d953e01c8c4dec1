"""CUDA graphs for small eager calls: a call whose GPU work is smaller than the host time of issuing it replays
graphs of its forward and backward instead.

At N <= 16K an eager call of a sparse method costs its host time (Python, a few ATen ops, 3-18 kernel launches;
``docs/host_time.md``). A backend that sets ``Backend.graphs_small_calls`` has such calls run here: the first call
of a key (the method, its fitted config, the backend and its capture settings, shapes, dtypes, device, stream,
scale, LSE, grad mode and which inputs need gradients) runs eagerly, which compiles and tunes its kernels; the next
one captures a forward graph, and where gradients are recorded a backward graph, on static copies of the inputs;
every later call copies its inputs in, replays, and copies the outputs out.

One static set serves every call of a key, so a call keeps what its backward needs: the tensors the forward saves
for the backward (caught by ``saved_tensors_hooks`` during the capture) are copied out after each forward replay
into the call's own autograd node, and copied back before its backward replay. Many calls of one shape (the layers
of a DiT) may run their forwards before any backward. Saved tensors and inputs go through ``save_for_backward``,
so an in-place change to them fails the backward as it does eagerly. The backward is once differentiable.

Eligible: CUDA tensors of plain types on the current device outside ``torch.compile``, functorch transforms and
another capture, with B * H * Nq <= ``MAX_QUERY_ROWS`` (B2 H8 N16384): the copies cost GPU time, which larger calls,
bound by their GPU work, would pay without gain. ``FLEXSPARSE_EAGER_GRAPHS=0`` turns the graphs off. At most
``CACHE_SIZE`` keys keep their graphs (least recently used dropped); a key whose capture fails runs eagerly from
then on, with one warning. Calls under saved-tensor hooks (non-reentrant activation checkpointing, offloading) stay
eager: a recomputation must save the tensors its original forward saved, and a key's first call and later ones save
different ones.
"""
from __future__ import annotations

import collections
import contextlib
import os
import threading
import warnings
from typing import Callable, Sequence

import torch

MAX_QUERY_ROWS = 1 << 18
CACHE_SIZE = 8
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_EAGER = "eager"        # a key whose capture failed


def enabled() -> bool:
    """``FLEXSPARSE_EAGER_GRAPHS``: ``1`` (the default) or ``0``; any other value is an error naming it."""
    value = os.environ.get("FLEXSPARSE_EAGER_GRAPHS") or "1"
    if value not in ("0", "1"):
        raise ValueError(f"FLEXSPARSE_EAGER_GRAPHS must be 0 or 1, got {value!r}")
    return value == "1"


def applies(q: torch.Tensor, tensors: Sequence[torch.Tensor]) -> bool:
    """Whether a call on q ``(B, H, Nq, D)`` and ``tensors`` (every tensor input) runs through graphs here."""
    if not enabled() or q.device.type != "cuda" or q.shape[0] * q.shape[1] * q.shape[2] > MAX_QUERY_ROWS:
        return False
    if q.device.index != torch.cuda.current_device():
        return False
    if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        return False
    if torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
        return False
    return all(type(x) in _PLAIN for x in tensors) and not torch.cuda.is_current_stream_capturing()


def call_key(*parts) -> tuple:
    """A key of ``parts`` (hashable call settings) with the current grad mode, stream and deterministic flag."""
    return (*parts, torch.is_grad_enabled(), torch.cuda.current_stream().stream_id,
            torch.are_deterministic_algorithms_enabled())


def tensor_key(x: torch.Tensor) -> tuple:
    """What a capture depends on in a tensor input: shape, dtype, device and whether it records a gradient."""
    return tuple(x.shape), x.dtype, x.device, x.requires_grad


_CALLS: collections.OrderedDict = collections.OrderedDict()   # key: eager calls so far, CapturedCall or _EAGER (LRU)
_LOCK = threading.Lock()


def run(key: tuple, steps: Callable, inputs: Sequence[torch.Tensor]) -> tuple:
    """``steps(*inputs)`` (a tuple of tensors or ``None``) for the call ``key``: eagerly on the key's first call,
    from its graphs after that (module docstring)."""
    with _LOCK:
        entry = _CALLS.get(key, 0)
        if isinstance(entry, int):
            _CALLS[key] = entry + 1
        _CALLS.move_to_end(key)
        while len(_CALLS) > CACHE_SIZE:
            _CALLS.popitem(last=False)
    if entry == 0 or entry == _EAGER:
        return steps(*inputs)
    if isinstance(entry, int):
        try:
            entry = CapturedCall(steps, inputs)
        except RuntimeError as error:
            warnings.warn(f"flexsparse: this call shape runs eagerly, its CUDA graph capture failed: {error}",
                          RuntimeWarning, stacklevel=4)
            entry = _EAGER
        with _LOCK:
            _CALLS[key] = entry
        if entry == _EAGER:
            return steps(*inputs)
    return entry(inputs)


def clear() -> None:
    """Drop every captured graph (their memory is freed once no pending backward holds them)."""
    with _LOCK:
        _CALLS.clear()


class CapturedCall:
    """The graphs of one key: ``steps`` captured on static copies of ``inputs`` (module docstring)."""

    def __init__(self, steps: Callable, inputs: Sequence[torch.Tensor]):
        grad = torch.is_grad_enabled()
        self.inputs = [torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in inputs]
        with torch.no_grad():
            torch._foreach_copy_(self.inputs, list(inputs))
        self.differentiable = [grad and x.requires_grad for x in inputs]
        for static, needs in zip(self.inputs, self.differentiable):
            static.requires_grad_(needs)
        records = any(self.differentiable)
        self._warm_up(steps, records)
        self.pool = torch.cuda.graph_pool_handle()
        self.forward_graph = torch.cuda.CUDAGraph()
        self.saved: list[torch.Tensor] = []            # the forward's saved tensors that are not inputs (static)
        self.saved_inputs: list[int] = []              # indices of the inputs the forward saves
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        with torch.cuda.graph(self.forward_graph, pool=self.pool, capture_error_mode="thread_local"), \
                hooks if records else contextlib.nullcontext():
            outputs = steps(*self.inputs)
        self.layout = [x is not None for x in outputs]
        self.outputs = [x for x in outputs if x is not None]
        # a saved output is kept through the call's copy of that output; the other saved tensors are copied
        self.saved_outputs = [next((i for i, x in enumerate(self.outputs) if _same(saved, x)), None)
                              for saved in self.saved]
        self.kept = [saved for saved, output in zip(self.saved, self.saved_outputs) if output is None]
        self.grad_outputs = [x.requires_grad for x in self.outputs]
        self.backward_graph = None
        if records:
            self._capture_backward()

    def _warm_up(self, steps: Callable, records: bool) -> None:
        """One call on the static inputs on a side stream: the launch caches keyed by address, cuBLAS workspaces."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            outputs = [x for x in steps(*self.inputs) if x is not None]
            if records:
                wanted = [x for x in outputs if x.requires_grad]
                torch.autograd.grad(wanted, [x for x in self.inputs if x.requires_grad],
                                    [torch.zeros_like(x) for x in wanted], allow_unused=True)
        torch.cuda.current_stream().wait_stream(side)

    def _pack(self, tensor: torch.Tensor):
        for index, static in enumerate(self.inputs):
            if _same(tensor, static):
                if index not in self.saved_inputs:
                    self.saved_inputs.append(index)
                return "input", index
        for index, static in enumerate(self.saved):
            if _same(tensor, static):
                return "saved", index
        self.saved.append(tensor)
        return "saved", len(self.saved) - 1

    def _unpack(self, packed) -> torch.Tensor:
        kind, index = packed
        return self.inputs[index] if kind == "input" else self.saved[index]

    def _capture_backward(self) -> None:
        wanted = [x for x, needs in zip(self.outputs, self.grad_outputs) if needs]
        self.grads_in = [torch.empty_like(x) for x in wanted]
        targets = [x for x, needs in zip(self.inputs, self.differentiable) if needs]
        self.backward_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.backward_graph, pool=self.pool, capture_error_mode="thread_local"):
            grads = torch.autograd.grad(wanted, targets, self.grads_in, allow_unused=True)
        grads = iter(grads)
        self.grads = [next(grads) if needs else None for needs in self.differentiable]

    def __call__(self, inputs: Sequence[torch.Tensor]) -> tuple:
        if self.backward_graph is None:
            outputs = self.replay_forward(inputs, keep=False)[0]
        else:
            outputs = _Replay.apply(self, *inputs)
            outputs = (outputs,) if isinstance(outputs, torch.Tensor) else outputs
        outputs = iter(outputs)
        return tuple(next(outputs) if present else None for present in self.layout)

    def replay_forward(self, inputs: Sequence[torch.Tensor], keep: bool):
        """The outputs of a forward replay on ``inputs``, and with ``keep`` copies of its saved tensors."""
        with torch.no_grad():
            torch._foreach_copy_(self.inputs, list(inputs))
            self.forward_graph.replay()
            sources = self.outputs + (self.kept if keep else [])
            copies = [torch.empty_like(x) for x in sources]
            torch._foreach_copy_(copies, sources)
        return copies[:len(self.outputs)], copies[len(self.outputs):]

    def replay_backward(self, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor],
                        kept: Sequence[torch.Tensor], grad_outputs: Sequence[torch.Tensor]) -> list:
        """The gradients of the inputs (``None`` where there is none) for ``grad_outputs`` (materialized by autograd:
        never ``None``) of a call with these inputs, outputs and copies of its other saved tensors
        (``replay_forward``)."""
        with torch.no_grad():
            saved_outputs = [(saved, outputs[i]) for saved, i in zip(self.saved, self.saved_outputs) if i is not None]
            targets = [*self.kept, *(saved for saved, _ in saved_outputs), *self.grads_in,
                       *(self.inputs[i] for i in self.saved_inputs)]
            sources = [*kept, *(output for _, output in saved_outputs), *grad_outputs,
                       *(inputs[i] for i in self.saved_inputs)]
            torch._foreach_copy_(targets, sources)
            self.backward_graph.replay()
            present = [x for x in self.grads if x is not None]
            copies = [torch.empty_like(x) for x in present]
            torch._foreach_copy_(copies, present)
        copies = iter(copies)
        return [None if x is None else next(copies) for x in self.grads]


class _Replay(torch.autograd.Function):
    """One call's autograd node: forward and backward replays, the call's inputs and saved tensors kept."""

    @staticmethod
    def forward(ctx, call: CapturedCall, *inputs):
        outputs, kept = call.replay_forward(inputs, keep=True)
        ctx.call, ctx.counts = call, (len(inputs), len(outputs))
        ctx.save_for_backward(*inputs, *outputs, *kept)
        ctx.mark_non_differentiable(*(x for x, needs in zip(outputs, call.grad_outputs) if not needs))
        return tuple(outputs) if len(outputs) > 1 else outputs[0]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grad_outputs):
        call, (inputs, outputs) = ctx.call, ctx.counts
        tensors = ctx.saved_tensors
        wanted = [grad for grad, needs in zip(grad_outputs, call.grad_outputs) if needs]
        grads = call.replay_backward(tensors[:inputs], tensors[inputs:inputs + outputs], tensors[inputs + outputs:],
                                     wanted)
        return (None, *grads)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors are the same view of the same memory."""
    return (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
            and a.dtype == b.dtype)
