"""SLA2's two-stage training (arXiv 2602.12675, Alg. 1) on the pixel-space DiT of ``examples/dit``.

    python -m examples.sla2_two_stage --tiny                      # CPU, well under a minute
    python -m examples.sla2_two_stage --init runs/s64/checkpoints/last.pt --out runs/sla2   # GPU

0. A dense model: ``--init`` (a checkpoint of ``examples.dit.train`` with full attention), or
   ``--pretrain-steps`` of full-attention training from scratch.
1. Stage 1 (calibration): the same weights with SLA2 attention; Q, K, V of every block recorded from
   ``--calib-batches`` noisy training batches (the layers return full attention while recording, so
   each sees the dense model's activations); each layer's router and alpha fitted by MSE against full
   attention for every ``--topk-ratios`` entry; MSE before/after printed per layer and ratio; the fit
   for ``--deploy-ratio`` loaded into the model.
2. Stage 2: hard top-k router, router frozen, alpha (``--trainable``) and the model trained with the
   flow-matching loss for ``--steps`` steps; loss curve printed and plotted.

Validation losses (fixed held-out crops, noise and sigmas) of the dense model, of SLA2 before and
after calibration and after stage 2 are printed and written to ``summary.json`` in ``--out`` with
``calibration.txt`` (the MSE table), ``history.json`` and ``loss.png`` (with matplotlib).
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import time
from pathlib import Path

import numpy as np
import torch

from flexsparse.training import QKVRecorder, calibrate_sla2, prepare_stage2

from .dit.data import photos_and_split, random_crops
from .dit.flow import SIGMA_LEVELS, noise_scale, sample_sigmas
from .dit.outputs import write_json
from .dit.train import (ARCH_DEFAULTS, autocast, build_model, load_weights, training_step, validation_loss,
                        validation_set)

# --tiny: 16x16 images (N = 256 tokens), 8-token query and 4-token key blocks (64 key blocks per row).
TINY = {"image_size": 16, "hidden": 32, "heads": 2, "depth": 2, "block_q": 8, "block_k": 4, "topk_ratios": [0.1, 0.05],
        "pretrain_steps": 30, "pretrain_lr": 1e-3, "calib_batches": 2, "calib_steps": 30, "steps": 20, "batch_size": 4,
        "val_crops": 8, "log_every": 5, "threads": 1}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m examples.sla2_two_stage", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--init", help="checkpoint of examples.dit.train with full attention (model size from it)")
    p.add_argument("--image-size", type=int, default=64)
    for name, default in ARCH_DEFAULTS.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default,
                       help="model size (ignored with --init)")
    p.add_argument("--pretrain-steps", type=int, default=2000, help="full-attention steps when there is no --init")
    p.add_argument("--pretrain-lr", type=float, default=3e-4)
    p.add_argument("--block-q", type=int, default=128)
    p.add_argument("--block-k", type=int, default=64)
    p.add_argument("--topk-ratios", type=float, nargs="+", default=[0.05, 0.04, 0.03],
                   help="k%% calibrated (fraction of key blocks kept per query block)")
    p.add_argument("--deploy-ratio", type=float, help="the calibrated ratio stage 2 runs at (default: the first)")
    p.add_argument("--joint", action="store_true", help="one router and alpha for all ratios (default: one each)")
    p.add_argument("--calib-batches", type=int, default=4, help="batches recorded per layer")
    p.add_argument("--calib-steps", type=int, default=200, help="Adam steps per layer and ratio")
    p.add_argument("--calib-lr", type=float, default=1e-2)
    p.add_argument("--steps", type=int, default=500, help="stage-2 steps")
    p.add_argument("--trainable", choices=["alpha", "none"], default="alpha", help="SLA2 parameters trained in stage 2")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--alpha-lr", type=float, default=1e-3)
    p.add_argument("--val-crops", type=int, default=32)
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--data-dir", help="folder of your own images (default: photographs in scikit-image/-learn)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--backend", help="flexsparse backend (default: auto on CUDA, torch on CPU)")
    p.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="auto", help="auto: bf16 on CUDA")
    p.add_argument("--record-on-cpu", action="store_true", help="keep the recorded Q, K, V in host memory")
    p.add_argument("--out", default="runs/sla2_two_stage")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, help="CPU intra-op threads (default: torch's; --tiny: 1, faster for tiny "
                   "models and steady on a busy machine)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny model and data, a few steps")
    if p.parse_args(argv).tiny:                   # the tiny settings become defaults; given options win
        p.set_defaults(**TINY)
    args = p.parse_args(argv)
    args.backend = args.backend or ("torch" if args.device == "cpu" else "auto")
    args.deploy_ratio = args.topk_ratios[0] if args.deploy_ratio is None else args.deploy_ratio
    if args.deploy_ratio not in args.topk_ratios:
        p.error(f"--deploy-ratio {args.deploy_ratio} is not one of --topk-ratios {args.topk_ratios}")
    return args


def model_config(args, attn: dict, checkpoint: dict | None) -> dict:
    """What ``examples.dit.train.build_model`` needs; the size from ``checkpoint`` when given."""
    arch = {name: checkpoint["config"][name] if checkpoint else getattr(args, name) for name in ARCH_DEFAULTS}
    rope_size = checkpoint["config"]["rope_size"] if checkpoint else args.image_size
    return {"image_size": args.image_size, "attn": attn, **arch, "rope_size": rope_size, "backend": args.backend,
            "checkpointing": False}


class Batches:
    """Noisy training batches ``(x_t, t, target)`` of the flow-matching loss from random crops."""

    def __init__(self, images, args, device):
        self.images, self.size, self.batch, self.device = images, args.image_size, args.batch_size, device
        self.scale = noise_scale(args.image_size)
        self.crops = torch.Generator().manual_seed(args.seed)
        self.noise = torch.Generator(device).manual_seed(args.seed + 1)

    def draw(self):
        x0 = random_crops(self.images, self.size, self.batch, self.crops).to(self.device)
        eps = torch.randn(x0.shape, generator=self.noise, device=self.device)
        return x0, eps, sample_sigmas(self.batch, self.noise)


def train_steps(model, optimizer, batches: Batches, steps: int, amp, log_every: int, label: str) -> list[float]:
    """``steps`` optimizer steps on the flow-matching loss; the loss of each, printed every ``log_every``."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    losses = []
    for step in range(1, steps + 1):
        loss = training_step(model, optimizer, params, *batches.draw(), batches.scale, 1.0, amp).item()
        if not math.isfinite(loss):
            raise FloatingPointError(f"{label}: loss became {loss} at step {step}")
        losses.append(loss)
        if step % log_every == 0 or step == steps:
            window = losses[-log_every:]
            mean = sum(window) / len(window)
            print(f"  {label} step {step:5d}  loss {loss:.4f}  (mean of the last {len(window)}: {mean:.4f})")
    return losses


