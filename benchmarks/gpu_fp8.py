"""FP8 QAT benchmark: speed and error of the quantized sparse forward against the bf16 one, on one backend.
Not a ``python -m flexsparse`` case: it times the sparse branch alone on a fixed selection next to the whole method
and measures each variant's error against the bf16 output, on random or recorded q, k, v.

    python benchmarks/gpu_fp8.py --backend torch --out fp8_torch.json       # B=2 H=8 D=64 N=65536, sla 95 %
    python benchmarks/gpu_fp8.py --backend flex                             # only p="none" variants run
    python benchmarks/gpu_fp8.py --backend triton                           # the FP8 kernel (variant fp8 only)
    python benchmarks/gpu_fp8.py --backend triton --variants bf16 fp8 --kernels   # + where each call's time goes
    python benchmarks/gpu_fp8.py --backend triton --variants bf16 fp8 --compile   # the module under torch.compile
    python benchmarks/gpu_fp8.py --backend torch --qkv dit_qkv.pt           # recorded q, k, v (B, H, N, D)
    python benchmarks/gpu_fp8.py --device cpu --n 4096 --batch 1 --heads 2  # smoke run of the script on CPU

For each variant (``bf16``: no quant; then the ``quant`` configs of ``VARIANTS``) on the chosen backend:
``branch_fwd``  the sparse softmax branch alone, selection precomputed, under no_grad (the FP8 target:
                >= 1.3x faster than ``bf16``);
``method_fwd``  the whole method (selection, both branches) under no_grad (``--compile``: the module compiled by
                ``torch.compile`` in its default mode, here and in ``method_fwd_bwd``);
``method_fwd_bwd`` forward + backward of the whole method (QAT training: the quantized forward and the
                softmax backward at its output; triton runs no second, unquantized forward);
``method_fwd_kernels_ms`` (``--kernels``) the method forward's time by kernel (CUDA) or ATen op (CPU), profiler;
``method_fwd_bwd_kernels_ms`` (``--kernels``, with the backward) the same of forward + backward;
``rel_l2_branch`` / ``rel_l2_method``  ||o - o_bf16|| / ||o_bf16|| of the same backend's outputs;
``speedup_*``   bf16 time / variant time.
A variant the backend cannot run is recorded with the reason (the backend's ``quant_unsupported``);
an out-of-memory or other failure of one measurement is recorded and the others go on. Times are
``triton.testing.do_bench`` medians (20th/80th percentiles) in ms on CUDA, perf_counter medians on CPU.
"""
from __future__ import annotations

import argparse
import dataclasses
import json

import torch

import flexsparse
from flexsparse.backends import BACKENDS
from flexsparse.bench import attempt, bench_report, kernel_times, offset_qkv, rel_l2, time_spread
from flexsparse.config import Config
from flexsparse.methods import METHODS
from flexsparse.methods.dense import block_sparse_dense

VARIANTS = {
    "bf16": None,
    "fp8": {},                                      # all e4m3: Q, K per block, V per channel, P static
    "fp8_int8qk": {"qk_dtype": "int8"},             # SageAttention2: int8 Q, K; e4m3 P, V
    "fp8_p_none": {"p": "none"},                    # Q, K, V quantized, P not (what flex can run)
    "fp8_single_pass": {"smooth_keys": False},      # K unsmoothed: Q, K quantized in the selection's pooling pass
}
CONFIGS = {
    "sla": lambda ratio: {"method": "sla", "block_size": 64, "topk_ratio": ratio},
    "sla2": lambda ratio: {"method": "sla2", "block_q": 128, "block_k": 64, "topk_ratio": ratio},
    "topk": lambda ratio: {"method": "topk", "block_size": 64, "topk": None},
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="torch", choices=["torch", "flex", "triton", "reference"])
    p.add_argument("--method", default="sla", choices=sorted(CONFIGS))
    p.add_argument("--topk-ratio", type=float, default=0.05, help="kept fraction of key blocks (0.05: 95 %% sparse)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--n", type=int, default=65536)
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    p.add_argument("--qkv", help="torch.save'd dict with q, k, v (B, H, N, D) recorded from a model (e.g. the DiT)")
    p.add_argument("--no-backward", dest="backward", action="store_false", help="skip forward+backward")
    p.add_argument("--kernels", action="store_true", help="the method forward's (and forward+backward's) time by "
                   "kernel (profiler)")
    p.add_argument("--compile", action="store_true", help="time the method under torch.compile (default mode)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", help="write the results as JSON")
    return p.parse_args(argv)


