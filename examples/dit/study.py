"""Training study: the same DiT, data, seed and steps for each attention method at one resolution;
validation-loss curves, final validation loss, a sample grid per method, and training throughput in
pixel tokens/s at several resolutions.

    python -m examples.dit.study --out study_out --steps 2000          # GPU: 128x128, DiT-S
    python -m examples.dit.study --out study_out --budget 600          # 10 minutes of training per method
    python -m examples.dit.study --tiny --out /tmp/study               # CPU smoke test
    python -m examples.dit.study --attn-quant '{}' --fp8-linear        # FP8 QAT attention + FP8 linears
    python -m examples.dit.study --methods vsa sla --throughput-sizes   # more methods into the same --out
    python -m examples.dit.study --steps 0 --compile --no-checkpointing # throughput only, merged into study.json

A run merges into an existing ``study.json`` in ``--out``: methods it does not run are kept, and a method
keeps its earlier training results when this run only measures throughput (``--steps 0``) and its earlier
throughput when this run measures none (``--throughput-sizes`` with no sizes), so a long study can run in
several shorter commands. Writes ``study.json``, ``val_loss.png``, ``throughput.png``, ``samples_<method>.png`` and each
method's run folder ``runs/<method>/`` (see ``examples.dit.train``).
"""
from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch

import flexsparse
from flexsparse import Config
from flexsparse.bench import attempt

from . import train
from .model import DiT
from .outputs import write_json

# At 128x128 (N = 16384): topk/vsa keep 8 or 32 of 256 key blocks of 64; sla/sla2 5% of the blocks;
# llsa K=8 at both levels (L = 2 for N >= 16384), as in the LLSA paper.
METHODS = {
    "full": {"method": "full"},
    "topk8": {"method": "topk", "block_size": 64, "topk": 8},
    "topk32": {"method": "topk", "block_size": 64, "topk": 32},
    "vsa": {"method": "vsa", "block_size": 64, "topk": 8, "gate": True},
    "sla": {"method": "sla", "block_size": 64, "topk_ratio": 0.05},
    "sla2": {"method": "sla2", "block_q": 128, "block_k": 64, "topk_ratio": 0.05},
    "llsa": {"method": "llsa", "block_size": 16, "topk": 8},
}
# --tiny: 16x16 images (N = 256), blocks scaled down so every method has several blocks.
TINY_METHODS = {
    "full": {"method": "full"},
    "topk8": {"method": "topk", "block_size": 4, "topk": 8},
    "topk32": {"method": "topk", "block_size": 4, "topk": 32},
    "vsa": {"method": "vsa", "block_size": 4, "topk": 8, "gate": True},
    "sla": {"method": "sla", "block_size": 4, "topk_ratio": 0.05},
    "sla2": {"method": "sla2", "block_q": 8, "block_k": 4, "topk_ratio": 0.05},
    "llsa": {"method": "llsa", "block_size": 4, "topk": 8},
}


def _add_unlisted_methods() -> None:
    """A registered method (``flexsparse.METHODS``) that no entry above runs joins under its own name with its
    example config (with --tiny, 4-token blocks as the others)."""
    for name, method in flexsparse.METHODS.items():
        if all(attn["method"] != name for attn in METHODS.values()):
            METHODS[name] = dict(method.example)
            TINY_METHODS[name] = {key: 4 if key in ("block_size", "block_q", "block_k") else value
                                  for key, value in method.example.items()}


_add_unlisted_methods()
TINY = {"image_size": 16, "throughput_sizes": [16, 32], "throughput_tokens": 1024, "throughput_steps": 2,
        "steps": 2, "batch_size": 2}
