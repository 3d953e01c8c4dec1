"""Train the pixel-space DiT with flow matching on photographs, attention chosen by a config dict.

    python -m examples.dit.train --image-size 32 --attn full --steps 40000 --out runs/s32
    python -m examples.dit.train --image-size 128 --resume runs/s32/checkpoints/last.pt \\
        --attn '{"method": "llsa", "block_size": 16, "topk": 8}' --out runs/s128_llsa

``--fp8-linear`` trains the model's ``nn.Linear`` layers in FP8 (torchao ``convert_to_float8_training``);
FP8 QAT of the sparse attention branch is the attention config's ``quant`` key, e.g.
``--attn '{"method": "sla", "quant": {"qk_dtype": "int8"}}'``.

A resume at the same image size and attention continues the run (optimizer, step, history); at a
different size or attention it starts a new stage from the weights (progressive resolution: RoPE
positions stay rescaled to the pretraining size, parameters new to the sparse method start fresh).
Writes into ``--out``: ``config.json``, ``history.json``, ``loss.png``, ``samples/step_*.png``,
``checkpoints/last.pt`` (weights, EMA, optimizer, config, history) and ``summary.json``.

``--sp N`` under ``torchrun`` trains on a ``(world / N, N)`` mesh: data parallel × sequence parallel
(``flexsparse.ParallelConfig``, the model's tokens sharded over N ranks), with FSDP2 over all ranks
(``distribute``). ``--batch-size`` is then per data-parallel rank; rank 0 writes the outputs.

    torchrun --nproc-per-node 8 -m examples.dit.train --sp 2 --image-size 128 --attn llsa --out runs/sp
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from tqdm.auto import tqdm

import flexsparse

from .data import photos_and_split, random_crops
from .flow import euler_sample, flow_loss, noise_scale, sample_sigmas, validation_sigmas
from .model import DiT
from .outputs import plot_losses, save_grid, write_json

ARCH_DEFAULTS = {"hidden": 384, "heads": 6, "depth": 12, "mlp_ratio": 4.0}
VAL_SEED, SAMPLE_SEED = 1234, 4321          # fixed across runs, so validation losses and samples compare
DATA_STREAM = 2_654_435_761                 # seed offset between data ranks: odd, < 2**32 (a CPU seed keeps 32 bits)


def attn_config(text: str) -> dict:
    """``--attn``: a JSON config dict, or a bare method name such as ``full``."""
    try:
        config = json.loads(text) if text.lstrip().startswith("{") else {"method": text}
        return flexsparse.Config.from_dict(config).to_dict()
    except (ValueError, TypeError) as err:
        raise argparse.ArgumentTypeError(f"--attn {text!r}: {err}") from err


def float8_linear_layers(model: torch.nn.Module, device: torch.device) -> int:
    """Swap the model's per-token ``nn.Linear`` layers whose sizes are multiples of 16 (torchao's
    requirement; the 3-channel pixel embedding and output stay) for torchao ``Float8Linear`` (dynamic
    tensorwise e4m3 forward, e5m2 gradients); return how many. The conditioning layers (timestep
    embedder, adaLN) stay too: they see one row per sample, and FP8 matmuls need the row count of the
    weight gradient (the batch) to be a multiple of 16. Clear errors without torchao, or where FP8
    matmuls cannot run (checked with one small layer on ``device``)."""
    try:
        from torchao.float8 import convert_to_float8_training
    except ImportError as err:
        raise ImportError("--fp8-linear needs torchao: pip install 'flexsparse[quant]' (torchao>=0.17,<0.19)") from err
    def fits(module, name):
        per_sample = {"t_embed", "ada", "final_ada"} & set(name.split("."))
        return not per_sample and module.in_features % 16 == 0 and module.out_features % 16 == 0

    probe = convert_to_float8_training(torch.nn.Sequential(torch.nn.Linear(16, 16))).to(device)
    try:
        probe(torch.randn(16, 16, device=device, requires_grad=True)).sum().backward()
    except Exception as err:
        raise RuntimeError(f"--fp8-linear: torchao Float8Linear cannot run on {device} with torch {torch.__version__} "
                           f"({type(err).__name__}: {err})") from err
    before = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    convert_to_float8_training(model, module_filter_fn=fits)
    return before - sum(type(m) is torch.nn.Linear for m in model.modules())


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m examples.dit.train", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--attn", type=attn_config, default={"method": "full"}, help="flexsparse config (JSON) or 'full'")
    p.add_argument("--image-size", type=int, default=128)
    p.add_argument("--steps", type=int, default=10000, help="training steps of this stage")
    p.add_argument("--budget", type=float,
                   help="stop after this many seconds of training steps (evaluation not counted)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--ema-decay", type=float, default=0.9999)
    for name in ARCH_DEFAULTS:
        p.add_argument(f"--{name.replace('_', '-')}", type=type(ARCH_DEFAULTS[name]),
                       help=f"model size (default {ARCH_DEFAULTS[name]}, or the checkpoint's on --resume)")
    p.add_argument("--rope-size", type=int,
                   help="side RoPE positions are rescaled to (default: the first stage's size)")
    p.add_argument("--noise-scale", type=float, help="flow-matching noise scale s (default image size / 64)")
    p.add_argument("--data-dir", help="folder of your own images (default: photographs bundled with "
                   "scikit-image and scikit-learn)")
    p.add_argument("--val-crops", type=int, default=32, help="held-out validation crops")
    p.add_argument("--val-every", type=int, default=500)
    p.add_argument("--sample-every", type=int, default=2000)
    p.add_argument("--samples", type=int, default=16, help="images per sample grid")
    p.add_argument("--sample-steps", type=int, default=20, help="Euler steps per sample")
    p.add_argument("--ckpt-every", type=int, default=2000)
    p.add_argument("--out", default="runs/dit")
    p.add_argument("--resume", help="checkpoint to continue, or to start a new stage from")
    p.add_argument("--compile", action="store_true", help="torch.compile the training model")
    p.add_argument("--checkpointing", action="store_true", help="activation checkpointing per block (less memory)")
    p.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="auto", help="auto: bf16 on CUDA")
    p.add_argument("--fp8-linear", action="store_true",
                   help="train the nn.Linear layers in FP8 (torchao convert_to_float8_training; needs torchao)")
    p.add_argument("--backend", default="auto", help="flexsparse backend")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--sp", type=int, help="under torchrun: sequence-parallel degree (must divide the world size and "
                   "--heads); the other factor of the world is data parallel, --batch-size is per data rank")
    args = p.parse_args(argv)
    if args.sp is not None and args.sp < 1:
        p.error("--sp must be >= 1")
    for name in ("image_size", "steps", "batch_size", "val_crops", "val_every", "sample_every", "samples",
                 "sample_steps", "ckpt_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def run_config(args, checkpoint: dict | None) -> dict:
    """Model, data and optimisation settings of this stage (saved in checkpoints)."""
    previous = checkpoint["config"] if checkpoint else {}
    arch = {}
    for name, default in ARCH_DEFAULTS.items():
        given, saved = getattr(args, name), previous.get(name)
        if given is not None and saved is not None and given != saved:
            raise ValueError(f"--{name.replace('_', '-')}={given} differs from the checkpoint's {saved}")
        arch[name] = given if given is not None else saved if saved is not None else default
    rope_size = args.rope_size or previous.get("rope_size") or args.image_size
    return {"image_size": args.image_size, "attn": args.attn, **arch, "rope_size": rope_size,
            "noise_scale": args.noise_scale or noise_scale(args.image_size), "batch_size": args.batch_size,
            "lr": args.lr, "weight_decay": args.weight_decay, "grad_clip": args.grad_clip,
            "ema_decay": args.ema_decay, "data_dir": args.data_dir, "seed": args.seed, "backend": args.backend,
            "checkpointing": args.checkpointing, "fp8_linear": args.fp8_linear, "init_from": args.resume}


def build_model(config: dict, device, parallel: flexsparse.ParallelConfig | None = None) -> DiT:
    model = DiT(config["image_size"], config["attn"], hidden=config["hidden"], heads=config["heads"],
                depth=config["depth"], mlp_ratio=config["mlp_ratio"], rope_size=config["rope_size"],
                backend=config["backend"], checkpointing=config["checkpointing"], parallel=parallel).to(device)
    if config.get("fp8_linear"):
        print(f"--fp8-linear: {float8_linear_layers(model, device)} nn.Linear layers train in FP8")
    return model


def load_weights(model: DiT, state: dict) -> list[str]:
    """Load the tensors of ``state`` that fit ``model``; return the names left as initialised. Only
    sparse-attention parameters may be left (new to this stage, or shaped by the old resolution). The sparse
    attention's config entries are left out: a new stage may change the attention config on purpose."""
    own, state = (flexsparse.SparseAttention.without_configs(sd) for sd in (model.state_dict(), state))
    fitting = {k: shard_like(v, own[k]) for k, v in state.items() if k in own and own[k].shape == v.shape}
    fresh = sorted(set(own) - set(fitting))
    wrong = [k for k in fresh + sorted(set(state) - set(own)) if ".attn.attention." not in k]
    if wrong:
        raise ValueError(f"checkpoint does not fit this model: {wrong[:5]} missing, extra or of another shape")
    model.load_state_dict(fitting, strict=False)
    return fresh


