"""Compile the Gluon forward kernels (``block_sparse/fwd_ws.py``, ``fwd_ws_fp8.py``, ``linear/mix_ws.py``) for sm_90
without a GPU and
report registers, spills, shared memory and the matrix instructions, as ``triton_sm90_report.py`` does for the
Triton kernels. Not a ``python -m flexsparse`` case: the runner times calls on a device, this reads the compiled
code of each kernel, offline.

Gluon kernels compile only through their launcher, so a stand-in driver names an sm_90 target and
``warmup`` compiles without launching (CPU tensors stand in for the arguments). Needs a triton whose Gluon API the
package uses (3.6 as on the GPU machine, or 3.7); a kernel that does not compile is reported as FAILED, the
others go on, and the exit status is 1.

    python benchmarks/gluon_sm90_report.py [--d 64 128] [--sass NAME] [--loops]
"""
from __future__ import annotations

import argparse
import sys

import torch
from triton.backends.compiler import GPUTarget
from triton.runtime import driver

from triton_sm90_report import report


class _Sm90Driver:
    """Just enough of a driver for ``JITFunction.warmup`` to compile for sm_90 on a machine without a GPU."""

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


def _descriptors(d: int, bm: int, rows: int):
    """TMA descriptors of q, k, v (``rows`` tokens) and of ``H_i``'s rows and ``W^T``, as the launchers build them."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from flexsparse.triton.linear.mix_ws import square_layout
    x = torch.zeros(rows, d, dtype=torch.bfloat16)
    tile = gl.NVMMASharedLayout.get_default_for([64, d], gl.bfloat16)
    q = TensorDescriptor.from_tensor(x, [bm, d], gl.NVMMASharedLayout.get_default_for([bm, d], gl.bfloat16))
    kv = TensorDescriptor.from_tensor(x, [64, d], tile)
    hw = TensorDescriptor.from_tensor(torch.zeros(4 * d, d, dtype=torch.bfloat16), [d, d],
                                      square_layout(d, gl.bfloat16))
    return q, kv, hw


def _fp8_descriptors(d: int, rows: int):
    """TMA descriptors of e4m3 q and k (``rows`` tokens, ``(64, D)`` tiles) and of V^T (``(D, 64)`` tiles), as
    ``fwd_ws_fp8.ws_block_attend_fp8`` builds them."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from flexsparse.triton.block_sparse.fwd_ws import shared_layout
    x = torch.zeros(rows, d, dtype=torch.float8_e4m3fn)
    tile = shared_layout(64, d, gl.float8e4nv)
    vt = torch.zeros(4 * d, rows, dtype=torch.float8_e4m3fn)
    return (TensorDescriptor.from_tensor(x, [64, d], tile), TensorDescriptor.from_tensor(x, [64, d], tile),
            TensorDescriptor.from_tensor(vt, [d, 64], shared_layout(d, 64, gl.float8e4nv)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--sass", default="")
    parser.add_argument("--loops", action="store_true", help="each loop's instructions by opcode")
    args = parser.parse_args()
    driver.set_active(_Sm90Driver())
    from flexsparse.triton.block_sparse import fwd_ws as block_fwd_ws
    from flexsparse.triton.block_sparse import fwd_ws_fp8 as block_fwd_ws_fp8
    from flexsparse.triton.linear import mix_ws, mix_ws_fp8
    ints = torch.zeros(64, dtype=torch.int32)
    flt = torch.zeros(64)
    low = torch.zeros(64, dtype=torch.bfloat16)
    failed = []
    for d in args.d:
        tiles = block_fwd_ws.default_tiles(d)
        q, kv, hw = _descriptors(d, tiles["bm"], 256)
        launch = dict(BLOCK_Q=64, BLOCK_K=64, Q_SPLIT=1, SCALE2=0.18, STAGES=tiles["stages"],
                      num_warps=tiles["bm"] // 16, maxnreg=tiles["maxnreg"], grid=(1, 1))
        jobs = [(f"ws fwd D={d}", lambda: block_fwd_ws._ws_fwd_kernel.warmup(q, kv, kv, low, flt, ints, 2, 1, 256,
                                                                              256, 4, 2, **launch))]
        jobs += [(f"ws mix D={d} MIX={mix} STORE={int(store)}",
                  lambda mix=mix, store=store: mix_ws._ws_mix_kernel.warmup(
                      q, kv, kv, hw, hw, low, flt, low, low, flt, low, low, ints, 2, 1, 256, 256, 4, 2, 0, EPS=1e-5,
                      FMAP=0, MIX=mix, STORE=store, **launch))
                 for mix, store in ((1, False), (1, True), (2, False), (2, True))]
        fp8_tiles = block_fwd_ws_fp8.default_tiles(d)
        q8, k8, vt8 = _fp8_descriptors(d, 256)
        fp8_launch = dict(BLOCK_Q=64, BLOCK_K=64, Q_SPLIT=1, SCALE=0.125, SCALE2=0.18, PERMUTED=True, num_warps=4,
                          grid=(1, 1))

        def fp8_fwd(**consts):
            return lambda: block_fwd_ws_fp8._ws_fwd_fp8_kernel.warmup(
                q8, k8, vt8, low, flt, ints, flt, flt, flt, flt, 2, 1, 256, 256, 4, 4, 2, **{**fp8_launch, **consts})

        def fp8_mix(**consts):
            return lambda: mix_ws_fp8._ws_mix_fp8_kernel.warmup(
                q8, k8, vt8, q, hw, hw, low, flt, low, low, flt, low, low, ints, flt, flt, flt, flt, 2, 1, 256, 256, 4,
                4, 2, 0, EPS=1e-5, FMAP=0, STAGES=mix_ws_fp8.ring_stages(d), maxnreg=mix_ws_fp8.registers(d),
                **{**fp8_launch, **consts})

        jobs += [(f"ws fwd fp8 D={d} FRESH_ACC={int(fresh)} DEFER={int(defer)} PERMUTED={int(permuted)}",
                  fp8_fwd(STAGES=fp8_tiles["stages"], FRESH_ACC=fresh, DEFER_RESCALE=defer, PERMUTED=permuted,
                          PAIRS=False, maxnreg=fp8_tiles["maxnreg"]))
                 for fresh, defer in ((True, False), (True, True), (False, False)) for permuted in (False, True)]
        jobs += [(f"ws fwd fp8 D={d} PAIRS=1 FRESH_ACC={int(fresh)} maxnreg={regs}",
                  fp8_fwd(STAGES=4, FRESH_ACC=fresh, DEFER_RESCALE=True, PAIRS=True, maxnreg=regs))
                 for regs in ((80, 96, 128, 168) if d <= 64 else (128, 168)) for fresh in (True, False)]
        jobs += [(f"ws mix fp8 D={d} MIX={mix} STORE={int(store)} PERMUTED={int(permuted)} PAIRS={int(pairs)}",
                  fp8_mix(MIX=mix, STORE=store, FRESH_ACC=not pairs, DEFER_RESCALE=permuted and not pairs,
                          PERMUTED=permuted, PAIRS=pairs))
                 for mix, store in ((1, False), (1, True), (2, False), (2, True))
                 for permuted, pairs in ((False, False), (True, False), (True, True))]
        for name, compile_kernel in jobs:
            try:
                report(name, compile_kernel(), args.sass == name, args.loops)
            except Exception as exc:  # report and go on, exit 1 at the end
                failed.append(name)
                print(f"{name:34s} FAILED: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    if failed:
        sys.exit(f"{len(failed)} kernels did not compile: {', '.join(failed)}")


if __name__ == "__main__":
    main()
