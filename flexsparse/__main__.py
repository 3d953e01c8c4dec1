"""``python -m flexsparse``: the benchmark/demo (see ``flexsparse.bench``)."""
from __future__ import annotations

import argparse
import datetime
import platform

import torch
from tabulate import tabulate

from .bench import available_methods, run, write_outputs

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args(argv=None):
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(prog="flexsparse", description="Benchmark and check every flexsparse method "
                                     "against dense SDPA on the best available device.")
    parser.add_argument("--device", default="cuda" if cuda else "cpu")
    parser.add_argument("--methods", nargs="+", default=available_methods(), choices=available_methods())
    parser.add_argument("--backends", nargs="+", choices=["torch", "flex", "triton"],
                        help="backends to time (default: every one that runs on the device)")
    parser.add_argument("--sizes", type=int, nargs="+", help="sequence lengths (default: fit the device)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="default bf16 on CUDA, fp32 on CPU")
    parser.add_argument("--batch", type=int, help="default 2 on CUDA, 1 on CPU")
    parser.add_argument("--heads", type=int, help="default 8 on CUDA, 2 on CPU")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--no-backward", action="store_true", help="time forward only")
    parser.add_argument("--no-check", action="store_true", help="skip the small-size check against the reference")
    parser.add_argument("--out", default="bench_out", help="folder for results.json and timing.png")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    sizes = args.sizes or ([4096, 16384, 65536] if on_gpu else [1024, 4096])
    dtype = DTYPES[args.dtype or ("bf16" if on_gpu else "fp32")]
    batch, heads = args.batch or (2 if on_gpu else 1), args.heads or (8 if on_gpu else 2)
    name = torch.cuda.get_device_name(device) if on_gpu else f"CPU ({platform.processor() or platform.machine()})"
    meta = {"device_name": name, "dtype": str(dtype).replace("torch.", ""), "batch": batch, "heads": heads,
            "dim": args.dim, "torch": torch.__version__, "date": datetime.date.today().isoformat()}
    print(f"flexsparse benchmark on {name}: B={batch} H={heads} D={args.dim} {meta['dtype']}, N={sizes}")
    rows = run(args.methods, sizes, device, dtype, batch, heads, args.dim, not args.no_backward, not args.no_check,
               args.backends)
    table = [[r.method, r.backend, r.n, r.forward_ms, r.forward_backward_ms, r.speedup_forward,
              r.speedup_forward_backward, r.max_error] for r in rows]
    print(tabulate(table, headers=["method", "backend", "N", "fwd ms", "fwd+bwd ms", "speedup fwd",
                                   "speedup fwd+bwd", "max err vs ref"], floatfmt=".3g"))
    dense = sorted({(r.n, r.sdpa_forward_ms, r.sdpa_forward_backward_ms) for r in rows})
    print(tabulate(dense, headers=["N", "dense SDPA fwd ms", "dense SDPA fwd+bwd ms"], floatfmt=".3g"))
    for path in write_outputs(rows, args.out, meta):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