@dataclass(frozen=True)
class Ranks:
    """This process under ``--sp``: ``parallel`` (mesh ``(data, ulysses)``), FSDP2's mesh of every rank, its
    device."""

    parallel: flexsparse.ParallelConfig
    fsdp_mesh: DeviceMesh
    device: torch.device

    @property
    def data_rank(self) -> int:
        return self.parallel.mesh.get_local_rank("data")

    @property
    def data_size(self) -> int:
        return self.parallel.mesh["data"].size()

    @property
    def is_main(self) -> bool:
        return dist.get_rank() == 0


def setup_distributed(args) -> Ranks | None:
    """``--sp``: the process group (from torchrun's environment, NCCL on CUDA, gloo on CPU) unless one exists,
    the ``(world / sp, sp)`` mesh ``(data, ulysses)`` and FSDP2's 1-D mesh of all ranks. ``None`` without ``--sp``."""
    if args.sp is None:
        return None
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        if "WORLD_SIZE" not in os.environ:
            raise RuntimeError("--sp runs under torchrun, e.g. torchrun --nproc-per-node 2 -m examples.dit.train "
                               "--sp 2 ...")
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    world = dist.get_world_size()
    if world % args.sp:
        raise ValueError(f"--sp {args.sp} must divide the world size {world} (the processes torchrun starts)")
    parallel = flexsparse.ParallelConfig.setup(args.sp, device.type)
    return Ranks(parallel, init_device_mesh(device.type, (world,), mesh_dim_names=("fsdp",)), device)


