"""Which aten ops allocate a tensor as large as q on the ``triton`` backend's eager path (CPU, no GPU needed).
Not a ``python -m flexsparse`` case: the runner times calls, this counts the allocations around the kernels.

Runs every method's forward (no grad) and forward+backward on CPU tensors with ``TRITON_INTERPRET=1`` and every
Triton launch stubbed out (so only the PyTorch glue around the kernels runs), and counts the ops that allocate a
new storage of at least half of q's bytes (views and in-place writes into it are not counted again). Kernel
outputs (``empty_like``/``new_empty``) are expected; anything else (copies, casts, adds, zero fills) is a full pass
over memory on the GPU that a kernel could fuse. The block selection's kernels run stubbed too; the index tables
the later steps read come from the PyTorch selection, outside the count (an unwritten table would fail their
indexing).

    python benchmarks/allocation_audit.py [--n 2048] [--methods topk vsa llsa sla sla2]
"""
from __future__ import annotations

import argparse
import collections
import importlib
import os
import pkgutil

os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes  # noqa: E402

import flexsparse  # noqa: E402
import flexsparse.triton as families  # noqa: E402
from flexsparse.backends import BACKENDS, Backend  # noqa: E402

CONFIGS = {"topk": {"method": "topk", "block_size": 64, "topk": 4},
           "vsa": {"method": "vsa", "block_size": 64, "topk": 4},
           "llsa": {"method": "llsa", "block_size": 16, "topk": 4},
           "sla": {"method": "sla", "block_size": 64, "topk_ratio": 0.1},
           "sla2": {"method": "sla2", "block_q": 128, "block_k": 64, "topk_ratio": 0.1}}


LAUNCHES: collections.Counter = collections.Counter()   # stubbed launches by kernel name


class _NoLaunch:
    """Stands in for ``_runtime.registry.launcher(kernel)``: ``launcher(kernel)[grid](...)`` only counts the launch
    (``LAUNCHES``)."""

    def __init__(self, kernel):
        self.name = getattr(kernel, "__name__", None) or getattr(getattr(kernel, "fn", None), "__name__", "?")

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            LAUNCHES[self.name] += 1
        return launch


def stub_launches() -> None:
    """Every kernel module of the op families (``flexsparse.triton.<family>.<module>``) launches nothing; the triton
    backend's block selection returns the PyTorch one after its (stubbed) kernels."""
    for family in pkgutil.iter_modules(families.__path__):
        if not family.ispkg or family.name.startswith("_"):
            continue
        package = importlib.import_module(f"flexsparse.triton.{family.name}")
        for info in pkgutil.iter_modules(package.__path__):
            try:
                module = importlib.import_module(f"{package.__name__}.{info.name}")
            except (ImportError, AttributeError):  # a Gluon module this triton cannot import (block_sparse.gluon)
                if info.name.endswith("_ws"):
                    continue
                raise
            if hasattr(module, "launcher"):
                module.launcher = _NoLaunch
    triton = BACKENDS["triton"]

    def block_topk(q_pooled, k_pooled, topk, bottomk=0, _kernels=triton.block_topk):
        _kernels(q_pooled, k_pooled, topk, bottomk)
        with _disable_current_modes():
            return Backend.block_topk(triton, q_pooled, k_pooled, topk, bottomk)

    triton.block_topk = block_topk


class LargeAllocations(TorchDispatchMode):
    """Counts ``(op, storage bytes / reference bytes)`` of op outputs in new storages of >= half the reference."""

    def __init__(self, reference: torch.Tensor, inputs: list[torch.Tensor]):
        super().__init__()
        self.size = reference.untyped_storage().nbytes()
        self.known = {x.untyped_storage().data_ptr() for x in inputs}  # storages already counted (or inputs)
        self.seen = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.known:
                self.known.add(t.untyped_storage().data_ptr())  # views and in-place writes reuse a known storage
                nbytes = t.untyped_storage().nbytes()
                if nbytes >= self.size // 2:
                    self.seen[(str(func).removeprefix("aten."), round(nbytes / self.size, 2))] += 1
        return out


def eager_calls(name: str, n: int, heads: int, quant: dict | None = None):
    """``(inputs, {"fwd": call, "fwd+bwd": call})``: the ``no_grad`` forward and the forward+backward of method
    ``name`` (``CONFIGS``, with config key ``quant`` where given) on the triton backend, on fresh bf16 CPU leaves
    ``(1, heads, n, 64)``; ``inputs``: q, k, v and the upstream gradient."""
    config = CONFIGS[name] if quant is None else {**CONFIGS[name], "quant": quant}
    module = flexsparse.SparseAttention(config, head_dim=64, num_heads=heads, seq_len=n, backend="triton")
    q, k, v = (torch.randn(1, heads, n, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad = torch.randn(1, heads, n, 64, dtype=torch.bfloat16)

    def forward():
        with torch.no_grad():
            module(q, k, v)

    return [q, k, v, grad], {"fwd": forward, "fwd+bwd": lambda: torch.autograd.grad(module(q, k, v), (q, k, v), grad)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=2048)
    parser.add_argument("--methods", nargs="+", default=list(CONFIGS))
    args = parser.parse_args()
    stub_launches()
    for name in args.methods:
        inputs, calls = eager_calls(name, args.n, heads=2)
        for phase, call in calls.items():
            audit = LargeAllocations(inputs[0], inputs)
            with audit:
                call()
            found = ", ".join(f"{op} x{count} ({ratio}x q)" for (op, ratio), count in sorted(audit.seen.items()))
            print(f"{name:5s} {phase:8s} {found}", flush=True)


if __name__ == "__main__":
    main()