@torch.no_grad()
def record(model, batches: Batches, count: int, amp, on_cpu: bool) -> QKVRecorder:
    """Q, K, V of every SLA2 layer from ``count`` noisy batches (the layers run dense meanwhile)."""
    with QKVRecorder(model, max_batches=count, device="cpu" if on_cpu else None) as recorder:
        for _ in range(count):
            x0, eps, sigma = batches.draw()
            s = sigma.view(-1, 1, 1, 1)
            with amp:
                model((1 - s) * x0 + s * batches.scale * eps, sigma * SIGMA_LEVELS)
    return recorder


def plot(history: dict, val: dict, path: Path) -> str | None:
    """Stage-2 training loss and the validation losses (PNG); None without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    losses = history["stage2_loss"]
    steps = list(range(1, len(losses) + 1))
    ax.plot(steps, losses, color="0.75", lw=0.8, label="stage 2 training loss")
    window = max(1, len(losses) // 20)
    if window > 1:
        ax.plot(steps[window - 1:], np.convolve(losses, np.ones(window) / window, mode="valid"), color="C0",
                label=f"mean of {window}")
    for (name, value), color in zip(val.items(), ("k", "C3", "C2", "C1")):
        ax.axhline(value, color=color, ls="--", lw=1, label=f"val: {name} ({value:.4f})")
    ax.set_xlabel("stage-2 step")
    ax.set_ylabel("flow-matching loss")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)


def main(argv=None) -> dict:
    args = parse_args(argv)
    device, out = torch.device(args.device), Path(args.out)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    amp = autocast(device, args.precision)
    train_images, val_images = photos_and_split(args.data_dir)
    val = validation_set(val_images, args.image_size, args.val_crops, device)
    batches = Batches([image.to(device) for image in train_images], args, device)
    val_loss = {}

    # 0. the dense model
    checkpoint = torch.load(args.init, map_location="cpu") if args.init else None
    dense = build_model(model_config(args, {"method": "full"}, checkpoint), device)
    if checkpoint:
        load_weights(dense, checkpoint["model"])
    else:
        print(f"pre-training the dense model for {args.pretrain_steps} steps")
        optimizer = torch.optim.AdamW(dense.parameters(), lr=args.pretrain_lr, weight_decay=0.01)
        train_steps(dense, optimizer, batches, args.pretrain_steps, amp, args.log_every * 4, "dense")
    val_loss["dense"] = validation_loss(dense, val, batches.scale, args.batch_size, amp)

    # 1. stage 1: SLA2 with the dense weights, calibrated on recorded Q, K, V
    sla2 = {"method": "sla2", "block_q": args.block_q, "block_k": args.block_k, "topk_ratio": args.deploy_ratio}
    model = build_model(model_config(args, sla2, checkpoint), device)
    load_weights(model, dense.state_dict())
    del dense
    val_loss["sla2 uncalibrated"] = validation_loss(model, val, batches.scale, args.batch_size, amp)
    tick = time.perf_counter()
    recorder = record(model, batches, args.calib_batches, amp, args.record_on_cpu)
    print(f"recorded {args.calib_batches} calls of {len(recorder.layers)} layers ({recorder.nbytes / 2**20:.1f} MiB)")
    result = calibrate_sla2(recorder, args.topk_ratios, steps=args.calib_steps, lr=args.calib_lr, joint=args.joint,
                            progress=not args.quiet)
    del recorder
    calib_seconds = time.perf_counter() - tick
    table = result.table()
    print(f"\nstage 1: MSE against full attention per layer and k% ({calib_seconds:.1f} s)\n{table}\n")
    (out / "calibration.txt").parent.mkdir(parents=True, exist_ok=True)
    (out / "calibration.txt").write_text(table + "\n")
    result.apply(model, args.deploy_ratio)
    val_loss["sla2 calibrated"] = validation_loss(model, val, batches.scale, args.batch_size, amp)

    # 2. stage 2: hard top-k, router frozen, alpha and the model trained
    groups = prepare_stage2(model, trainable=args.trainable)
    for group in groups:
        group["lr"] = args.alpha_lr if group["name"] == "alpha" else args.lr
    optimizer = torch.optim.AdamW(groups, weight_decay=0.0)
    print(f"stage 2: {args.steps} steps at topk_ratio={args.deploy_ratio}, trained: "
          + ", ".join(f"{g['name']} ({sum(p.numel() for p in g['params'])} values)" for g in groups))
    losses = train_steps(model, optimizer, batches, args.steps, amp, args.log_every, "stage 2")
    val_loss["sla2 after stage 2"] = validation_loss(model, val, batches.scale, args.batch_size, amp)

    print("\nvalidation loss: " + ", ".join(f"{name} {value:.4f}" for name, value in val_loss.items()))
    history = {"stage2_loss": losses}
    write_json(history, out / "history.json")
    torch.save({"model": model.state_dict(), "config": model_config(args, sla2, checkpoint)}, out / "sla2_model.pt")
    summary = {"val_loss": val_loss, "deploy_ratio": args.deploy_ratio, "calibration_seconds": calib_seconds,
               "calibration": [dataclasses.asdict(row) for row in result.rows],
               "stage2_final_loss": losses[-1] if losses else None,
               "loss_curve": plot(history, val_loss, out / "loss.png")}
    write_json(summary, out / "summary.json")
    return summary


if __name__ == "__main__":
    main()