def replicate(model: DiT) -> DiT:
    """``copy.deepcopy`` sharing the model's ``ParallelConfig`` (its process groups) rather than copying it."""
    return copy.deepcopy(model, {id(model.parallel): model.parallel})


def distribute(model: DiT, ranks: Ranks | None) -> DiT:
    """FSDP2 (``fully_shard``) of each block, then of the root (embedders, final layer), over all W = D·P ranks
    (D data-parallel groups of P sequence-parallel ranks): the sequence ranks shard the parameters too. The model
    unchanged without ``--sp``.

    Gradient scale: every rank of a sequence group computes the same loss L_d (the mean over its group's batch) on
    the gathered output; the gather's backward adds up those P identical losses' gradients, so each rank holds P
    times its shard's part of dL_d/dθ. FSDP2 averages over the W ranks:
    (1/(D·P)) Σ_d P·dL_d/dθ = (1/D) Σ_d dL_d/dθ, the gradient of one process on the global batch of D·B samples,
    so the loss needs no extra factor."""
    if ranks is None:
        return model
    for block in model.blocks:
        fully_shard(block, mesh=ranks.fsdp_mesh)
    model.register_forward_hook(lambda module, args, out: out.contiguous())   # FSDP2 warns of a view as output
    fully_shard(model, mesh=ranks.fsdp_mesh)
    return model


