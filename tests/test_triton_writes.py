"""``torch.compile`` must see exactly which arguments each Triton kernel writes.

``wrap_triton`` decides that from the kernel's TTIR (``identify_accessed_tensors``). It is conservative across
``@triton.jit`` helper calls: every operand of a call taints the call's results, so a helper that takes a tensor
pointer and returns an index later used in a store address marks that tensor as written. Compiled graphs then
clone it before the launch, and a leaf that requires grad fails ("a leaf Variable that requires grad is being used
in an in-place operation"). The GPU's compiled tests catch that only for the kernels they trace; this test checks
every kernel the methods launch, on CPU.

A child process with ``TRITON_INTERPRET=1`` runs the methods forward and backward and records each launch: its
arguments (tensors as shapes) and which tensors' bytes it changed. This process then asks torch's analysis (TTIR
for an sm_90 target, no GPU needed) which tensors each kernel writes, and compares. It also builds each kernel's
TTIR the way torch 2.11 (the GPU image's) does, with the runtime scalars as constants: that must not fail either.
"""
from __future__ import annotations

import ast
import contextlib
import importlib
import inspect
import json
import os
import pickle
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import triton_support as ts

# the block-sparse methods' scenarios: each such method of the registry (its example with K = 2 or 30% of the key
# blocks, on 96 tokens and 2 heads) with (config changes, KV heads), by default 16-token blocks and 1 KV head
BLOCK_SCENARIOS = {"sla2": ({"block_q": 32, "block_k": 16}, 2)}
SCENARIOS = [  # (name, config, N, heads, KV heads, FLEXSPARSE_TRITON_TILES)
    ("llsa", {"method": "llsa", "block_size": 16, "topk": [2, 2]}, 512, 2, 1, {}),  # fused forward, batched dQ
    ("llsa fused dQ", {"method": "llsa", "block_size": 16, "topk": [2, 2]}, 512, 2, 1, {"bwd": {"fuse_dq": True}}),
    ("llsa hoisted", {"method": "llsa", "block_size": 16, "topk": [2, 2]}, 4096, 1, 1, {}),  # even: key rows hoisted
    ("llsa ragged", {"method": "llsa", "block_size": 8, "topk": [4, 2]}, 100, 2, 1, {}),
    ("llsa wide children rows", {"method": "llsa", "block_size": 8, "topk": [2, 17]}, 1152, 1, 1, {}),  # 136
    # candidates per row: the children's selection bisects
    ("llsa ancestor-major dK/dV", {"method": "llsa", "block_size": 4, "topk": [3, 2, 2]}, 300, 2, 1,
     {"bwd": {"entry_memory": 1e9}}),
    ("llsa deterministic", {"method": "llsa", "block_size": 8, "topk": [2, 2], "deterministic": True}, 128, 2, 2,
     {}),
] + [(name, ts.example_config(name, topk=2, topk_ratio=0.3, **changes), 96, 2, kv_heads, {})
      for name in ts.triton_methods("block")
      for changes, kv_heads in [BLOCK_SCENARIOS.get(name, ({"block_size": 16}, 1))]]


# Kernels whose store addresses come from the data they read: the selection kernels searching by bisection
# (``SEARCH`` other than ``hierarchy.SEARCH_PACKED``) pack each row's taken columns by rank, a scatter whose
# address depends on the scores and so on the pyramids and the level table. The analysis cannot tell that from
# writing them; compiled graphs copy these (intermediate) tensors before the launch where they are read after it.
# Their packed search stores each row's tokens in place.
DATA_ADDRESSED = {("flexsparse.triton.selection.hierarchy", "_select_top_kernel"): {"QP", "KP", "META"},
                  ("flexsparse.triton.selection.hierarchy", "_select_children_kernel"): {"QP", "KP", "META"}}


