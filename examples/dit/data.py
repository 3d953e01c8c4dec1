"""Training images: photographs that ship inside the scikit-image and scikit-learn wheels (read from
the installed packages, nothing is downloaded) or a folder of the user's images, as random square
crops; held-out images give the fixed validation crops.

Images are uint8 tensors ``(3, H, W)``; crops are float ``(B, 3, S, S)`` in ``[-1, 1]``.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

# Photographs in the wheels (color, and grayscale ones as RGB; texture patches left out):
# package -> files under the package folder.
BUNDLED = {
    "skimage": ["data/astronaut.png", "data/chelsea.png", "data/coffee.png", "data/hubble_deep_field.jpg",
                "data/ihc.png", "data/motorcycle_left.png", "data/motorcycle_right.png", "data/retina.jpg",
                "data/rocket.jpg", "data/camera.png", "data/moon.png", "data/coins.png"],
    "sklearn": ["datasets/images/china.jpg", "datasets/images/flower.jpg"],
}
HELD_OUT = ("coffee", "flower")           # bundled photographs kept for validation only
EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".webp", ".tif", ".tiff")


def read_image(path: Path) -> torch.Tensor:
    """An image file as uint8 ``(3, H, W)`` RGB."""
    with Image.open(path) as image:
        return torch.from_numpy(np.asarray(image.convert("RGB")).copy()).permute(2, 0, 1)


def bundled_photos() -> dict[str, torch.Tensor]:
    """``{name: (3, H, W) uint8}`` of the photographs in the installed scikit-image/scikit-learn
    (located without importing them)."""
    photos = {}
    for package, files in BUNDLED.items():
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            continue
        root = Path(list(spec.submodule_search_locations)[0])
        for file in files:
            if (root / file).is_file():
                photos[Path(file).stem] = read_image(root / file)
    if not photos:
        raise FileNotFoundError("no bundled photographs: pip install scikit-image scikit-learn "
                                "(or pass --data-dir with your own images)")
    return photos


def folder_images(folder: str | Path) -> dict[str, torch.Tensor]:
    """``{relative path: (3, H, W) uint8}`` of the image files under ``folder`` (recursive, sorted)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"--data-dir {str(folder)!r} is not a folder")
    files = sorted(p for p in folder.rglob("*") if p.suffix.lower() in EXTENSIONS)
    if len(files) < 2:
        raise ValueError(f"--data-dir {str(folder)!r} needs at least 2 images (one is held out), found {len(files)}")
    return {str(p.relative_to(folder)): read_image(p) for p in files}


def split(images: dict[str, torch.Tensor], held_out: tuple[str, ...] | None = None):
    """``(train, validation)`` lists of images: the ``held_out`` names, or by default every 10th image
    (the first, the 11th, ...) for validation."""
    names = list(images)
    if held_out is None:
        held_out = tuple(names[::10])
    train = [images[n] for n in names if n not in held_out]
    validation = [images[n] for n in names if n in held_out]
    if not train or not validation:
        raise ValueError(f"need training and held-out images, got {len(train)} and {len(validation)}")
    return train, validation


def photos_and_split(data_dir: str | None):
    """Training and held-out images from ``data_dir`` or, without one, the bundled photographs."""
    if data_dir:
        return split(folder_images(data_dir))
    return split(bundled_photos(), HELD_OUT)


def random_crops(images: list[torch.Tensor], size: int, count: int, generator: torch.Generator,
                 flip: bool = True) -> torch.Tensor:
    """``count`` random square crops ``(count, 3, size, size)`` in ``[-1, 1]``: a random image, a random
    side between ``size`` and the image's short side, resized to ``size`` (antialiased), optionally
    flipped left-right."""
    crops = []
    for _ in range(count):
        image = images[_randint(0, len(images), generator)]
        short = min(image.shape[1:])
        side = _randint(min(size, short), short + 1, generator)
        top = _randint(0, image.shape[1] - side + 1, generator)
        left = _randint(0, image.shape[2] - side + 1, generator)
        crop = image[:, top:top + side, left:left + side].float().unsqueeze(0)
        if side != size:
            crop = F.interpolate(crop, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
        if flip and _randint(0, 2, generator):
            crop = crop.flip(-1)
        crops.append(crop)
    return (torch.cat(crops) / 127.5 - 1).clamp(-1, 1)


def _randint(low: int, high: int, generator: torch.Generator) -> int:
    return int(torch.randint(low, high, (), generator=generator))
