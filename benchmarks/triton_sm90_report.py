"""Compile the LLSA, block-sparse, FP8 (SLA2's mixed one too), block top-K and masked linear kernels for sm_90
without a GPU and report registers, spills, shared memory and the matrix instructions in the SASS (HGMMA = Hopper
wgmma, QGMMA its fp8 form; HMMA = the older mma.sync path). Not a ``python -m flexsparse`` case: the runner times
calls on a device, this reads the compiled code of each kernel, offline.

Uses the ptxas/cuobjdump that ship with the triton wheel. ``python benchmarks/triton_sm90_report.py
[--d 64] [--dtype bf16] [--only NAME_PART] [--sass KERNEL] [--loops]``. Numbers come from this machine's triton,
which may differ from the GPU machine's by a version. ``--loops``: the instructions of each loop of each kernel by
opcode (``loop_mixes``; a key step of an attention kernel is its innermost loop's body).
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from flexsparse.triton._runtime.sizes import pow2
from flexsparse.triton.block_sparse import bwd as block_bwd
from flexsparse.triton.block_sparse import fp8_quant
from flexsparse.triton.block_sparse import fwd as block_fwd
from flexsparse.triton.block_sparse import fwd_fp8 as block_fwd_fp8
from flexsparse.triton.common import csc
from flexsparse.triton.linear import bwd as linear_bwd
from flexsparse.triton.linear import fwd as linear_fwd
from flexsparse.triton.linear import mix_fp8
from flexsparse.triton.llsa import bwd as llsa_bwd
from flexsparse.triton.llsa import entry_dkv as llsa_entry_dkv
from flexsparse.triton.llsa import fwd as llsa_fwd
from flexsparse.triton.pooling import pool
from flexsparse.triton.selection import block_topk
from flexsparse.triton.selection import hierarchy as select

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


# integer arguments that are multiples of 16 at run time (triton specialises those), beyond the strides ``q_b``...
DIVISIBLE = {"A_ROW", "M", "C_ROW"}


def compile_kernel(fn, pointers: dict, constexprs: dict, num_warps: int, num_stages: int):
    names = fn.arg_names
    sig = {n: "constexpr" if n in constexprs else pointers.get(n, "i32") for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names
             if (n in pointers and pointers[n].startswith("*")) or re.fullmatch(r"[a-z]+_[bhns]", n) or n in DIVISIBLE}
    return triton.compile(ASTSource(fn, sig, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))


def cuobjdump(kernel, flag: str) -> str:
    """``cuobjdump <flag>`` of a compiled kernel's cubin (``--dump-resource-usage``, ``-sass``)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([f"{BIN}/cuobjdump", flag, f.name], capture_output=True, text=True).stdout


def loop_mixes(code: str, least: int = 32) -> list[tuple[int, int, collections.Counter]]:
    """The loops of a SASS listing of at least ``least`` instructions: ``(start, end, opcodes)`` for each branch
    back to an earlier address, with the count of each opcode (its first two dot-separated parts, e.g.
    ``MUFU.EX2``) from the branch target to the branch. A span with an ``EXIT`` is no loop: the retry paths of
    barrier waits sit after the kernel's end and branch back into it."""
    code_lines = re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", code)
    listing = [(int(address, 16), text.split()) for address, text in code_lines]
    loops = []
    for address, words in listing:
        op = words[1] if words[0].startswith("@") else words[0]
        if not op.startswith("BRA") or not words[-1].startswith("0x") or int(words[-1], 16) >= address:
            continue
        start = int(words[-1], 16)
        body = [w[1] if w[0].startswith("@") else w[0] for a, w in listing if start <= a <= address]
        if len(body) >= least and "EXIT" not in body:
            loops.append((start, address, collections.Counter(".".join(o.split(".")[:2]) for o in body)))
    return loops