class _Recorder:
    """Stands in for ``_runtime.registry.launcher``: launches as it would and records each launch in ``LAUNCHES``: the
    module and name of the kernel, its arguments (tensors as ``("tensor", shape, stride, dtype)``) and its tensor
    arguments in groups of overlapping memory (a tensor passed twice, or a view of another) with whether the launch
    stored into each group (``ADDRESSES``, filled by the interpreter's patched stores)."""

    def __init__(self, launcher, kernel):
        self.launcher, self.kernel = launcher, kernel

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            fn = self.kernel.fn  # the Python function of the (interpreted) kernel
            named = dict(zip(inspect.signature(fn).parameters, args), **kwargs)
            spans = {k: _span(v) for k, v in named.items() if isinstance(v, torch.Tensor) and v.numel()}
            ADDRESSES.clear()
            self.launcher(self.kernel)[grid](*args, **kwargs)
            stored = np.concatenate(ADDRESSES) if ADDRESSES else np.zeros(0, np.uint64)
            hit = {k for k, (lo, hi) in spans.items() if ((stored >= lo) & (stored < hi)).any()}
            LAUNCHES.append((fn.__module__, fn.__name__, {
                k: ("tensor", tuple(v.shape), tuple(v.stride()), str(v.dtype)) if isinstance(v, torch.Tensor) else v
                for k, v in named.items()}, [(group, bool(hit & set(group))) for group in _overlapping(spans)]))
        return launch


LAUNCHES: list = []
ADDRESSES: list = []


def _span(x: torch.Tensor) -> tuple[int, int]:
    """The byte range ``[first, end)`` a tensor's elements cover."""
    last = sum((size - 1) * stride for size, stride in zip(x.shape, x.stride()))
    return x.data_ptr(), x.data_ptr() + (last + 1) * x.element_size()


def _overlapping(spans: dict) -> list[tuple[str, ...]]:
    """The names of ``spans`` grouped by overlapping ranges (sorted names per group)."""
    groups: list[tuple[set, int, int]] = []
    for name, (lo, hi) in sorted(spans.items(), key=lambda item: item[1]):
        if groups and lo < groups[-1][2]:
            names, first, end = groups[-1]
            groups[-1] = (names | {name}, first, max(end, hi))
        else:
            groups.append(({name}, lo, hi))
    return [tuple(sorted(names)) for names, _, _ in groups]


def _watch_stores() -> None:
    """Make the interpreter's stores and atomics append the addresses they write to ``ADDRESSES``."""
    from triton.runtime import interpreter
    builder = interpreter.interpreter_builder
    store, rmw, cas = builder.create_masked_store, builder.create_atomic_rmw, builder.create_atomic_cas

    def masked(ptrs, mask):
        ADDRESSES.append(np.broadcast_to(ptrs.data, mask.data.shape)[mask.data.astype(bool)].astype(np.uint64))

    def create_masked_store(ptrs, value, mask, *rest):
        masked(ptrs, mask)
        return store(ptrs, value, mask, *rest)

    def create_atomic_rmw(op, ptr, val, mask, *rest):
        masked(ptr, mask)
        return rmw(op, ptr, val, mask, *rest)

    def create_atomic_cas(ptr, *rest):
        ADDRESSES.append(np.asarray(ptr.data, dtype=np.uint64).ravel())
        return cas(ptr, *rest)

    builder.create_masked_store = create_masked_store
    builder.create_atomic_rmw = create_atomic_rmw
    builder.create_atomic_cas = create_atomic_cas


