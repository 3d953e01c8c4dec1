"""Does every Triton kernel a call launches fit an H100/H200? Without a GPU: the methods' real host code runs on CPU
tensors, and each launch compiles its kernel for sm_90 instead of running it; the report lists shared memory
against the 227 KB an sm_90 block may take (a launch over it fails at run time with ``OutOfResources``) and the
bytes each thread spills. Not a ``python -m flexsparse`` case: the runner launches on a device, this compiles every
launch of many shapes offline.

    python benchmarks/sm90_fit.py [--dtypes bf16 fp16 fp32] [--dims 32 64 96 128] [--llsa 2 7]

The cases are LLSA (forward, backward; even and ragged N, block sizes 8 to 32, L = 1 to 3, top levels of up to 1024
tokens, GQA), the block-sparse kernels (forward, backward; block pairs 16 to 128) and whole methods (``sla``, ``sla2``,
``vsa``: their linear and coarse branches, routers and parameters). Best run with the GPU machine's
triton (3.6: ``pip install triton==3.6.0`` in a side venv, as for ``triton_sm90_report.py``); CI's triton 3.7
compiles them too (``tests/test_triton_llsa.py`` runs two cases). The output values are garbage, only the launches
and their constants are real. Exits with 1 where a launch does not fit.
"""
from __future__ import annotations

import argparse
import importlib
import itertools
import os
import pkgutil
import re
import sys

import torch
from triton.runtime import driver

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gluon_sm90_report import _Sm90Driver  # noqa: E402
from triton_sm90_report import cuobjdump  # noqa: E402

SMEM_LIMIT = 232448  # bytes of shared memory per block on sm_90 (227 KB)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class CompileOnly:
    """Stands in for a launch: ``kernel[grid](*args)`` compiles for sm_90 and records the kernel's resources."""

    seen: dict = {}
    records: list = []

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            compiled = self.kernel.warmup(*args, grid=grid, **kwargs)
            key = compiled.hash
            if key not in CompileOnly.seen:
                CompileOnly.seen[key] = (self.kernel.fn.__name__, compiled.metadata.shared, _stack_bytes(compiled))
            CompileOnly.records.append(CompileOnly.seen[key])
        return launch


def _stack_bytes(compiled) -> int:
    return int(re.search(r"STACK:(\d+)", cuobjdump(compiled, "--dump-resource-usage")).group(1))


def kernel_modules() -> list:
    """Every module of the op families (``flexsparse.triton.<family>.<module>``; not ``_runtime``), less the Gluon
    kernel modules where this triton's Gluon API cannot import them (the package then runs the Triton kernels)."""
    import flexsparse.triton as families
    modules = []
    for family in pkgutil.iter_modules(families.__path__):
        if family.ispkg and not family.name.startswith("_"):
            package = importlib.import_module(f"flexsparse.triton.{family.name}")
            for info in pkgutil.iter_modules(package.__path__):
                try:
                    modules.append(importlib.import_module(f"{package.__name__}.{info.name}"))
                except (ImportError, AttributeError):  # as flexsparse.triton.block_sparse.gluon
                    if not info.name.endswith("_ws"):
                        raise
    return modules


def _on_gpu_tiles():
    """The launches use the GPU's tiles and kernels although the tensors live on the CPU."""
    from flexsparse.backends import BACKENDS, Backend, triton_backend
    from flexsparse.triton.block_sparse import fwd as block_fwd
    cuda = torch.device("cuda")
    modules = kernel_modules()
    for module in (*modules, triton_backend):
        if hasattr(module, "use_kernels"):
            module.use_kernels = lambda *tensors: True
    block_fwd.gluon_runs = lambda *args, **kwargs: False      # Gluon kernels: gluon_sm90_report.py
    triton = BACKENDS["triton"]

    def block_topk(q_pooled, k_pooled, topk, bottomk=0, _kernels=triton.block_topk):
        """The selection kernels are compiled; the host code after them reads the PyTorch selection (the kernels'
        outputs are never written here, and a garbage index table fails the host code's own indexing)."""
        _kernels(q_pooled, k_pooled, topk, bottomk)
        return Backend.block_topk(triton, q_pooled, k_pooled, topk, bottomk)

    triton.block_topk = block_topk
    for module in modules:
        if hasattr(module, "launcher"):
            module.launcher = CompileOnly
        for tiles in ("forward_tiles", "backward_tiles", "linear_tiles"):  # each module's own (imported) reference
            if hasattr(module, tiles):
                setattr(module, tiles, lambda device, *rest, _f=getattr(module, tiles): _f(cuda, *rest))


def llsa_case(n, block, topk, heads, kv_heads, d, dtype):
    from flexsparse.backends import BACKENDS
    triton = BACKENDS["triton"]
    q = torch.randn(1, heads, n, d, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(1, kv_heads, n, d, dtype=dtype, requires_grad=True) for _ in range(2))
    o, lse = triton.llsa_attention(q, k, v, triton.llsa_select(q, k, v, block, tuple(topk)), d**-0.5)
    torch.autograd.grad((o.float().sum() + lse.sum()), (q, k, v))


