"""Eager Triton launches that skip Triton's argument binder once a kernel is compiled.

``JITFunction.run`` binds every argument, specializes each one (dtype and 16-byte alignment of a pointer,
``== 1`` and divisibility by 16 of an int), builds a cache key from the result and options, checks the kernel's
globals and builds launch metadata: 25-60 us of host time per launch of a flexsparse kernel (8-45 arguments) on an
H200 host, where the compiled kernel's own ``run`` costs a few. ``FastLaunch`` keys the compiled kernel by a
fingerprint of the arguments that refines Triton's specialization (two calls with one fingerprint specialize
alike; ``fingerprint``), computed in one pass, and calls ``CompiledKernel.run`` directly on a hit. Gluon kernels take
the same path: a host TMA descriptor is keyed by what Triton specializes on (dtype, block shape, shared layout), and
the compiled kernel's launcher encodes it at every launch, as on Triton's path. A miss, or a call it cannot key (an
argument of another type; a callable grid; launch or stage hooks, pre-run hooks, debug or instrumentation knobs set)
goes through ``JITFunction.run``, which compiles where needed; the compiled kernel it returns is kept for the
fingerprint.

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
_UNKEYED = object()
_NO_KEY = None, None, None
_I32_MIN, _I32_MAX, _U64_MIN = -2**31, 2**31 - 1, 2**63


def fingerprint(value):
    """``(key, launch value)`` of one non-constexpr argument. The key is hashable and determines Triton's
    specialization of the argument: dtype, 16-byte alignment and device type of a tensor, ``== 1``, divisibility by
    16 and integer width of an int, the value of a bool, the class of a float or None, the base dtype, block shape,
    shared layout and padding of a Gluon TMA descriptor (its shape and strides are launch arguments); ``_UNKEYED``
    for anything else. The launch value is the argument itself, or a tensor's address (an int: the launcher then
    skips its per-pointer driver query; a CPU tensor has another key, so it misses and gets Triton's error)."""
    cls = value.__class__
    if cls is int:
        return (1 if value == 1 else (value & 15 == 0, _I32_MIN <= value <= _I32_MAX, value >= _U64_MIN)), value
    if isinstance(value, torch.Tensor):
        address = value.data_ptr()
        return (value.dtype, address & 15 == 0, value.is_cuda), address
    if cls is bool or value is None:
        return (value, cls), value
    if cls is float:
        return float, value
    if cls is GluonDescriptor:
        return (cls, value.base.dtype, tuple(value.block_shape), value.layout, value.padding,
                getattr(value, "round_f32_to_tf32", False)), value
    return _UNKEYED, value


class FastLaunch:
    """``kernel[grid](*args, **kwargs)`` for a plain ``JITFunction`` (module docstring)."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.names = tuple(p.name for p in kernel.params)
        self.constexpr = tuple(p.is_constexpr for p in kernel.params)
        self.defaults = tuple(p.default for p in kernel.params)
        self.compiled: dict = {}

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def launch(self, grid, args: tuple, kwargs: dict):
        """Launch on ``grid`` (a tuple of up to three ints): the compiled kernel of the arguments' fingerprint, or
        Triton's path on a miss."""
        key, values, device = self._key(grid, args, kwargs)
        try:
            compiled = None if key is None else self.compiled.get(key)
        except TypeError:    # an unhashable constexpr or option value
            key = compiled = None
        if compiled is None:
            compiled = self.kernel.run(*args, grid=grid, warmup=False, **kwargs)
            if key is not None and compiled is not None:
                self.compiled[key] = compiled.result() if hasattr(compiled, "result") else compiled
            return compiled
        stream = driver.active.get_current_stream(device)
        size = len(grid)
        compiled.run(grid[0], grid[1] if size > 1 else 1, grid[2] if size > 2 else 1, stream, compiled.function,
                     compiled.packed_metadata, None, None, None, *values)
        return compiled

    def _key(self, grid, args: tuple, kwargs: dict):
        """``(key, every parameter's launch value in order (``fingerprint``), device)``; a None key where the call
        cannot be keyed."""
        runtime = knobs.runtime
        if (not ENABLED or callable(grid) or self.kernel.pre_run_hooks or not _empty(runtime.launch_enter_hook)
                or not _empty(runtime.launch_exit_hook) or runtime.add_stages_inspection_hook is not None
                or runtime.debug or knobs.compilation.instrumentation_mode):
            return _NO_KEY
        values = list(args)
        options = kwargs
        if len(values) < len(self.names):
            options = dict(kwargs)
            for name, default in zip(self.names[len(values):], self.defaults[len(values):]):
                values.append(options.pop(name) if name in options else default)
        parts = []
        for i, constexpr in enumerate(self.constexpr):
            if constexpr:
                parts.append(values[i])
                continue
            part, values[i] = fingerprint(values[i])
            if part is _UNKEYED:
                return _NO_KEY
            parts.append(part)
        device = driver.active.get_current_device()
        return (device, tuple(parts), tuple(options.items())), values, device


def _empty(hook) -> bool:
    """Whether a launch hook knob calls nothing (None, or a ``HookChain`` with no hooks added)."""
    return hook is None or (type(hook) is HookChain and not hook.calls)
