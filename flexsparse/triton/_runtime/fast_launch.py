"""Eager Triton launches that skip Triton's argument binder once a kernel is compiled.

``JITFunction.run`` binds every argument, specializes each one (dtype and 16-byte alignment of a pointer,
``== 1`` and divisibility by 16 of an int), builds a cache key from the result and options, checks the kernel's
globals and builds launch metadata: 25-60 us of host time per launch of a flexsparse kernel (8-45 arguments) on an
H200 host, where the compiled kernel's own ``run`` costs a few. ``FastLaunch`` keys the compiled kernel by a key
that refines Triton's specialization (two calls with one key specialize alike): the arguments' types; ints, bools,
floats and None as they are (within one tuple of types ``True``, ``1`` and ``1.0`` never meet, and the key takes no
Python step per scalar); a tensor's dtype, 16-byte alignment and device type, at positions planned once per tuple of
types; the constexprs and options. It calls ``CompiledKernel.run`` directly on a hit. Gluon kernels take
the same path: a host TMA descriptor is keyed by what Triton specializes on (dtype, block shape, shared layout).
Triton's launcher encodes each descriptor at every launch (~13 us of host time each on an H200 host, three to five
per Gluon launch); ``TmaLaunch`` keeps the encoded ones per address, shape and strides and calls the compiled
launcher's C entry itself where the launcher is triton 3.6's (else Triton's launcher runs). A miss, or a call it
cannot key (an argument of another type; a callable grid; launch or stage hooks, pre-run hooks, debug or
instrumentation knobs set) goes through ``JITFunction.run``, which compiles where needed; the compiled kernel it
returns is kept for the key (``MAX_KEYS`` keys per kernel, then the table starts over: a model run at many
lengths).

``FLEXSPARSE_TRITON_LAUNCH=triton`` (read at import; ``fast``, the default, or ``triton``) keeps every launch on
Triton's own path.
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

LAUNCH = os.environ.get("FLEXSPARSE_TRITON_LAUNCH") or "fast"
if LAUNCH not in ("fast", "triton"):
    raise ValueError(f"FLEXSPARSE_TRITON_LAUNCH must be 'fast' or 'triton', got {LAUNCH!r}")
ENABLED = LAUNCH == "fast"
MAX_KEYS = 4096                     # compiled-kernel entries per kernel before the table starts over
MAX_ENCODED = 256                   # encoded TMA descriptors per kernel argument before that table starts over
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
            entry = None if key is None else self.compiled.get(key)
        except TypeError:    # an unhashable constexpr or option value
            key = entry = None
        if entry is None:
            compiled = self.kernel.run(*args, grid=grid, warmup=False, **kwargs)
            if key is not None and compiled is not None:
                if len(self.compiled) >= MAX_KEYS:
                    self.compiled.clear()
                compiled = compiled.result() if hasattr(compiled, "result") else compiled
                self.compiled[key] = compiled, TmaLaunch.of(compiled)
            return compiled
        compiled, tma = entry
        stream = driver.active.get_current_stream(device)
        size = len(grid)
        grid = grid[0], grid[1] if size > 1 else 1, grid[2] if size > 2 else 1
        if tma is not None:
            tma(grid, stream, compiled, values)
        else:
            compiled.run(*grid, stream, compiled.function, compiled.packed_metadata, None, None, None, *values)
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


class TmaLaunch:
    """A compiled Gluon kernel's launch with its host TMA descriptors encoded once per (address, shape, strides,
    padding) of each descriptor argument (``MAX_ENCODED`` per argument), through the C entry of triton 3.6's
    launcher. The encoding depends on nothing else for one compiled kernel (its dtype, block shape and swizzle are
    the compiled kernel's), so a kept one equals a fresh one; Triton's ``make_tensordesc_arg`` makes it."""

    def __init__(self, run, entry, meta: list, positions: list):
        from triton.backends.nvidia.driver import make_tensordesc_arg
        self.entry = entry
        self.flags = run.launch_cooperative_grid, run.launch_pdl
        self.slots = [(position, meta, {}) for position, meta in zip(positions, meta)]
        self.encode = make_tensordesc_arg

    @classmethod
    def of(cls, compiled) -> "TmaLaunch | None":
        """The ``TmaLaunch`` of ``compiled``, or None where it has no TMA descriptor argument, needs scratch memory
        or its launcher is not triton 3.6's (descriptors wrapped by ``wrap_handle_tensordesc`` around the C
        entry, 13 leading launch arguments)."""
        run = getattr(compiled, "run", None)
        inner = getattr(run, "launch", None)
        names = getattr(getattr(inner, "__code__", None), "co_freevars", ())
        if not {"launcher", "tensordesc_indices", "tensordesc_meta"} <= set(names):
            return None
        try:
            from triton.backends.nvidia import driver as nvidia
        except ImportError:
            return None
        cells = {name: cell.cell_contents for name, cell in zip(names, inner.__closure__)}
        meta, positions = cells["tensordesc_meta"], sorted(cells["tensordesc_indices"])
        if (getattr(nvidia, "_BASE_ARGS_FORMAT_LEN", None) != 13 or run.global_scratch_size
                or run.profile_scratch_size or not positions or any(m is None for m in meta)):
            return None
        return cls(run, cells["launcher"], meta, positions)

    def __call__(self, grid: tuple, stream, compiled, values: list) -> None:
        """Launch ``compiled`` on ``grid`` (three ints) with every parameter's launch value in order."""
        args, start = [], 0
        for position, meta, encoded in self.slots:
            args += values[start:position]
            descriptor = values[position]
            key = descriptor.base.data_ptr(), tuple(descriptor.shape), tuple(descriptor.strides), descriptor.padding
            words = encoded.get(key)
            if words is None:
                if len(encoded) >= MAX_ENCODED:
                    encoded.clear()
                words = encoded[key] = self.encode(descriptor, meta)
            args += words
            start = position + 1
        args += values[start:]
        self.entry(*grid, stream, compiled.function, *self.flags, None, None, compiled.packed_metadata, None, None,
                   None, *args)