def block_case(n, block_q, block_k, topk, heads, kv_heads, d, dtype):
    from flexsparse.backends import BACKENDS
    from flexsparse.masks import BlockSelection, num_blocks
    q = torch.randn(1, heads, n, d, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(1, kv_heads, n, d, dtype=dtype, requires_grad=True) for _ in range(2))
    tq, tk = num_blocks(n, block_q), num_blocks(n, block_k)
    ids = torch.rand(1, heads, tq, tk).argsort(-1)[..., :topk].sort(-1).values.to(torch.int32).contiguous()
    o, lse = BACKENDS["triton"].sparse_softmax(q, k, v, BlockSelection(ids, block_q, block_k, n, n), d**-0.5)
    torch.autograd.grad((o.float().sum() + lse.sum()), (q, k, v))


LLSA_CASES = ((4096, 16, (8, 8)), (4000, 16, (8, 8)), (4133, 8, (9, 4)), (8192, 32, (4, 2)), (5000, 16, (8, 8, 2)),
              (300, 16, (3,)), (16384, 16, (8,)), (19540, 32, (1,)),
              (131072, 16, (8, 8)))  # (N, block, topk); the last three: top levels of 1024, 611 and 512 tokens
BLOCK_PAIRS = ((64, 64), (128, 64), (16, 128), (128, 16), (32, 32))


def fit(cases) -> int:
    """Run ``(name, case function, arguments)`` cases with every launch compiled for sm_90 only; print each case's
    launches over the shared-memory limit or with spills; return how many cases have a launch over the limit."""
    driver.set_active(_Sm90Driver())
    _on_gpu_tiles()
    bad = 0
    for name, run, case in cases:
        CompileOnly.records = []
        try:
            run(*case)
        except Exception as exc:  # a diagnostic: report and go on
            print(f"{name}: FAILED {type(exc).__name__}: {str(exc)[:200]}")
            bad += 1
            continue
        worst = [r for r in CompileOnly.records if r[1] > SMEM_LIMIT or r[2] > 0]
        bad += any(r[1] > SMEM_LIMIT for r in worst)
        print(f"{name}: {len(CompileOnly.records)} launches" + "".join(
            f"\n    {kernel}: smem {smem}{' > limit' if smem > SMEM_LIMIT else ''}, stack {stack} B"
            for kernel, smem, stack in sorted(set(worst))), flush=True)
    print(f"{bad} case(s) with a launch that does not fit")
    return bad


def method_case(cfg, n, heads, kv_heads, d, dtype):
    """``flexsparse.attention`` forward and backward, the method's parameters included."""
    import flexsparse
    from flexsparse.config import Config
    q = torch.randn(1, heads, n, d, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(1, kv_heads, n, d, dtype=dtype, requires_grad=True) for _ in range(2))
    method = flexsparse.METHODS[cfg["method"]]
    params = {name: p.requires_grad_() for name, p in method.init_params(Config.from_dict(cfg), d, heads, n).items()}
    o = flexsparse.attention(q, k, v, cfg, backend="triton", params=params)
    torch.autograd.grad(o.float().sum(), (q, k, v, *params.values()), allow_unused=True)


CONFIGS = ({"method": "sla", "block_size": 64, "topk_ratio": 0.05}, {"method": "sla", "block_q": 128, "block_k": 64},
           {"method": "sla", "block_size": 32, "linear": "full"}, {"method": "sla2", "block_q": 128, "block_k": 64},
           {"method": "sla2", "block_size": 64, "topk_ratio": 0.2}, {"method": "vsa", "block_size": 64, "topk": 6},
           {"method": "vsa", "block_size": 16, "topk": 6})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--dims", type=int, nargs="+", default=[32, 64, 96, 128])
    parser.add_argument("--llsa", type=int, nargs="*", default=None,
                        help="only these LLSA cases (indices into LLSA_CASES), no block-sparse or method ones")
    args = parser.parse_args()
    cases = []
    for dt, d in itertools.product(args.dtypes, args.dims):
        dtype = DTYPES[dt]
        for i, (n, block, topk) in enumerate(LLSA_CASES):
            if args.llsa is None or i in args.llsa:
                cases.append((f"llsa {dt} D{d} N{n} b{block} K{list(topk)}", llsa_case,
                              (n, block, topk, 4, 2, d, dtype)))
        for block_q, block_k in BLOCK_PAIRS if args.llsa is None else ():
            cases.append((f"block {dt} D{d} {block_q}x{block_k}", block_case, (3000, block_q, block_k, 5, 4, 2, d,
                                                                                dtype)))
        for cfg in CONFIGS if args.llsa is None else ():
            cases.append((f"{dt} D{d} {cfg}", method_case, (cfg, 4000, 4, 2, d, dtype)))
    sys.exit(1 if fit(cases) else 0)


if __name__ == "__main__":
    main()