def inputs(args, device: torch.device) -> list[torch.Tensor]:
    """bf16 q, k, v: recorded ones (``--qkv``) or random with a per-head key offset like real keys."""
    if args.qkv:
        saved = torch.load(args.qkv, map_location="cpu")
        return [saved[name].to(device, torch.bfloat16) for name in ("q", "k", "v")]
    return offset_qkv(args.batch, args.heads, args.n, args.head_dim, device)


def method_config(args, n: int, quant) -> dict:
    cfg = CONFIGS[args.method](args.topk_ratio)
    if args.method == "topk":
        cfg["topk"] = max(1, int(args.topk_ratio * -(-n // 64)))
    return cfg if quant is None else {**cfg, "quant": quant}


def branch_selection(args, q, k, v, module):
    """The method's block selection (hard) on the chosen backend and the keys its sparse branch attends (SLA2's
    smoothed keys), computed once for the branch timings; without the operands its pooling pass prepared, so that
    every variant's branch time holds all of its quantization."""
    method, cfg, backend = METHODS[args.method], module.config, BACKENDS[args.backend]
    with torch.no_grad():
        params = method.check_params(cfg, q, dict(module.params.items()))
        selection = method.select(q, k, v, cfg, backend, params)
    mask, keys = (selection.mask, selection.keys) if args.method == "sla2" else (selection, k)
    return dataclasses.replace(mask, prepared=None), keys


def run_variant(args, name: str, quant, q, k, v, device, baseline: dict) -> dict:
    n, d, heads = q.shape[2], q.shape[3], q.shape[1]
    cfg = method_config(args, n, quant)
    result = {"config": cfg}
    reason = BACKENDS[args.backend].quant_unsupported(Config.from_dict(cfg).quant, METHODS[args.method].sparse_branch)
    if reason is not None:
        result["skipped"] = reason
        return result
    module = flexsparse.SparseAttention(cfg, head_dim=d, num_heads=heads, seq_len=n, backend=args.backend).to(device)
    selection, branch_k = branch_selection(args, q, k, v, module)
    scale = d ** -0.5
    # the reference backend's sparse branch is the dense spec; the others' their block-sparse attention
    attend = block_sparse_dense if args.backend == "reference" else BACKENDS[args.backend].block_sparse_attention

    def branch():
        with torch.no_grad():
            return attend(q, branch_k.to(q.dtype), v, selection, scale, quant=module.config.quant)[0]

    run = torch.compile(module) if args.compile else module

    def method():
        with torch.no_grad():
            return run(q, k, v)

    leaves = [x.detach().requires_grad_() for x in (q, k, v)]

    def train_step():
        run(*leaves).float().square().mean().backward()

    for key, fn in (("branch", branch), ("method", method)):
        out = attempt(fn)
        if isinstance(out, str):
            result[f"{key}_fwd"] = out
            continue
        result[f"{key}_fwd"] = attempt(lambda: time_spread(fn, device))
        if name == "bf16":
            baseline[key] = out
        elif key in baseline:
            result[f"rel_l2_{key}"] = rel_l2(out, baseline[key])
    if args.kernels:
        result["method_fwd_kernels_ms"] = attempt(lambda: kernel_times(method, device))
    if args.backward:
        result["method_fwd_bwd"] = attempt(lambda: time_spread(train_step, device))
        if args.kernels:
            result["method_fwd_bwd_kernels_ms"] = attempt(lambda: kernel_times(train_step, device))
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        attempt(method)
        result["method_fwd_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return result


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    q, k, v = inputs(args, device)
    baseline: dict = {}
    results = {}
    for name in ["bf16", *[v for v in args.variants if v != "bf16"]]:
        results[name] = run_variant(args, name, VARIANTS[name], q, k, v, device, baseline)
        base = results["bf16"]
        for key in ("branch_fwd", "method_fwd", "method_fwd_bwd"):
            mine, ref = results[name].get(key), base.get(key)
            if name != "bf16" and isinstance(mine, dict) and isinstance(ref, dict):
                results[name][f"speedup_{key}"] = ref["median_ms"] / mine["median_ms"]
        print(name, json.dumps(results[name], indent=1, default=str))
    return bench_report(args, results, device, shape=list(q.shape))


if __name__ == "__main__":
    main()
