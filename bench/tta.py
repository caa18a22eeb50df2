"""Test-time augmentation: does averaging a few views of each image pay for its cost? Side by side in one run.

For a trained run, each image of each labeled collection is embedded as the evaluation view alone
(what `retrieval index` and `evaluate` do), and as the unit mean of several views of it: "scales"
(the evaluation view, a 1.125x zoom-in and a 0.9x zoom-out on white) and "crops" (the evaluation view
and the four corner crops of a 1.125x zoom-in). The table gives leave-one-out recall@1, recall@5 and
MAP@R per collection, and the embedding time against the evaluation view alone (every query and
every gallery image would pay it).

    python bench/tta.py RUN IMAGES [IMAGES ...]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from rich.console import Console
from rich.table import Table

from retrieval.data import load_collection, load_image
from retrieval.metrics import retrieval_metrics
from retrieval.preprocess import Preprocessing, resize_and_crop
from retrieval.runs import RunDir
from training.augment import WHITE
from training.checkpoints import load_encoder


def zoom(image: Image.Image, size: int, factor: float) -> Image.Image:
    """The image resized to factor x size: centre-cropped to size when larger, centred on white when smaller."""
    scaled = resize_and_crop(image, round(size * factor))
    if scaled.width >= size:
        return resize_and_crop(scaled, size)
    canvas = Image.new("RGB", (size, size), WHITE)
    canvas.paste(scaled, ((size - scaled.width) // 2, (size - scaled.height) // 2))
    return canvas


def corners(image: Image.Image, size: int) -> list[Image.Image]:
    """The four size x size corner crops of the image zoomed in by 1.125."""
    big = resize_and_crop(image, round(size * 1.125))
    edge = big.width - size
    return [big.crop((x, y, x + size, y + size)) for x in (0, edge) for y in (0, edge)]


VIEWS: dict[str, Callable[[Image.Image, int], list[Image.Image]]] = {
    "evaluation view": lambda image, size: [resize_and_crop(image, size)],
    "scales": lambda image, size: [resize_and_crop(image, size), zoom(image, size, 1.125), zoom(image, size, 0.9)],
    "crops": lambda image, size: [resize_and_crop(image, size), *corners(image, size)],
}


def embed(model: torch.nn.Module, preprocessing: Preprocessing, images: list[Image.Image], views: str, batch: int = 64) -> tuple[np.ndarray, int, float]:
    """The unit mean embedding of each image's views, the number of views per image, and the seconds it took."""
    make = VIEWS[views]
    vectors = []
    started = time.perf_counter()
    with torch.no_grad():
        for start in range(0, len(images), batch):
            chunk = images[start : start + batch]
            per_image = [make(image, preprocessing.image_size) for image in chunk]
            inputs = torch.from_numpy(np.stack([preprocessing.normalise(view) for views_of in per_image for view in views_of]))
            embeddings = model(inputs).reshape(len(chunk), len(per_image[0]), -1).mean(dim=1)
            vectors.append(torch.nn.functional.normalize(embeddings, dim=1).numpy())
    return np.concatenate(vectors), len(per_image[0]), time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path)
    parser.add_argument("images", nargs="+", help="labeled collections (folders or CSVs), each scored leave-one-out")
    args = parser.parse_args()
    model, config = load_encoder(RunDir(args.run))
    preprocessing = config.preprocessing
    table = Table(title=f"test-time augmentation, {args.run} (leave-one-out; time: embedding every image, against the evaluation view)")
    for column in ("images", "views", "n views", "recall@1", "recall@5", "map@r", "embed s", "cost"):
        table.add_column(column)
    for source in args.images:
        items = load_collection(source).items
        images = [load_image(item.path) for item in items]
        labels = [item.label for item in items]
        baseline = None
        for views in VIEWS:
            vectors, count, seconds = embed(model, preprocessing, images, views)
            baseline = baseline or seconds
            metrics = retrieval_metrics(vectors, labels, ks=(1, 5))
            table.add_row(Path(source).name, views, str(count), *(f"{metrics[key]:.3f}" for key in ("recall@1", "recall@5", "map@r")), f"{seconds:.1f}", f"{seconds / baseline:.1f}x")
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