TINY_ARCH = {"hidden": 32, "heads": 2, "depth": 2}
TINY_RUN = ["--val-crops", "4", "--samples", "4", "--sample-steps", "2"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m examples.dit.study", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default="study_out")
    p.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    p.add_argument("--image-size", type=int, default=128)
    p.add_argument("--steps", type=int, default=2000, help="training steps per method (0: throughput only)")
    p.add_argument("--budget", type=float, help="also stop each method after this many seconds of training steps")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--val-every", type=int, help="default: steps / 20")
    p.add_argument("--init", help="checkpoint every method starts from (e.g. a low-resolution full-attention run)")
    p.add_argument("--data-dir", help="your own images instead of the bundled photographs")
    p.add_argument("--throughput-sizes", type=int, nargs="*", default=[128, 256],
                   help="image sides of the throughput measurement (none: skip it)")
    p.add_argument("--throughput-tokens", type=int, default=16 * 128 * 128,
                   help="pixel tokens per throughput batch (batch = tokens / side^2)")
    p.add_argument("--throughput-steps", type=int, default=10, help="timed training steps (after 3 warm-up)")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--no-checkpointing", dest="checkpointing", action="store_false",
                   help="keep all activations (DiT-S at 128x128, batch 16, needs about 90 GB without checkpointing)")
    p.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="auto")
    p.add_argument("--attn-quant", type=json.loads, metavar="JSON",
                   help="FP8 QAT of the sparse branch ('quant' config, e.g. '{}' or '{\"qk_dtype\": \"int8\"}') "
                        "for every method that has it (topk, llsa, sla, sla2); the others run unquantized")
    p.add_argument("--fp8-linear", action="store_true", help="train the nn.Linear layers in FP8 (torchao)")
    p.add_argument("--backend", default="auto", help="flexsparse backend of every method")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny model, 16x16 images, 2 steps")
    if p.parse_args(argv).tiny:     # tiny defaults; options given on the command line still win
        p.set_defaults(**TINY)
    return p.parse_args(argv)


def with_quant(attn: dict, quant) -> dict:
    """``attn`` with the ``quant`` key when given and the method has one (checked by ``Config``)."""
    if quant is None or "quant" not in Config.registry[attn["method"]]._field_names():
        return attn
    return Config.from_dict({**attn, "quant": quant}).to_dict()


def model_size(args) -> dict:
    """The DiT's size: the ``--init`` checkpoint's, the tiny one, or the default (DiT-S)."""
    if args.init:
        saved = torch.load(args.init, map_location="cpu")["config"]
        return {k: saved[k] for k in train.ARCH_DEFAULTS}
    return dict(TINY_ARCH) if args.tiny else dict(train.ARCH_DEFAULTS)