def reshard(*modules: torch.nn.Module) -> None:
    """Shard again the parameters FSDP2 leaves whole after a forward without backward (the root's, as after an
    evaluation), so that the EMA update and checkpoints see shards; nothing for modules without FSDP2."""
    for module in modules:
        if isinstance(module, FSDPModule):
            module.reshard()


def shard_like(value: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A whole tensor sharded like ``target`` when that is a DTensor (FSDP2), else ``value``."""
    if not isinstance(target, DTensor):
        return value
    return distribute_tensor(value.to(target.device, target.dtype), target.device_mesh, target.placements)


def full_tensors(state):
    """``state`` (nested dicts and lists) with every DTensor gathered whole: a collective, call it on every rank."""
    if isinstance(state, DTensor):
        return state.full_tensor()
    if isinstance(state, dict):
        return {key: full_tensors(value) for key, value in state.items()}
    if isinstance(state, list):
        return [full_tensors(value) for value in state]
    return state


def load_optimizer(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """``optimizer.load_state_dict`` of a whole (checkpoint) state; the tensors of FSDP2's parameters are sharded
    like them."""
    optimizer.load_state_dict(state)
    for group in optimizer.param_groups:
        for param in group["params"]:
            moments = optimizer.state.get(param, {})
            for name, value in moments.items():
                if isinstance(value, torch.Tensor) and value.shape == param.shape and value.dim():
                    moments[name] = shard_like(value, param)


def mean_over_data(loss: torch.Tensor, ranks: Ranks | None) -> torch.Tensor:
    """The loss averaged over the data-parallel ranks (the global batch's): an all-reduce; ``loss`` without ``--sp``."""
    if ranks is None:
        return loss
    total = loss.detach().clone()
    dist.all_reduce(total, group=ranks.parallel.mesh.get_group("data"))
    return total / ranks.data_size


def any_rank(flag: bool, ranks: Ranks | None) -> bool:
    """Whether ``flag`` holds on any rank (an all-reduce, so every rank decides alike); ``flag`` without ``--sp``."""
    if ranks is None:
        return flag
    value = torch.tensor(float(flag), device=ranks.device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def update_ema(ema: DiT, model: DiT, step: int, max_decay: float) -> None:
    """EMA with warm-up: ``decay = min(max_decay, 1 - (1 + step) ** -0.75)``."""
    decay = min(max_decay, 1 - (1 + step) ** -0.75)
    with torch.no_grad():
        for e, p in zip(ema.parameters(), model.parameters()):
            e.lerp_(p, 1 - decay)


def autocast(device: torch.device, precision: str):
    bf16 = precision == "bf16" or (precision == "auto" and device.type == "cuda")
    return torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()


def training_step(model, optimizer, params, x0, eps, sigma, scale: float, grad_clip: float, amp) -> torch.Tensor:
    """One AdamW step on the flow-matching loss; returns the loss (a 0-dim tensor)."""
    with amp:
        loss = flow_loss(model, x0, eps, sigma, scale)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, grad_clip)
    optimizer.step()
    return loss.detach()


def training_generators(seed: int, step: int, device, data_rank: int = 0) -> tuple[torch.Generator, torch.Generator]:
    """``(crops, noise)`` generators of the training batches from ``step`` on: one stream per data-parallel rank,
    shared by the ranks of its sequence group (rank 0's is a single process's)."""
    stream = data_rank * DATA_STREAM
    return (torch.Generator().manual_seed(seed * 1_000_003 + step + stream),
            torch.Generator(device).manual_seed(seed * 1_000_033 + step + 1 + stream))


def training_batch(images, size: int, batch: int, data_gen, noise_gen, device) -> tuple[torch.Tensor, ...]:
    """Crops ``x0`` and noise ``eps`` ``(batch, 3, size, size)`` and ``sigma (batch,)`` of one step."""
    x0 = random_crops(images, size, batch, data_gen)
    eps = torch.randn(x0.shape, generator=noise_gen, device=device)
    return x0, eps, sample_sigmas(batch, noise_gen)


@torch.no_grad()
def validation_loss(model, val: dict, scale: float, batch: int, amp) -> float:
    """Mean flow loss over the fixed held-out crops, noise and sigmas."""
    total = 0.0
    for start in range(0, val["x0"].shape[0], batch):
        part = slice(start, start + batch)
        with amp:
            loss = flow_loss(model, val["x0"][part], val["eps"][part], val["sigma"][part], scale)
        total += loss.item() * val["x0"][part].shape[0]
    return total / val["x0"].shape[0]


def validation_set(images, size: int, count: int, device) -> dict:
    """Held-out crops with fixed noise and evenly spread sigmas (seeded independently of ``--seed``)."""
    generator = torch.Generator().manual_seed(VAL_SEED)
    x0 = random_crops(images, size, count, generator, flip=False)
    eps = torch.randn(x0.shape, generator=generator)
    return {"x0": x0.to(device), "eps": eps.to(device), "sigma": validation_sigmas(count).to(device)}


def sample_grid(ema: DiT, config: dict, count: int, steps: int, amp, path: Path, write: bool = True) -> Path:
    noise = torch.randn(count, 3, config["image_size"], config["image_size"],
                        generator=torch.Generator().manual_seed(SAMPLE_SEED))
    with amp:
        images = euler_sample(ema, noise.to(next(ema.parameters()).device), config["noise_scale"], steps)
    return save_grid(images, path) if write else path


def new_history() -> dict:
    return {"train_step": [], "train_loss": [], "val_step": [], "val_loss": [], "val_loss_ema": []}


def restore(checkpoint: dict, config: dict, model: DiT, ema: DiT, optimizer) -> tuple[int, dict]:
    """Load a checkpoint's weights and EMA; at the same image size and attention also the optimizer,
    step and history (the run continues), otherwise a new stage starts at step 0. ``(step, history)``."""
    fresh = load_weights(model, checkpoint["model"])
    load_weights(ema, checkpoint["ema"])
    continuing = all(checkpoint["config"][key] == config[key] for key in ("image_size", "attn"))
    print(f"{'continuing' if continuing else 'new stage from'} {config['init_from']} at step {checkpoint['step']}"
          + (f"; freshly initialised: {fresh}" if fresh else ""))
    if not continuing:
        return 0, new_history()
    load_optimizer(optimizer, checkpoint["optimizer"])
    config["init_from"] = checkpoint["config"]["init_from"]
    return checkpoint["step"], checkpoint["history"]


def main(argv=None) -> dict:
    return train(parse_args(argv))


def train(args) -> dict:
    """Run one stage; return its summary (also written to ``summary.json``). Under ``--sp`` every rank runs it
    (validation and sampling too) and a process group it started ends with it."""
    started = args.sp is not None and not dist.is_initialized()
    try:
        return train_stage(args, setup_distributed(args))
    finally:
        if started and dist.is_initialized():
            dist.destroy_process_group()


def train_stage(args, ranks: Ranks | None) -> dict:
    """``train`` on this process's ``ranks`` (``None``: a single process)."""
    device, out = ranks.device if ranks else torch.device(args.device), Path(args.out)
    main_rank = ranks is None or ranks.is_main
    checkpoint = torch.load(args.resume, map_location="cpu") if args.resume else None
    config = run_config(args, checkpoint)
    if ranks:
        config.update(sp=args.sp, data_parallel=ranks.data_size)
    torch.manual_seed(args.seed)
    model = build_model(config, device, ranks and ranks.parallel)
    ema = replicate(model).requires_grad_(False)
    model, ema = distribute(model, ranks), distribute(ema, ranks)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
    step, history = restore(checkpoint, config, model, ema, optimizer) if checkpoint else (0, new_history())
    if main_rank:
        write_json(config, out / "config.json")

    train_images, val_images = photos_and_split(config["data_dir"])
    train_images = [image.to(device) for image in train_images]
    val = validation_set(val_images, config["image_size"], args.val_crops, device)
    data_gen, noise_gen = training_generators(args.seed, step, device, ranks.data_rank if ranks else 0)
    amp = autocast(device, args.precision)
    train_model = torch.compile(model) if args.compile else model
    scale, size, batch = config["noise_scale"], config["image_size"], args.batch_size
    pixels_per_step = batch * (ranks.data_size if ranks else 1) * size * size

    def evaluate():
        history["val_step"].append(step)
        history["val_loss"].append(validation_loss(model, val, scale, batch, amp))
        history["val_loss_ema"].append(validation_loss(ema, val, scale, batch, amp))
        reshard(model, ema)
        if main_rank:
            write_json(history, out / "history.json")
            plot_losses(history, out / "loss.png", title=f"{size}x{size}, attn {config['attn']['method']}")

    def save():
        path = out / "checkpoints" / "last.pt"
        weights = {"model": model.state_dict(), "ema": ema.state_dict(), "optimizer": optimizer.state_dict()}
        weights = full_tensors(weights) if ranks else weights
        if main_rank:
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save({**weights, "step": step, "config": config, "history": history}, path)
        return path

    if step == 0:
        evaluate()
    step_times = []
    progress = tqdm(total=args.steps, initial=step, disable=args.quiet or not main_rank,
                    desc=f"{size}px {config['attn']['method']}")
    while step < args.steps:
        if args.budget is not None and any_rank(sum(step_times) > args.budget, ranks):
            print(f"stopping at step {step}: --budget {args.budget}s reached")
            break
        tick = time.perf_counter()
        x0, eps, sigma = training_batch(train_images, size, batch, data_gen, noise_gen, device)
        loss = training_step(train_model, optimizer, params, x0, eps, sigma, scale, args.grad_clip, amp)
        loss = mean_over_data(loss, ranks).item()
        update_ema(ema, model, step, args.ema_decay)
        step_times.append(time.perf_counter() - tick)
        step += 1
        history["train_step"].append(step)
        history["train_loss"].append(loss)
        if not math.isfinite(loss):
            raise FloatingPointError(f"training loss became {loss} at step {step}")
        progress.update(1)
        progress.set_postfix(loss=f"{loss:.4f}", tok_s=f"{pixels_per_step / step_times[-1]:.3g}")
        if step % args.val_every == 0 or step == args.steps:
            evaluate()
        if step % args.sample_every == 0:
            sample_grid(ema, config, args.samples, args.sample_steps, amp, out / "samples" / f"step_{step:06d}.png",
                        write=main_rank)
            reshard(ema)
        if step % args.ckpt_every == 0:
            save()
    progress.close()
    if not history["val_step"] or history["val_step"][-1] != step:
        evaluate()
    timed = step_times[len(step_times) // 5:] or step_times       # leave out warm-up (and compilation)
    summary = {"method": config["attn"]["method"], "attn": config["attn"], "image_size": size, "steps": step,
               "final_val_loss": history["val_loss"][-1], "final_val_loss_ema": history["val_loss_ema"][-1],
               "tokens_per_s": pixels_per_step * len(timed) / sum(timed) if timed else None,
               "train_seconds": sum(step_times), "checkpoint": str(save()),
               "samples": str(sample_grid(ema, config, args.samples, args.sample_steps, amp,
                                          out / "samples" / "final.png", write=main_rank)),
               "loss_curve": str(out / "loss.png")}
    if main_rank:
        write_json(summary, out / "summary.json")
    return summary


if __name__ == "__main__":
    main()
