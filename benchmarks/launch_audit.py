"""How many launches one eager call issues on the ``triton`` backend, and from where (CPU, no GPU needed). Not a
``python -m flexsparse`` case: the runner times calls, this counts what a call asks of the host.

At small N an eager call is bound by host time, and every Triton launch and every ATen op that runs a kernel costs
some (``gpu_host_time.py`` measures it on a GPU). This runs each method's forward (no grad) and forward+backward on
CPU tensors with ``TRITON_INTERPRET=1`` and every Triton launch stubbed out (``allocation_audit.stub_launches``),
and counts, after a warm-up call, the Triton launches by kernel and the ATen ops that are not views or bare
allocations, with the flexsparse lines they come from (``--where``), and (``--python``) the Python function calls
of one call, all and those of flexsparse's own modules: a count that does not vary from run to run, unlike the host
time it drives. The CPU paths can differ from CUDA's where a backend picks a strategy by device (the Gluon kernels,
the linear branch's dense sums), and the stubs leave out Triton's own launch path (``gpu_host_time.py`` times it):
the counts are a guide, the GPU's profiler the truth.

    python benchmarks/launch_audit.py [--n 256] [--methods topk vsa llsa sla sla2] [--where] [--python]
                                      [--quant '{"smooth_keys": false}']
"""
from __future__ import annotations

import argparse
import collections
import cProfile
import json
import os
import pstats
import traceback

os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from allocation_audit import CONFIGS, LAUNCHES, eager_calls, stub_launches  # noqa: E402

NO_KERNEL = {"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided", "detach", "alias",
             "lift_fresh", "_local_scalar_dense", "is_same_size"}


class AtenOps(TorchDispatchMode):
    """Counts the ATen ops that run a kernel (not views or bare allocations), by op, or by op and the innermost
    three flexsparse frames with ``where``."""

    def __init__(self, where: bool):
        super().__init__()
        self.where, self.seen = where, collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.removeprefix("aten::")
        if not func.is_view and name not in NO_KERNEL:
            key = name
            if self.where:
                frames = [f for f in traceback.extract_stack() if f"{os.sep}flexsparse{os.sep}" in f.filename]
                key += "  " + " <- ".join(f"{f.filename.split('flexsparse' + os.sep)[-1]}:{f.lineno}"
                                          for f in frames[-3:][::-1])
            self.seen[key] += 1
        return func(*args, **(kwargs or {}))


def python_calls(call) -> tuple[int, int]:
    """``(all, flexsparse's)``: the Python function calls (cProfile's, built-ins included) of one ``call()``."""
    profile = cProfile.Profile()
    profile.runcall(call)
    stats = pstats.Stats(profile).stats
    every = sum(calls for (_, calls, _, _, _) in stats.values())
    own = sum(calls for (filename, _, _), (_, calls, _, _, _) in stats.items()
              if f"{os.sep}flexsparse{os.sep}" in filename)
    return every, own


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=256)
    parser.add_argument("--methods", nargs="+", default=list(CONFIGS))
    parser.add_argument("--where", action="store_true", help="list each op with the lines it comes from")
    parser.add_argument("--python", action="store_true", help="count the Python function calls of a call")
    parser.add_argument("--quant", type=json.loads, help="the methods' config key quant, as JSON (e.g. '{}')")
    args = parser.parse_args()
    stub_launches()
    for name in args.methods:
        _, calls = eager_calls(name, args.n, heads=1, quant=args.quant)
        for phase, call in calls.items():
            call()                                    # a warm-up call builds what later calls reuse
            python = "Python calls {}, flexsparse's {}, ".format(*python_calls(call)) if args.python else ""
            LAUNCHES.clear()
            ops = AtenOps(args.where)
            with ops:
                call()
            triton = ", ".join(f"{kernel} x{count}" for kernel, count in sorted(LAUNCHES.items()))
            print(f"{name:5s} {phase:8s} Triton {sum(LAUNCHES.values()):3d}, ATen {sum(ops.seen.values()):3d}, "
                  f"{python}[{triton}]", flush=True)
            if args.where:
                for key, count in sorted(ops.seen.items()):
                    print(f"      {count} x {key}")


if __name__ == "__main__":
    main()