def train_method(name: str, attn: dict, args, arch: dict, out: Path) -> dict:
    """Train one method with ``examples.dit.train``; its summary and validation curve."""
    argv = ["--attn", json.dumps(attn), "--image-size", str(args.image_size), "--steps", str(args.steps),
            "--batch-size", str(args.batch_size), "--val-every", str(args.val_every or max(1, args.steps // 20)),
            "--sample-every", str(args.steps), "--ckpt-every", str(args.steps), "--out", str(out / "runs" / name),
            "--precision", args.precision, "--backend", args.backend, "--device", args.device, "--seed", str(args.seed),
            "--quiet"]
    argv += ["--budget", str(args.budget)] if args.budget else []
    argv += ["--resume", args.init] if args.init else []
    argv += ["--data-dir", args.data_dir] if args.data_dir else []
    argv += ["--compile"] if args.compile else []
    argv += ["--checkpointing"] if args.checkpointing else []
    argv += ["--fp8-linear"] if args.fp8_linear else []
    argv += [item for key, value in arch.items() for item in (f"--{key.replace('_', '-')}", str(value))]
    argv += TINY_RUN if args.tiny else []
    summary = train.main(argv)
    history = json.loads((out / "runs" / name / "history.json").read_text())
    shutil.copyfile(summary["samples"], out / f"samples_{name}.png")
    return {"summary": summary, **{k: history[k] for k in ("val_step", "val_loss", "val_loss_ema")}}


def measure_throughput(attn: dict, size: int, args, arch: dict) -> float:
    """Training tokens/s (forward, backward, AdamW step) at ``size x size`` on random data."""
    device = torch.device(args.device)
    batch = max(1, args.throughput_tokens // (size * size))
    model = DiT(size, attn, **arch, backend=args.backend, checkpointing=args.checkpointing).to(device)
    if args.fp8_linear:
        train.float8_linear_layers(model, device)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    step_model = torch.compile(model) if args.compile else model
    amp = train.autocast(device, args.precision)
    x0, eps = torch.randn(2, batch, 3, size, size, device=device).unbind(0)
    sigma = torch.rand(batch, device=device)

    def run(steps):
        for _ in range(steps):
            train.training_step(step_model, optimizer, params, x0, eps, sigma, size / 64, 1.0, amp)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    run(3)
    start = time.perf_counter()
    run(args.throughput_steps)
    return batch * size * size * args.throughput_steps / (time.perf_counter() - start)


def earlier_results(out: Path) -> dict:
    """The per-method results of an earlier study in ``out`` (empty when there is none)."""
    path = out / "study.json"
    return json.loads(path.read_text())["methods"] if path.exists() else {}


def plot(results: dict, out: Path, args) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, key, model in zip(axes, ("val_loss", "val_loss_ema"), ("model", "EMA model")):
        for name, result in results.items():
            if result.get("val_step"):
                ax.plot(result["val_step"], result[key], "o-", ms=3, label=name)
        ax.set(xlabel="step", ylabel=f"validation loss ({model})", yscale="log")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(f"{args.image_size}x{args.image_size}, held-out crops, fixed noise and sigmas")
    fig.tight_layout()
    fig.savefig(out / "val_loss.png", dpi=120)
    plt.close(fig)

    measured = {n: {size: v for size, v in r.get("throughput", {}).items() if isinstance(v, float)}
                for n, r in results.items()}
    names = [n for n, sizes in measured.items() if sizes]
    if not names:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    sizes = sorted({size for n in names for size in measured[n]}, key=int)
    width = 0.8 / max(1, len(sizes))
    for i, size in enumerate(sizes):
        ax.bar([j + i * width for j in range(len(names))], [measured[n].get(size, 0.0) for n in names], width,
               label=f"{size}x{size}")
    ax.set_xticks([j + width * (len(sizes) - 1) / 2 for j in range(len(names))], names)
    ax.set(ylabel="training pixel tokens / s", yscale="log", title="training throughput")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "throughput.png", dpi=120)
    plt.close(fig)


def main(argv=None) -> dict:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table = TINY_METHODS if args.tiny else METHODS
    arch = model_size(args)
    results = earlier_results(out)
    for name in args.methods:
        attn = with_quant(table[name], args.attn_quant)
        result = results.setdefault(name, {})
        result["attn"] = attn
        if attn["method"] not in flexsparse.METHODS:
            result["error"] = f"method {attn['method']!r} is not in this flexsparse build"
            print(f"[{name}] skipped: {result['error']}")
            continue
        if args.steps > 0:
            for key in ("summary", "val_step", "val_loss", "val_loss_ema", "error"):
                result.pop(key, None)
            trained = attempt(lambda: train_method(name, attn, args, arch, out))
            result.update(trained if isinstance(trained, dict) else {"error": trained})
        if args.throughput_sizes:
            result["throughput"] = {str(size): attempt(lambda: measure_throughput(attn, size, args, arch))
                                    for size in args.throughput_sizes}
            result["throughput_settings"] = {"compile": args.compile, "checkpointing": args.checkpointing,
                                             "tokens_per_batch": args.throughput_tokens}
        final = result.get("summary", {}).get("final_val_loss_ema")
        print(f"[{name}] final EMA validation loss {final}, tokens/s {result.get('throughput')}"
              + (f", {result['error']}" if "error" in result else ""))
        write_json({"args": vars(args), "methods": results}, out / "study.json")
    plot(results, out, args)
    return results


if __name__ == "__main__":
    main()
