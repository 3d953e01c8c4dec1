"""GPU benchmark of the block-sparse branch on ``backend="triton"`` (methods ``sla``, ``sla2``, ``topk``) against
``backend="flex"`` and dense SDPA (cuDNN and flash) in the same run.

Parts (``--parts``, comma-separated; each is optional so a run fits in a few minutes):

``methods``  ``flexsparse.SparseAttention`` end to end (selection and linear branch included) at B=2 H=8 D=64
             N=65536, 64x64 blocks: sla 95 %, sla2 95 % and 97 %, topk K = 51 (95 %); dense SDPA;
             with ``--profile`` the kernel times of one forward and one forward+backward per case.
``sparse``   the sparse branch alone (``block_sparse_attention`` on a fixed top-K selection, K = 51) at
             that shape: triton vs flex, TFLOP/s, and the triton kernels from the profiler.
``shape2``   the public SLA benchmark shape B=2 H=16 N=32760 D=128 (95 %): sla and the sparse branch, dense SDPA.
``paper_blocks``  128-row query blocks and 64-token key blocks, the block sizes of the public SLA benchmark
             (BLKQ 128, BLKK 64) and SLA2's defaults (b_q 128, b_kv 64): sla2 95 % / 97 % and sla 95 % at the
             first shape, sla 95 % and the sparse branch at the public shape.
``scaling``  triton sparse-branch backward (fwd+bwd minus fwd) at N = 16K, 32K, 64K, 128K with a fixed K
             (``--scaling-k``), plus the dQ / dK/dV / CSC kernel times: linear in N at fixed K.
``sweep``    tile sweep of the triton sparse branch at the first shape (``FLEXSPARSE_TRITON_TILES``).

    python benchmarks/gpu_sla.py out.json [--parts methods,sparse,shape2,scaling] [--tiles JSON] [--sweep-size small]

Times are ``triton.testing.do_bench`` medians in ms (bf16). ``--tiles`` sets ``FLEXSPARSE_TRITON_TILES`` for
the whole run, e.g. ``'{"block_fwd": {"stages": 4}, "block_bwd": {"dkv_warps": 8}}'``. Failures of one case
(e.g. out of memory) are recorded in the JSON and the run goes on.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import platform
import time

import torch
import torch.nn.functional as F
import triton
from tabulate import tabulate
from torch.nn.attention import SDPBackend, sdpa_kernel

import flexsparse
from flexsparse.backends import flex, triton_sparse
from flexsparse.config import Config
from flexsparse.methods._blocks import select_blocks
from gpu_llsa import bench, kernel_times

BLOCK = 64


def sparse_flops(bsz: int, heads: int, n: int, d: int, keys: int) -> float:
    """Forward matmul FLOPs of the sparse branch with ``keys`` keys per query (QK^T and PV)."""
    return 4.0 * bsz * heads * n * keys * d


def make_qkv(bsz: int, heads: int, n: int, d: int):
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, grad = (torch.randn(bsz, heads, n, d, device="cuda", dtype=torch.bfloat16, generator=gen)
                     for _ in range(4))
    return q, k, v, grad


def time_pair(attend, q, k, v, grad, extra=()) -> dict:
    """Median ms of ``attend(q, k, v)`` without grad and of its forward+backward (grads of q, k, v and
    of ``extra``); errors (e.g. out of memory) are returned instead."""
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]

    def fwd():
        with torch.no_grad():
            attend(q, k, v)

    def fwd_bwd():
        torch.autograd.grad(attend(*leaves), leaves + list(extra), grad, allow_unused=True)

    try:
        out = {"fwd_ms": bench(fwd), "fwd_bwd_ms": bench(fwd_bwd)}
        out["bwd_ms"] = out["fwd_bwd_ms"] - out["fwd_ms"]
    except Exception as exc:  # a benchmark: record and go on
        out = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    torch.cuda.empty_cache()
    return out


def dense_rows(shape: str, q, k, v, grad) -> list[dict]:
    rows = []
    for name, kernel in (("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa_flash", SDPBackend.FLASH_ATTENTION)):
        def attend(q, k, v, kernel=kernel):
            with sdpa_kernel(kernel):
                return F.scaled_dot_product_attention(q, k, v)
        rows.append({"part": shape, "case": name, "backend": "dense", **time_pair(attend, q, k, v, grad)})
        print(rows[-1], flush=True)
    return rows


def method_kernels(module, q, k, v, grad, extra) -> tuple[dict, dict]:
    """Kernel times (ms per call) of one forward without grad and of one forward+backward of ``module``."""
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]

    def fwd():
        with torch.no_grad():
            module(q, k, v)

    return kernel_times(fwd), kernel_times(lambda: torch.autograd.grad(module(*leaves), leaves + extra, grad,
                                                                      allow_unused=True))


def method_rows(shape: str, cases: dict, backends: list[str], q, k, v, grad, profile: bool = False) -> list[dict]:
    bsz, heads, n, d = q.shape
    rows = []
    for name, config in cases.items():
        for backend in backends:
            module = flexsparse.SparseAttention(config, head_dim=d, num_heads=heads, seq_len=n, backend=backend)
            module = module.to(q.device)
            extra = [p for p in module.parameters() if p.requires_grad]
            row = {"part": shape, "case": name, "backend": backend, "config": config,
                   **time_pair(module, q, k, v, grad, extra)}
            if profile and "fwd_ms" in row:
                row["kernels_fwd_ms"], row["kernels_fwd_bwd_ms"] = method_kernels(module, q, k, v, grad, extra)
            rows.append(row)
            print(row, flush=True)
    return rows


def sparse_rows(shape: str, backends: list[str], q, k, v, grad, topk: int, block_q: int = BLOCK,
                block_k: int = BLOCK, profile: bool = True, case: str | None = None) -> list[dict]:
    """The sparse branch alone on one fixed selection (top-K of pooled raw dots)."""
    bsz, heads, n, d = q.shape
    cfg = Config.from_dict({"method": "topk", "block_q": block_q, "block_k": block_k, "topk": topk})
    selection = select_blocks(q, k, cfg)
    scale = d**-0.5
    flops = sparse_flops(bsz, heads, n, d, topk * block_k)
    attends = {"triton": lambda q, k, v: triton_sparse.block_sparse_attention(q, k, v, selection, scale)[0],
               "flex": lambda q, k, v: flex.block_sparse_attention(q, k, v, selection, scale)[0]}
    rows = []
    for backend in backends:
        row = {"part": shape, "case": case or f"sparse K={topk}", "backend": backend, "N": n,
               **time_pair(attends[backend], q, k, v, grad)}
        if "fwd_ms" in row:
            row["fwd_tflops"] = flops / row["fwd_ms"] / 1e9
            row["bwd_tflops"] = 2.5 * flops / row["bwd_ms"] / 1e9
        if profile and backend == "triton" and "fwd_ms" in row:
            leaves = [x.detach().requires_grad_() for x in (q, k, v)]
            row["kernels_fwd_bwd_ms"] = kernel_times(
                lambda: torch.autograd.grad(attends["triton"](*leaves), leaves, grad))
        rows.append(row)
        print({key: value for key, value in row.items() if key != "kernels_fwd_bwd_ms"}, flush=True)
    return rows


def paper_block_rows(backends: list[str], profile: bool) -> list[dict]:
    """``paper_blocks``: the methods on 128x64 blocks at both shapes (sparsities as in ``methods`` / ``shape2``)."""
    blocks = {"block_q": 128, "block_k": BLOCK}
    q, k, v, grad = make_qkv(2, 8, 65536, 64)
    cases = {"sla2 128x64": {"method": "sla2", **blocks, "topk_ratio": 0.05},
             "sla2 97% 128x64": {"method": "sla2", **blocks, "topk_ratio": 0.03},
             "sla 128x64": {"method": "sla", **blocks, "topk_ratio": 0.05}}
    rows = method_rows("B2 H8 N65536 D64", cases, backends, q, k, v, grad, profile)
    del q, k, v, grad
    q, k, v, grad = make_qkv(2, 16, 32760, 128)
    shape = "B2 H16 N32760 D128"
    rows += method_rows(shape, {"sla 128x64": {"method": "sla", **blocks, "topk_ratio": 0.05}}, backends, q, k, v,
                        grad, profile)
    rows += sparse_rows(shape, backends, q, k, v, grad, int(0.05 * math.ceil(32760 / BLOCK)), block_q=128,
                        case="sparse 128x64 K=25")
    return rows


def sweep_rows(q, k, v, grad, topk: int, size: str) -> list[dict]:
    """Forward and backward tile configurations of the triton sparse branch, one at a time."""
    product = itertools.product
    if size == "small":
        fwd = [{"stages": s, "KB": kb, "warps": w} for s, kb, w in product((2, 3, 4), (1, 2), (4, 8))]
        bwd = ([{"dq_stages": s, "DQ_KB": kb, "dq_warps": w} for s, kb, w in product((2, 3), (1, 2), (4, 8))]
               + [{"dkv_stages": s, "DKV_QB": qb, "dkv_warps": w} for s, qb, w in product((1, 2, 3), (1, 2), (4, 8))])
    else:
        fwd = [{"stages": s, "KB": kb, "warps": w, "BM": bm} for s, kb, w, bm in
               product((2, 3, 4, 5), (1, 2, 4), (4, 8), (32, 64))]
        bwd = ([{"dq_stages": s, "DQ_KB": kb, "dq_warps": w, "DQ_BM": bm} for s, kb, w, bm in
                product((2, 3, 4), (1, 2), (4, 8), (32, 64))]
               + [{"dkv_stages": s, "DKV_QB": qb, "dkv_warps": w, "DKV_BM": bm, "DKV_BN": bn} for s, qb, w, bm, bn in
                  product((1, 2, 3), (1, 2), (4, 8), (32, 64), (32, 64))])
    rows = []
    saved = os.environ.get("FLEXSPARSE_TRITON_TILES")
    try:
        for kind, options in [("block_fwd", o) for o in fwd] + [("block_bwd", o) for o in bwd]:
            os.environ["FLEXSPARSE_TRITON_TILES"] = json.dumps({kind: options})
            rows += sparse_rows("sweep", ["triton"], q, k, v, grad, topk, profile=False,
                                case=f"{kind} {json.dumps(options)}")
    finally:
        if saved is None:
            os.environ.pop("FLEXSPARSE_TRITON_TILES", None)
        else:
            os.environ["FLEXSPARSE_TRITON_TILES"] = saved
    for kind, key in (("block_fwd", "fwd_ms"), ("block_bwd", "bwd_ms")):
        timed = [row for row in rows if row["case"].startswith(kind) and key in row]
        if timed:
            best = min(timed, key=lambda row: row[key])
            print(f"best {kind}: {best['case']} {key}={best[key]:.3f}", flush=True)
    return rows


def print_table(rows: list[dict]) -> None:
    keys = ["part", "case", "backend", "N", "fwd_ms", "fwd_bwd_ms", "bwd_ms", "fwd_tflops", "bwd_tflops", "error"]
    table = [[row.get(key, "") for key in keys] for row in rows]
    print(tabulate(table, headers=keys, floatfmt=".3f"))
    for row in rows:
        for key in ("kernels_fwd_ms", "kernels_fwd_bwd_ms"):
            if key in row:
                print(f"\n{key}: {row['part']} {row['case']} {row['backend']} (ms, sum "
                      f"{sum(row[key].values()):.3f}):")
                print(tabulate(list(row[key].items())[:14], floatfmt=".3f"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="path of the JSON results")
    parser.add_argument("--parts", default="methods,sparse,shape2,scaling")
    parser.add_argument("--backends", default="triton,flex")
    parser.add_argument("--tiles", default="", help="FLEXSPARSE_TRITON_TILES for the whole run")
    parser.add_argument("--scaling-n", default="16384,32768,65536,131072")
    parser.add_argument("--scaling-k", type=int, default=51, help="key blocks per query block in 'scaling'")
    parser.add_argument("--sweep-size", choices=("small", "large"), default="small")
    parser.add_argument("--profile", action="store_true", help="kernel times of each method case ('methods', 'shape2')")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_sla.py needs a CUDA GPU")
    if args.tiles:
        os.environ["FLEXSPARSE_TRITON_TILES"] = args.tiles
    parts, backends = args.parts.split(","), args.backends.split(",")
    rows, start = [], time.time()

    if {"methods", "sparse", "sweep"} & set(parts):
        q, k, v, grad = make_qkv(2, 8, 65536, 64)
        topk = int(0.05 * math.ceil(65536 / BLOCK))
        if "methods" in parts:
            cases = {"sla": {"method": "sla", "block_size": BLOCK, "topk_ratio": 0.05},
                     "sla2": {"method": "sla2", "block_size": BLOCK, "topk_ratio": 0.05},
                     "sla2 97%": {"method": "sla2", "block_size": BLOCK, "topk_ratio": 0.03},
                     "topk": {"method": "topk", "block_size": BLOCK, "topk": topk}}
            rows += method_rows("B2 H8 N65536 D64", cases, backends, q, k, v, grad, args.profile)
            rows += dense_rows("B2 H8 N65536 D64", q, k, v, grad)
        if "sparse" in parts:
            rows += sparse_rows("B2 H8 N65536 D64", backends, q, k, v, grad, topk)
        if "sweep" in parts:
            rows += sweep_rows(q, k, v, grad, topk, args.sweep_size)
        del q, k, v, grad

    if "shape2" in parts:
        q, k, v, grad = make_qkv(2, 16, 32760, 128)
        shape = "B2 H16 N32760 D128"
        rows += method_rows(shape, {"sla": {"method": "sla", "block_size": BLOCK, "topk_ratio": 0.05}}, backends,
                            q, k, v, grad, args.profile)
        rows += sparse_rows(shape, backends, q, k, v, grad, int(0.05 * math.ceil(32760 / BLOCK)))
        rows += dense_rows(shape, q, k, v, grad)
        del q, k, v, grad

    if "paper_blocks" in parts:
        rows += paper_block_rows(backends, args.profile)

    if "scaling" in parts:
        for n in (int(x) for x in args.scaling_n.split(",")):
            q, k, v, grad = make_qkv(2, 8, n, 64)
            rows += sparse_rows(f"scaling K={args.scaling_k}", ["triton"], q, k, v, grad, args.scaling_k)
            del q, k, v, grad
            torch.cuda.empty_cache()

    print_table(rows)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "python": platform.python_version(), "tiles": os.environ.get("FLEXSPARSE_TRITON_TILES"),
            "wall_s": time.time() - start}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
