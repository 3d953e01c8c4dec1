"""Save the q, k, v that one attention layer of a trained DiT receives on the held-out crops (fixed noise and
sigmas, EMA weights), for ``benchmarks/gpu_fp8.py --qkv`` (FP8 error on real attention inputs), or a compact
fixture that rebuilds them (``--fixture``: the tests' real attention inputs).

    python -m examples.dit.record_qkv runs/dit/checkpoints/last.pt --layer 3 --out dit_qkv.pt
    python -m examples.dit.record_qkv runs/dit/checkpoints/last.pt --layer 1 --crops 1 --fixture --out layer.pt

Writes ``{"q", "k", "v"}`` ``(B, H, N, D)`` (float32, on the CPU) plus the checkpoint's config and the layer's name;
with ``--fixture`` the EMA weights of the blocks up to ``--layer`` in bf16 with the crops, their noise and sigmas
(a few MB where the q, k, v of a 128x128 crop take 38), which ``fixture_qkv`` runs to record the same layer.
"""
from __future__ import annotations

import argparse

import torch

from flexsparse.training import QKVRecorder

from . import train
from .data import photos_and_split
from .flow import flow_loss


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m examples.dit.record_qkv", description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", help="a checkpoint of examples.dit.train (its last.pt)")
    p.add_argument("--layer", type=int, default=None, help="block index (default: the middle block)")
    p.add_argument("--crops", type=int, default=4, help="held-out crops, one batch")
    p.add_argument("--fixture", action="store_true", help="write the compact fixture instead of q, k, v")
    p.add_argument("--out", default="dit_qkv.pt")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return p.parse_args(argv)


def held_out(config: dict, crops: int, device: torch.device) -> dict:
    """The run's first ``crops`` validation crops with their fixed noise and sigmas (``train.validation_set``)."""
    _, val_images = photos_and_split(config["data_dir"])
    return train.validation_set(val_images, config["image_size"], crops, device)


def load_ema(saved: dict, device: torch.device):
    """The EMA model of a checkpoint (or fixture) dict."""
    model = train.build_model(saved["config"], device)
    train.load_weights(model, {name: value.float() for name, value in saved["ema"].items()})
    return model.eval()


@torch.no_grad()
def record_layer(model, layer: int, val: dict, noise_scale: float) -> dict:
    """q, k, v ``(B, H, N, D)`` float32 (CPU) of block ``layer`` in one validation loss pass over ``val``."""
    if not 0 <= layer < len(model.blocks):
        raise ValueError(f"--layer must be in [0, {len(model.blocks)}), got {layer}")
    with QKVRecorder(model, layers=f"blocks.{layer}.*", max_batches=1, device="cpu", dense=False) as recorder:
        flow_loss(model, val["x0"], val["eps"], val["sigma"], noise_scale)
    (name, calls), = recorder.records.items()
    return {"q": calls[0].q.float(), "k": calls[0].k.float(), "v": calls[0].v.float(), "layer": name}


def record(checkpoint: str, layer: int | None, crops: int, device: torch.device) -> dict:
    """q, k, v of block ``layer`` (default: the middle one) of the checkpoint's EMA model on ``crops`` held-out
    crops."""
    saved = torch.load(checkpoint, map_location="cpu")
    config = saved["config"]
    model = load_ema(saved, device)
    layer = len(model.blocks) // 2 if layer is None else layer
    return {**record_layer(model, layer, held_out(config, crops, device), config["noise_scale"]), "config": config}


def fixture(checkpoint: str, layer: int, crops: int) -> dict:
    """The compact stand-in for ``record(checkpoint, layer, crops, cpu)``: the EMA weights of blocks 0..layer and
    the model's input and output layers (bf16), the held-out crops, noise (bf16) and sigmas."""
    saved = torch.load(checkpoint, map_location="cpu")
    config = saved["config"]
    if not 0 <= layer < config["depth"]:
        raise ValueError(f"--layer must be in [0, {config['depth']}), got {layer}")
    kept = {name: value.to(torch.bfloat16) for name, value in saved["ema"].items()
            if not name.startswith("blocks.") or int(name.split(".")[1]) <= layer}
    val = held_out(config, crops, torch.device("cpu"))
    return {"config": {**config, "depth": layer + 1}, "ema": kept, "layer": layer, "x0": val["x0"].to(torch.bfloat16),
            "eps": val["eps"].to(torch.bfloat16), "sigma": val["sigma"]}


def fixture_qkv(path, device: torch.device) -> dict:
    """q, k, v (float32, CPU) of the layer a ``fixture`` file was made for, recorded on ``device``."""
    saved = torch.load(path, map_location="cpu")
    val = {name: saved[name].float().to(device) for name in ("x0", "eps", "sigma")}
    return record_layer(load_ema(saved, device), saved["layer"], val, saved["config"]["noise_scale"])


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.fixture:
        if args.layer is None:
            raise ValueError("--fixture needs --layer")
        result = fixture(args.checkpoint, args.layer, args.crops)
        what = f"blocks 0..{args.layer}, {len(result['ema'])} tensors"
    else:
        result = record(args.checkpoint, args.layer, args.crops, torch.device(args.device))
        what = f"{result['layer']}: q {tuple(result['q'].shape)}"
    torch.save(result, args.out)
    print(f"{what} -> {args.out}")
    return result


if __name__ == "__main__":
    main()
