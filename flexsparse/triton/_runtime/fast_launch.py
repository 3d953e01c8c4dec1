"""Eager Triton launches that skip Triton's argument binder once a kernel is compiled.

``JITFunction.run`` binds every argument, specializes each one (dtype and 16-byte alignment of a pointer,
``== 1`` and divisibility by 16 of an int), builds a cache key from the result and options, checks the kernel's
globals and builds launch metadata: 25-60 us of host time per launch of a flexsparse kernel (8-45 arguments) on an
H200 host, where the compiled kernel's own ``run`` costs a few. ``FastLaunch`` keys the compiled kernel by a key
that refines Triton's specialization (two calls with one key specialize alike): the arguments' types; ints, bools,
floats and None as they are (within one tuple of types ``True``, ``1`` and ``1.0`` never meet, and the key takes no
Python step per scalar); a tensor's dtype, 16-byte alignment and device type, at positions planned once per tuple of
types; the constexprs and options. It calls ``CompiledKernel.run`` directly on a hit. Gluon kernels take
the same path: a host TMA descriptor is keyed by what Triton specializes on (dtype, block shape, shared layout), and
the compiled kernel's launcher encodes it at every launch, as on Triton's path. A miss, or a call it cannot key (an
argument of another type; a callable grid; launch or stage hooks, pre-run hooks, debug or instrumentation knobs set)
goes through ``JITFunction.run``, which compiles where needed; the compiled kernel it returns is kept for the
key (``MAX_KEYS`` keys per kernel, then the table starts over: a model run at many lengths).

``FLEXSPARSE_TRITON_LAUNCH=triton`` (read at import) keeps every launch on Triton's own path.
"""
from __future__ import annotations

import os

import torch
from triton import knobs
from triton.knobs import HookChain
from triton.runtime.driver import driver

try:
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
except ImportError:                                             # a Triton without Gluon
    GluonDescriptor = None

ENABLED = os.environ.get("FLEXSPARSE_TRITON_LAUNCH", "fast") != "triton"
MAX_KEYS = 4096                     # compiled-kernel entries per kernel before the table starts over
_UNKEYED = object()
_NO_KEY = None, None, None
_SCALARS = frozenset((int, bool, float, type(None)))


def _descriptor_key(descriptor) -> tuple:
    """The key of a Gluon TMA descriptor argument: its base dtype, block shape, shared layout and padding (its shape
    and strides are launch arguments)."""
    return (descriptor.base.dtype, tuple(descriptor.block_shape), descriptor.layout, descriptor.padding,
            getattr(descriptor, "round_f32_to_tf32", False))


class FastLaunch:
    """``kernel[grid](*args, **kwargs)`` for a plain ``JITFunction`` (module docstring)."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.names = tuple(p.name for p in kernel.params)
        self.constexpr = tuple(p.is_constexpr for p in kernel.params)
        self.defaults = tuple(p.default for p in kernel.params)
        self.compiled: dict = {}
        self.plans: dict = {}

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def launch(self, grid, args: tuple, kwargs: dict):
        """Launch on ``grid`` (a tuple of up to three ints): the compiled kernel of the arguments' key, or Triton's
        path on a miss."""
        key, values, device = self._key(grid, args, kwargs)
        try:
            compiled = None if key is None else self.compiled.get(key)
        except TypeError:    # an unhashable constexpr or option value
            key = compiled = None
        if compiled is None:
            compiled = self.kernel.run(*args, grid=grid, warmup=False, **kwargs)
            if key is not None and compiled is not None:
                if len(self.compiled) >= MAX_KEYS:
                    self.compiled.clear()
                self.compiled[key] = compiled.result() if hasattr(compiled, "result") else compiled
            return compiled
        stream = driver.active.get_current_stream(device)
        size = len(grid)
        compiled.run(grid[0], grid[1] if size > 1 else 1, grid[2] if size > 2 else 1, stream, compiled.function,
                     compiled.packed_metadata, None, None, None, *values)
        return compiled

    def _key(self, grid, args: tuple, kwargs: dict):
        """``(key, every parameter's launch value in order, device)``; a None key where the call cannot be keyed.
        The key: the device, the arguments' tuple of types (as the number of its plan, ``_plan``), their values
        with tensors and descriptors replaced by their keys and the options. A tensor's key: its dtype, 16-byte
        alignment and device type; its launch value: its address (an int: the launcher then skips its per-pointer
        driver query; a CPU tensor has another key, so it misses and gets Triton's error). A descriptor's key:
        ``_descriptor_key``. The loops are written out: a function call per tensor cost ~10 % of the key."""
        runtime = knobs.runtime
        if (not ENABLED or callable(grid) or self.kernel.pre_run_hooks or not _empty(runtime.launch_enter_hook)
                or not _empty(runtime.launch_exit_hook) or runtime.add_stages_inspection_hook is not None
                or runtime.debug or knobs.compilation.instrumentation_mode):
            return _NO_KEY
        given = len(args)
        if given < len(self.names):
            options = dict(kwargs)
            pop = options.pop
            values = [*args, *[pop(name, default) for name, default in zip(self.names[given:], self.defaults[given:])]]
        else:
            options, values = kwargs, list(args)
        types = tuple(map(type, values))
        plan = self.plans.get(types)
        if plan is None:
            plan = self.plans[types] = self._plan(types)
        if plan is _UNKEYED:
            return _NO_KEY
        number, tensors, descriptors = plan
        parts = values.copy()
        for i in tensors:
            tensor = values[i]
            values[i] = address = tensor.data_ptr()
            parts[i] = tensor.dtype, address & 15 == 0, tensor.is_cuda
        for i in descriptors:
            parts[i] = _descriptor_key(values[i])
        device = driver.active.get_current_device()
        return (device, number, tuple(parts), tuple(options.items())), values, device

    def _plan(self, types: tuple):
        """``(number, tensor positions, descriptor positions)`` among the non-constexpr parameters of arguments of
        ``types`` (``number``: this tuple of types' place among the kernel's plans), or ``_UNKEYED`` where one has
        another type than those and the scalars."""
        tensors, descriptors = [], []
        for i, (cls, constexpr) in enumerate(zip(types, self.constexpr)):
            if constexpr or cls in _SCALARS:
                continue
            if issubclass(cls, torch.Tensor):
                tensors.append(i)
            elif cls is GluonDescriptor:
                descriptors.append(i)
            else:
                return _UNKEYED
        return len(self.plans), tuple(tensors), tuple(descriptors)


def _empty(hook) -> bool:
    """Whether a launch hook knob calls nothing (None, or a ``HookChain`` with no hooks added)."""
    return hook is None or (type(hook) is HookChain and not hook.calls)