def report(name, kernel, sass: bool, loops: bool = False):
    usage, code = cuobjdump(kernel, "--dump-resource-usage"), cuobjdump(kernel, "-sass")
    regs = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", usage)
    mma = {}
    for op in re.findall(r"\b(HGMMA\.[\w.]+|QGMMA\.[\w.]+|HMMA\.[\w.]+|LDL|STL)\b", code):
        mma[op] = mma.get(op, 0) + 1
    print(f"{name:34s} regs {regs.group(1):>4s} stack {regs.group(2):>4s} local {regs.group(4):>4s} "
          f"smem {kernel.metadata.shared:>6d}  {mma}")
    if loops:
        for start, end, ops in loop_mixes(code):
            print(f"    loop {start:#06x}-{end:#06x}: {sum(ops.values())} instructions: "
                  + ", ".join(f"{op} {count}" for op, count in ops.most_common(14)))
    if sass:
        print(code)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--d", type=int, default=64)
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--sass", default="")
    parser.add_argument("--loops", action="store_true", help="each loop's instructions by opcode")
    parser.add_argument("--only", default="", help="compile only the jobs whose name contains this text")
    parser.add_argument("--blocks", default="64x64", help="block_q x block_k of the block-sparse kernels "
                        "(tiles from FLEXSPARSE_TRITON_TILES as at run time)")
    args = parser.parse_args()
    import torch
    dev = torch.device("cuda")
    d, dt, block = args.d, args.dtype, 16
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dt]
    common = dict(D=d, BD=pow2(d, 16), SCALE2=0.18, IEEE=dt == "fp32")
    ft = llsa_fwd.forward_tiles(dev, d, torch_dtype)
    bt = llsa_bwd.backward_tiles(dev, d, block, torch_dtype)
    q = f"*{dt}"
    top_search, top_split = select.row_search(True, 256, 8, {})
    child_search, child_split = select.row_search(False, 128, 8, {})
    jobs = [
        ("pool", pool._pool_kernel, dict(SRC=q, SUMS="*fp32", MEANS="*fp32", LOW=q),
         dict(D=d, BD=pow2(d), BLOCK=block, TT=16, STEP=16, FROM_SUMS=False, UP=True, KEEP_SUMS=False, HAS_LOW=True),
         pool.first_pass_warps(16, pow2(d), False), 1),
        ("pool q, k, v", pool._pool_qkv_kernel,
         dict(Q=q, K=q, V=q, SQ="*fp32", SK="*fp32", SV="*fp32", QM="*fp32", KM="*fp32", KL=q, VL=q),
         dict(D=d, BD=pow2(d), BLOCK=block, TT=16, STEP=16, UP=True, KEEP_SUMS=False),
         pool.first_pass_warps(16, pow2(d), False), 1),
        ("select(children)", select._select_children_kernel, dict(QP="*fp32", KP="*fp32", SEL="*i32", META="*i32"),
         dict(D=d, BD=pow2(d, 16), BLOCK=block, BQ=16, BC=128, KSEL=8, W=select.CHILD_PARENTS, SPLIT=child_split,
              DC=select.HEAD_CHUNK, SCAN=True, SEARCH=child_search, KSEL2=8, LOW=7,
              BUCKET=child_search == select.SEARCH_PACKED, SLOTS=8),
         select.CHILD_PARENTS * child_split, 1),
        ("select(top)", select._select_top_kernel, dict(QP="*fp32", KP="*fp32", SEL="*i32", META="*i32"),
         dict(D=d, BD=pow2(d, 16), BQ=16, BC=256, KSEL=8, SCAN=True, SEARCH=top_search, KSEL2=8,
              PRECISION="tf32x3", SPLIT=top_split, DC=select.HEAD_CHUNK), top_split, 1),
        ("csc count", csc._count_kernel, dict(SEL="*i32", COUNTS="*i32"), dict(BE=1024), 4, 1),
        ("coarse fwd", llsa_fwd._coarse_fwd_kernel,
         dict(Q=q, KC=q, VC=q, LIST="*i32", LOG2C="*fp32", O=q, LSE="*fp32"),
         dict(BLOCK=block, TB=ft["BM"] // block, N_SPARSE=128, BM=ft["BM"], BN=ft["BN"], EVEN=True,
              STAGES=ft["stages"], **common), ft["warps"], ft["stages"]),
        ("fused fwd", llsa_fwd._fused_fwd_kernel,
         dict(Q=q, K=q, V=q, KC=q, VC=q, LIST="*i32", LOG2C="*fp32", SEL="*i32", META="*i32", O=q, LSE="*fp32"),
         dict(BLOCK=block, TB=ft["fused_BM"] // block, N_SPARSE=128, BM=ft["fused_BM"], BN=ft["BN"], EVEN=True,
              STAGES=ft["hoist_stages"], WN=ft["WN"], KEYS=128, W_STAGES=ft["w_stages"], KV_ROWS=True, HOIST=True,
              RUNS=8, TOPK1P=8, **common), ft["fused_warps"], ft["hoist_stages"]),
    ]
    for levels, listed in ((2, 128), (3, 256)):  # keys listed per ancestor at K = 8: the loop's length differs
        hoist = listed // block <= llsa_fwd.HOIST_RUNS  # L=2 hoists its key rows, L=3 does not
        stages = bt["hoist_stages"] if hoist else bt["stages"]
        jobs.append((f"coarse dq (L={levels})", llsa_bwd._coarse_dq_kernel,
                     dict(Q=q, KC=q, VC=q, LIST="*i32", LOG2C="*fp32", O=q, DO=q, LSE="*fp32", DLSE="*fp32",
                          DELTA="*fp32", DQ=q),
                     dict(BLOCK=block, TB=bt["BM"] // block, N_SPARSE=listed, SCALE=0.125, BM=bt["BM"], BN=bt["BN"],
                          EVEN=True, STAGES=stages, HAS_DLSE=True, HOIST=hoist, RUNS=listed // block, **common),
                     bt["warps"], stages))
    jobs += [
        ("fused dq", llsa_bwd._fused_dq_kernel,
         dict(Q=q, K=q, V=q, KC=q, VC=q, LIST="*i32", LOG2C="*fp32", SEL="*i32", META="*i32", O=q, DO=q,
              LSE="*fp32", DLSE="*fp32", DELTA="*fp32", DQ=q),
         dict(BLOCK=block, TB=bt["fused_BM"] // block, N_SPARSE=128, SCALE=0.125, BM=bt["fused_BM"], BN=bt["BN"],
              EVEN=True, STAGES=bt["hoist_stages"], WN=bt["fused_WN"], KEYS=128, W_STAGES=bt["w_stages"], HAS_DLSE=True,
              HOIST=True, RUNS=8, TOPK1P=8, **common), bt["fused_warps"], bt["hoist_stages"]),
        ("fine dq", llsa_bwd._fine_dq_kernel,
         dict(Q=q, K=q, V=q, SEL="*i32", META="*i32", DO=q, LSE="*fp32", DELTA="*fp32", DQ=q),
         dict(BLOCK=block, SCALE=0.125, W=bt["W"], WN=bt["WN"], WSUB=bt["WSUB"], KEYS=128,
              STAGES=bt["fine_hoist_stages"], FULL=True, HOIST=True, TOPK1P=8, **common), bt["W"], 1),
    ]
    dkv_ptrs = dict(Q=q, K=q, V=q, KC=q, VC=q, DO=q, LSE="*fp32", DELTA="*fp32", OFFSETS="*i32",
                    ROWS="*i32", META="*i32", DK=q, DV=q, DKC="*fp32", DVC="*fp32", PART_K="*fp32", PART_V="*fp32")
    for fine in (True, False):  # the per-parent kernel: coarse levels, and level 0 of the ragged path
        jobs.append((f"sparse dkv ({'fine' if fine else 'coarse'})", llsa_bwd._sparse_dkv_kernel, dkv_ptrs,
                     dict(BLOCK=block, BK=16, SCALE=0.125, QR=bt["QR_FINE"] if fine else bt["QR"], FINE=fine,
                          ENTRY_MAJOR=not fine, FUSE_POOL=fine, **common), bt["dkv_warps"],
                     bt["stages"] if fine else bt["dkv_coarse_stages"]))
    jobs.append(("fine dkv (batched)", llsa_bwd._fine_dkv_kernel,
                 dict(Q=q, K=q, V=q, DO=q, LSE="*fp32", DELTA="*fp32", OFFSETS="*i32", ROWS="*i32", META="*i32",
                      DKC="*fp32", DVC="*fp32", DK=q, DV=q),
                 dict(BLOCK=block, SCALE=0.125, W=bt["dkv_W"], SLOTS=bt["dkv_slots"], STAGES=bt["dkv_stages"],
                      FUSE_POOL=True, **common), bt["dkv_W"], bt["dkv_stages"]))
    jobs.append(("top dkv", llsa_bwd._top_dkv_kernel,
                 dict(Q=q, KC=q, VC=q, DO=q, LSE="*fp32", DELTA="*fp32", META="*i32", PART_K="*fp32",
                      PART_V="*fp32"),
                 dict(TK=bt["TK"], SCALE=0.125, QR=bt["TOP_QR"], **common), bt["top_warps"], bt["top_stages"]))
    jobs.append(("entry dkv", llsa_entry_dkv._entry_dkv_kernel,
                 dict(Q=q, KC=q, VC=q, DO=q, LSE="*fp32", DELTA="*fp32", SEL="*i32", META="*i32", PART_K="*fp32",
                      PART_V="*fp32"),
                 dict(BLOCK=block, TK=bt["entry_TK"], QR=bt["entry_QR"], SCALE=0.125, **common), bt["entry_warps"],
                 bt["entry_stages"]))
    jobs.append(("entry sum", llsa_entry_dkv._entry_sum_kernel,
                 dict(SEL="*i32", OFFSETS="*i32", ROWS="*i32", META="*i32", PART_K="*fp32", PART_V="*fp32",
                      DKC="*fp32", DVC="*fp32"),
                 dict(D=d, BD=pow2(d, 16), BLOCK=block, BK=16, KP2=8), 1, 1))
    block_q, block_k = (int(x) for x in args.blocks.split("x"))
    bf, bb = block_fwd.forward_tiles(dev, d, torch_dtype), block_bwd.backward_tiles(dev, d, torch_dtype)
    even = dict(D=d, BD=pow2(d, 16), SCALE2=0.18, IEEE=dt == "fp32")
    geo = block_fwd.geometry(block_q, block_k, 1 << 16, 1 << 16, bf["BM"], bf["BN"], 50, k_group=bf["KB"])
    jobs.append(("block fwd", block_fwd._block_fwd_kernel, dict(Q=q, K=q, V=q, IDX="*i32", O=q, LSE="*fp32"),
                 dict(STAGES=bf["stages"], **geo, **even), bf["warps"] or (4 if geo["BM"] <= 64 else 8), bf["stages"]))
    geo = block_fwd.geometry(block_q, block_k, 1 << 16, 1 << 16, bb["DQ_BM"], bb["DQ_BN"], 50, k_group=bb["DQ_KB"])
    jobs.append(("block dq", block_bwd._block_dq_kernel,
                 dict(Q=q, K=q, V=q, IDX="*i32", O=q, DO=q, LSE="*fp32", DLSE="*fp32", DELTA="*fp32", DQ=q),
                 dict(SCALE=0.125, HAS_DLSE=True, STAGES=bb["dq_stages"], **geo, **even), bb["dq_warps"],
                 bb["dq_stages"]))
    geo = block_fwd.geometry(block_q, block_k, 1 << 16, 1 << 16, bb["DKV_BM"], bb["DKV_BN"], 50,
                             q_group=bb["DKV_QB"])
    jobs.append(("block dkv", block_bwd._block_dkv_kernel,
                 dict(Q=q, K=q, V=q, DO=q, LSE="*fp32", DELTA="*fp32", OFFSETS="*i32", ROWS="*i32", ORDER="*i32",
                      DK=q, DV=q),
                 dict(SCALE=0.125, STAGES=bb["dkv_stages"], **geo, **even), bb["dkv_warps"], bb["dkv_stages"]))
    lt = linear_fwd.linear_tiles(dev, d, torch_dtype)
    state = "*bf16" if dt == "bf16" else "*fp32"
    lin = dict(D=d, BD=pow2(d, 16), FMAP=0, BF16=dt == "bf16", GATHER=True)
    tile_q, split_q = linear_fwd.split(block_q, lt["TQ"])
    tile_k, split_k = linear_fwd.split(block_k, lt["TK"])
    jobs += [
        ("linear states", linear_fwd._states_kernel, dict(K=q, V=q, HS=state, ZS=state),
         dict(BLOCK_K=block_k, TILE=tile_k, SPLIT=split_k, **{n: lin[n] for n in ("D", "BD", "FMAP", "BF16")}),
         lt["warps"], 1),
        ("linear fwd", linear_fwd._forward_kernel,
         dict(Q=q, HS=state, ZS=state, HT="*fp32", ZT="*fp32", IDS="*i32", O=q, ROWS_H=state, ROWS_Z="*fp32", OS=q,
              OL=q, W=q, BIAS=q, LOGIT=q),
         dict(EPS=1e-6, BLOCK_Q=block_q, TILE=tile_q, SPLIT=split_q, STAGES=lt["stages"], MIX=1, STORE_LINEAR=True,
              **{**lin, "GATHER": False}),
         lt["warps"], lt["stages"]),
        *[(f"linear dq{' (O saved)' if saved else ''}{' (W)' if proj else ''}{' per tile' if parts > 1 else ''}",
           linear_bwd._query_grad_kernel,
           dict(Q=q, DO=q, W="*fp32", ROWS_H=state, ROWS_Z="*fp32", OL=q, DQ_ADD=q, DQ=q, DHQ=state, DZQ=state),
           dict(EPS=1e-6, BLOCK_Q=block_q, TILE=tile_q, SPLIT=split_q, ADD=True, SAVED=saved, PROJ=proj,
                PARTS=parts, **{n: lin[n] for n in ("D", "BD", "FMAP", "BF16")}),
           lt["warps"], 3) for saved, proj, parts in ((False, False, 1), (True, False, 1), (True, True, 1),
                                                      (True, False, split_q), (True, True, split_q))
          if parts == 1 or split_q > 1],
        ("linear dkv", linear_bwd._key_grad_kernel,
         dict(K=q, V=q, DHQ=state, DZQ=state, DHT="*fp32", DZT="*fp32", OFFSETS="*i32", LISTS="*i32", DK_ADD=q,
              DV_ADD=q, DK=q, DV=q),
         dict(BLOCK_K=block_k, TILE=tile_k, SPLIT=split_k, STAGES=lt["stages"], ADD=True, **lin), lt["warps"],
         lt["stages"]),
    ]
    topk = block_topk.topk_tiles(1024)
    jobs.append(("topk scores", block_topk._scores_kernel, dict(Q=q, K=q, S="*fp32"),
                 dict(D=d, BK=topk["BK"], BM=topk["BM"], BN=topk["BN"]), topk["WARPS"], topk["STAGES"]))
    for tk in (64, 256):
        tiles = block_topk.topk_tiles(tk)
        if pow2(tk, 16) * pow2(d, 16) <= tiles["FUSED_TILE"]:
            jobs.append((f"topk scored select Tk={tk}", block_topk._scored_select_kernel,
                         dict(Q=q, K=q, TOP="*i32", BOTTOM="*i32"),
                         dict(D=d, BK=min(tiles["BK"], pow2(d, 16)), BM=tiles["FUSED_ROWS"], BT=pow2(tk, 16),
                              HAS_BOTTOM=True), tiles["FUSED_WARPS"], 1))
    for tk in (256, 1024, 2048, 8192, 16384):
        jobs.append((f"topk select Tk={tk}", block_topk._select_kernel, dict(S="*fp32", TOP="*i32", BOTTOM="*i32"),
                     dict(BT=pow2(tk, 16), HAS_BOTTOM=True), block_topk.topk_tiles(tk)["SELECT_WARPS"], 1))
    ff = block_fwd_fp8.forward_tiles(dev, d)
    geo = block_fwd_fp8.fp8_geometry(block_q, block_k, 1 << 16, 1 << 16, ff, 50, False)
    f8 = "*fp8e4nv"
    pointers = dict(X=q, MEAN="*fp32", OUT=f8, SCALE="*fp32", V=q, V_AMAX="*fp32", SUMS="*fp32", MEANS="*fp32")
    for name, block, flags in (("fp8 quant K blocks", block_k, dict(SMOOTH=True, HAS_V=True)),
                               ("fp8 pool quant Q", block_q, dict(HAS_MEANS=True)),
                               ("fp8 pool quant K", block_k, dict(HAS_V=True, HAS_MEANS=True, HAS_SUMS=True)),
                               ("fp8 pool K", block_k, dict(HAS_MEANS=True, HAS_SUMS=True, QUANT=False))):
        flags = dict(dict(SMOOTH=False, HAS_V=False, HAS_MEANS=False, HAS_SUMS=False, QUANT=True), **flags)
        jobs.append((name, fp8_quant._quant_blocks_kernel, pointers,
                     dict(BLOCK=block, BB=pow2(block, 16), D=d, BD=pow2(d, 16), EMULATE=False, **flags),
                     fp8_quant.block_warps(pow2(block, 16) * pow2(d, 16), flags["HAS_V"]), 1))
    jobs.append(("fp8 quant v", fp8_quant._quant_v_kernel, dict(V=q, SCALE="*fp32", OUT=f8),
                 dict(TILE=64, D=d, BD=pow2(d, 16), EMULATE=False), 8 if 64 * pow2(d, 16) >= 8192 else 4, 1))
    for permuted, ready in ((False, False), (True, False), (True, True)):
        jobs.append((f"block fwd fp8 PERMUTED={int(permuted)} Q_READY={int(ready)}",
                     block_fwd_fp8._block_fwd_fp8_kernel,
                     dict(Q=q, Q8=f8, QS="*fp32", K8=f8, VT8=f8, KD="*fp32", VS="*fp32", KMEAN="*fp32", IDX="*i32",
                          O=q, LSE="*fp32"),
                     dict(D=d, BD=pow2(d, 32), SCALE=0.125, SCALE2=0.18, STAGES=ff["stages"],
                          FRESH_ACC=ff["fresh_acc"], EMULATE=False, PERMUTED=permuted, Q_READY=ready, **geo),
                     ff["warps"] or (4 if geo["BM"] <= 64 else 8), ff["stages"]))
    for store, ready in ((False, False), (True, False), (True, True)):
        jobs.append((f"sparse linear mix fp8 STORE={int(store)} Q_READY={int(ready)}", mix_fp8._mix_fp8_kernel,
                     dict(Q=q, Q8=f8, QS="*fp32", K8=f8, VT8=f8, KD="*fp32", VS="*fp32", KMEAN="*fp32", IDX="*i32",
                          O=q, LSE="*fp32", OS=q, OL=q, ROWS_H=state, ROWS_Z="*fp32", LOGIT="*fp32"),
                     dict(D=d, BD=pow2(d, 32), SCALE=0.125, SCALE2=0.18, STAGES=ff["stages"],
                          FRESH_ACC=ff["fresh_acc"], EMULATE=False, PERMUTED=True, EPS=1e-6, FMAP=0,
                          BF16=dt == "bf16", STORE=store, Q_READY=ready, **geo),
                     ff["warps"] or (4 if geo["BM"] <= 64 else 8), ff["stages"]))
    for name, fn, ptrs, consts, warps, stages in jobs:
        if args.only not in name:
            continue
        try:
            report(name, compile_kernel(fn, ptrs, consts, warps, stages), args.sass == name, args.loops)
        except Exception as exc:  # report and go on: this is a diagnostic tool
            print(f"{name:34s} FAILED: {type(exc).__name__}: {str(exc)[:300]}")


if __name__ == "__main__":
    main()