def record(out: str) -> None:
    """Child process: run every scenario forward and backward through the interpreter, pickle the launches."""
    import pkgutil

    import flexsparse
    import flexsparse.triton as package
    from flexsparse.config import Config
    from flexsparse.methods import METHODS
    _watch_stores()
    names = [info.name for info in pkgutil.walk_packages(package.__path__, "flexsparse.triton.")
             if not info.ispkg and "._runtime." not in info.name]
    modules = [importlib.import_module(name) for name in names]   # every module first: none binds a recorder
    for module in modules:
        if hasattr(module, "launcher"):
            original = module.launcher
            module.launcher = lambda kernel, original=original: _Recorder(original, kernel)
    for _, cfg, n, heads, kv_heads, tiles in SCENARIOS:
        os.environ["FLEXSPARSE_TRITON_TILES"] = json.dumps(tiles)
        torch.manual_seed(0)
        q = torch.randn(1, heads, n, 16, requires_grad=True)
        k, v = (torch.randn(1, kv_heads, n, 16, requires_grad=True) for _ in range(2))
        params = {key: p.requires_grad_() for key, p in
                  METHODS[cfg["method"]].init_params(Config.from_dict(cfg), 16, heads, n).items()}
        o = flexsparse.attention(q, k, v, cfg, backend="triton", params=params or None)
        o.square().sum().backward()
    from flexsparse.masks.levels import level_table
    from flexsparse.triton.common.inputs import contiguous_rows
    from flexsparse.triton.linear.dense import block_sums, keep_rows, key_sums, query_sums
    from flexsparse.triton.pooling.op import center_tokens
    from flexsparse.triton.selection import hierarchy
    from flexsparse.triton.selection.op import block_topk
    pooled_q, pooled_k = torch.randn(1, 2, 40, 16), torch.randn(1, 1, 40, 16)
    block_topk(pooled_q, pooled_k, 4, 2)  # a bottom set too (the methods above select none)
    center_tokens(torch.randn(1, 2, 40, 16), torch.randn(1, 2, 1, 16))
    # bisection: a top level of 512 tokens; threshold: children at D > 64
    for n, block, d in ((8192, 4, 64), (512, 16, 128)):
        levels = level_table(n, block, [2, 2])
        hierarchy.hierarchical_topk(*(torch.randn(1, 1, levels.pyramid_tokens, d) for _ in range(2)), levels)
    contiguous_rows(torch.randn(1, 40, 3, 2, 16).permute(2, 0, 3, 1, 4)[0])  # q of a fused projection
    skipped = torch.randint(0, 9, (1, 2, 5, 3), dtype=torch.int32)        # the dense strategy (GPU only)
    block_sums(keep_rows(skipped, 9, torch.float32, 2).view(2, 10, 9), torch.randn(2, 9, 256), torch.randn(2, 9, 16))
    query_sums(skipped, torch.randn(1, 1, 9, 16, 16), torch.randn(1, 1, 9, 16))
    key_sums(skipped, torch.randn(1, 2, 10, 16, 16), torch.randn(1, 2, 10, 16), 1, 9, 2)
    with open(out, "wb") as f:
        pickle.dump(LAUNCHES, f)


@contextlib.contextmanager
def _sm90_target():
    """Make Triton's active driver report an sm_90 target (TTIR needs one; no GPU needed)."""
    from triton.backends.compiler import GPUTarget
    import triton

    class Sm90:
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

    config = triton.runtime.driver
    previous = config._active  # no public getter that works without a GPU driver
    config.set_active(Sm90())
    try:
        yield
    finally:
        config._active = previous


def _kernel_and_args(module: str, name: str, spec: dict):
    """The kernel ``module.name`` and its recorded arguments, tensors as empty ones of the recorded layout."""
    kwargs = {k: torch.empty_strided(v[1], v[2], dtype=getattr(torch, v[3].split(".")[1]))
              if isinstance(v, tuple) and v[:1] == ("tensor",) else v for k, v in spec.items()}
    return getattr(importlib.import_module(module), name), kwargs


def _runtime_scalars(kernel, kwargs: dict) -> list:
    """The kernel's parameters that take a runtime scalar in this launch (neither constexpr nor a tensor)."""
    return [p for p in kernel.params if not p.is_constexpr and not isinstance(kwargs.get(p.name), torch.Tensor)]


def _written(kernel, kwargs: dict) -> set[str]:
    """The tensor arguments torch's TTIR analysis says the kernel writes, for a sm_90 target."""
    from torch._higher_order_ops import triton_kernel_wrap as wrap
    with _sm90_target():
        accesses = wrap.identify_accessed_tensors(kernel, kwargs, {})
    return {dep.name for dep in accesses.read_writes.writes}


