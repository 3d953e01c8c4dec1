"""What a run writes: sample grids (PNG), the loss curve (PNG), JSON files."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
from PIL import Image


def save_grid(images: torch.Tensor, path: Path, columns: int | None = None) -> Path:
    """Images ``(B, 3, S, S)`` in ``[-1, 1]`` as one PNG grid (2-pixel gaps)."""
    batch, _, size, _ = images.shape
    columns = columns or math.ceil(math.sqrt(batch))
    rows = math.ceil(batch / columns)
    pixels = ((images.detach().float().cpu().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    grid = torch.full((3, rows * (size + 2) + 2, columns * (size + 2) + 2), 255, dtype=torch.uint8)
    for i, image in enumerate(pixels):
        top, left = 2 + (i // columns) * (size + 2), 2 + (i % columns) * (size + 2)
        grid[:, top:top + size, left:left + size] = image
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.ascontiguousarray(grid.permute(1, 2, 0).numpy())).save(path)
    return path


def plot_losses(history: dict, path: Path, title: str = "") -> Path:
    """Training loss (raw and running mean) and validation losses against the step, log scale."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    steps, losses = history["train_step"], history["train_loss"]
    if steps:
        ax.plot(steps, losses, color="0.8", lw=0.8, label="train (per step)")
        window = max(1, len(losses) // 50)
        smooth = np.convolve(losses, np.ones(window) / window, mode="valid")
        ax.plot(steps[window - 1:], smooth, color="C0", label=f"train (mean of {window})")
    for key, color in (("val_loss", "C1"), ("val_loss_ema", "C2")):
        if history["val_step"]:
            ax.plot(history["val_step"], history[key], "o-", color=color, ms=3, label=key.replace("_", " "))
    ax.set_xlabel("step")
    ax.set_ylabel("flow-matching loss")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_json(data, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path
