"""Save the q, k, v that one attention layer of a trained DiT receives on the held-out crops (fixed noise and
sigmas, EMA weights), for ``benchmarks/gpu_fp8.py --qkv`` (FP8 error on real attention inputs).

    python -m examples.dit.record_qkv runs/dit/checkpoints/last.pt --layer 3 --out dit_qkv.pt

Writes ``{"q", "k", "v"}`` ``(B, H, N, D)`` (float32, on the CPU) plus the checkpoint's config and the layer's name.
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
    p.add_argument("--out", default="dit_qkv.pt")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return p.parse_args(argv)


@torch.no_grad()
def record(checkpoint: str, layer: int | None, crops: int, device: torch.device) -> dict:
    """q, k, v of block ``layer`` of the checkpoint's EMA model on ``crops`` held-out crops."""
    saved = torch.load(checkpoint, map_location="cpu")
    config = saved["config"]
    model = train.build_model(config, device)
    train.load_weights(model, saved["ema"])
    model.eval()
    layer = len(model.blocks) // 2 if layer is None else layer
    if not 0 <= layer < len(model.blocks):
        raise ValueError(f"--layer must be in [0, {len(model.blocks)}), got {layer}")
    _, val_images = photos_and_split(config["data_dir"])
    val = train.validation_set(val_images, config["image_size"], crops, device)
    name = f"blocks.{layer}.*"
    with QKVRecorder(model, layers=name, max_batches=1, device="cpu", dense=False) as recorder:
        flow_loss(model, val["x0"], val["eps"], val["sigma"], config["noise_scale"])
    (calls,) = recorder.records.values()
    qkv = calls[0]
    return {"q": qkv.q.float(), "k": qkv.k.float(), "v": qkv.v.float(), "config": config,
            "layer": next(iter(recorder.records))}


def main(argv=None) -> dict:
    args = parse_args(argv)
    result = record(args.checkpoint, args.layer, args.crops, torch.device(args.device))
    torch.save(result, args.out)
    print(f"{result['layer']}: q {tuple(result['q'].shape)} -> {args.out}")
    return result


if __name__ == "__main__":
    main()