def _ttir_error_with_scalars_constant(kernel, kwargs: dict) -> str | None:
    """Why the kernel's TTIR fails when its runtime scalars are constants, as torch <= 2.11's analysis
    makes them (pytorch#170049; not 2.13); None if it builds. A kernel that calls a method of a scalar
    argument (``n.to(tl.int64)``) fails there, torch falls back to "every tensor argument is written", and
    compiled graphs copy, and may alias wrongly, what the kernel never wrote."""
    from torch._higher_order_ops import triton_kernel_wrap as wrap
    scalars = _runtime_scalars(kernel, kwargs)
    with _sm90_target():
        try:
            for param in scalars:
                param.__dict__["is_constexpr"] = True  # shadows the cached property
            wrap.generate_ttir(kernel, kwargs, {})
        except Exception as error:  # noqa: BLE001 (the analysis catches every exception too)
            return f"{type(error).__name__}: {str(error)[-300:]}"
        finally:
            for param in scalars:
                param.__dict__.pop("is_constexpr", None)
    return None


def _scalar_methods(kernel, kwargs: dict) -> list[str]:
    """``arg.attr`` in the kernel's source (every branch, not only this launch's) where ``arg`` is a runtime
    scalar of the launch: what the TTIR of its scalars as constants fails on."""
    scalars = {p.name for p in _runtime_scalars(kernel, kwargs)}
    tree = ast.parse(textwrap.dedent(inspect.getsource(kernel.fn)))
    return sorted({f"{node.value.id}.{node.attr}" for node in ast.walk(tree) if isinstance(node, ast.Attribute)
                   and isinstance(node.value, ast.Name) and node.value.id in scalars})


@ts.cpu_parent
@pytest.mark.exhaustive
@pytest.mark.skipif(not hasattr(__import__("torch._higher_order_ops.triton_kernel_wrap",
                                           fromlist=["x"]), "identify_accessed_tensors"),
                    reason="this torch has no identify_accessed_tensors")
def test_compile_sees_exactly_the_written_tensors(tmp_path):
    from flexsparse.triton.selection import hierarchy  # this process compiles TTIR: no interpreter here
    out = tmp_path / "launches.pkl"
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join(filter(None, [ts.ROOT, os.path.dirname(__file__),
                                                        os.environ.get("PYTHONPATH")])))
    child = subprocess.run([sys.executable, __file__, str(out)], env=env, capture_output=True, text=True, timeout=900)
    assert child.returncode == 0, child.stdout[-4000:] + child.stderr[-4000:]
    launches = pickle.loads(out.read_bytes())
    seen, wrong, scattered = set(), [], set()
    for module, name, spec, groups in launches:
        key = (module, name, tuple(sorted((k, v) for k, v in spec.items() if not isinstance(v, tuple))))
        if key in seen:
            continue
        seen.add(key)
        kernel, kwargs = _kernel_and_args(module, name, spec)
        written = _written(kernel, kwargs)
        error = _ttir_error_with_scalars_constant(kernel, kwargs)
        if error:
            wrong.append(f"{module}.{name}: no TTIR with its scalars as constants (torch <= 2.11): {error}")
        scalar_methods = _scalar_methods(kernel, kwargs)
        if scalar_methods:
            wrong.append(f"{module}.{name}: {scalar_methods} on runtime scalars: a constant in torch <= 2.11's "
                         "write analysis has no such attribute (use tl.cast)")
        extra = set() if spec.get("SEARCH") == hierarchy.SEARCH_PACKED else DATA_ADDRESSED.get((module, name), set())
        if extra:
            scattered.add((module, name))
        if not extra <= written:
            wrong.append(f"{module}.{name}: the analysis no longer writes {sorted(extra - written)}: update "
                         "DATA_ADDRESSED")
        written -= extra
        for group, stored in groups:
            if stored and len(group) > 1:
                wrong.append(f"{module}.{name}: {'/'.join(group)} overlap and are stored into: pass an input as "
                             "the unused pointer (_runtime.registry.launcher)")
            if bool(written & set(group)) != stored:
                wrong.append(f"{module}.{name}: {'/'.join(group)} {'is' if stored else 'is not'} stored into, "
                             f"the analysis says it writes {sorted(written)}")
    assert len({(m, n) for m, n, _, _ in launches}) >= 26  # every kernel the interpreter runs
    assert scattered == set(DATA_ADDRESSED), "a selection kernel never searched by bisection or threshold here"
    assert not wrong, "\n".join(wrong)


if __name__ == "__main__":
    record(sys.argv[1])
