"""Peak memory and time of validation during training on a large held-out split (training.validation.Validator).

Makes --images JPEGs (256 px, seeded noise and shapes, 20 labels) in --work once, then runs, each in a
fresh process so that its peak resident memory is its own: building the Validator at --size px
(decoding every image) and one validation pass, with a stand-in encoder (average pooling and a
linear map: the encoder's own cost is the same either way and is left out). Rows: the default
(pixels kept in memory while they fit the budget) and, where the code has it, the budget set to 0
(decoded again each epoch). Run it against another checkout with PYTHONPATH=that checkout.

    python bench/validation_memory.py [--images 10000] [--size 224] [--work /tmp/validation_memory]
"""

from __future__ import annotations

import argparse
import inspect
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw


def make_images(folder: Path, count: int) -> list[Path]:
    """count seeded 256-px JPEGs under folder/<label>/ (made once)."""
    paths = [folder / f"c{n % 20:02d}" / f"{n:05d}.jpg" for n in range(count)]
    if all(path.is_file() for path in paths):
        return paths
    rng = np.random.default_rng(0)
    for n, path in enumerate(paths):
        path.parent.mkdir(parents=True, exist_ok=True)
        image = Image.fromarray(rng.integers(0, 255, (256, 256, 3), dtype=np.uint8))
        ImageDraw.Draw(image).ellipse((20 + n % 50, 30, 200, 180 + n % 60), fill=(n % 255, 40, 200))
        image.save(path, quality=85)
    return paths


def measure(folder: Path, count: int, size: int, memory: int | None) -> dict:
    """In this process: build the Validator and validate once; seconds of each and the peak resident memory."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    from retrieval.data import load_collection
    from retrieval.preprocess import Preprocessing
    from training.validation import Validator

    class StandIn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(3 * 8 * 8, 64)

        def embed_and_project(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            features = self.linear(F.adaptive_avg_pool2d(images, 8).flatten(1))
            return F.normalize(features, dim=1), F.normalize(features[:, :32], dim=1)

    torch.manual_seed(0)  # the same stand-in in every row: the same scores
    items = load_collection(folder).items[:count]
    options = {} if memory is None else {"memory": memory}
    started = time.perf_counter()
    validator = Validator(items, Preprocessing(size), torch.device("cpu"), **options)
    built = time.perf_counter() - started
    started = time.perf_counter()
    scores = validator(StandIn())
    return {
        "build_s": round(built, 1),
        "validate_s": round(time.perf_counter() - started, 1),
        "peak_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "recall@1": round(scores["recall@1"], 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=10_000)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--work", type=Path, default=Path("/tmp/validation_memory"))
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # a row, run in its own process
    args = parser.parse_args()
    folder = args.work / "images"
    if args.child is not None:
        print(json.dumps(measure(folder, args.images, args.size, None if args.child == "default" else int(args.child))))
        return
    make_images(folder, args.images)
    from training.validation import Validator

    rows = ["default"] + (["0"] if "memory" in inspect.signature(Validator).parameters else [])
    for row in rows:
        command = [sys.executable, __file__, "--images", str(args.images), "--size", str(args.size)]
        output = subprocess.run([*command, "--work", str(args.work), "--child", row], capture_output=True, text=True)
        if output.returncode:
            sys.exit(output.stderr)
        label = "pixels kept (default budget)" if row == "default" else "budget 0: decoded each epoch"
        print(f"{label}: {output.stdout.strip()}", flush=True)


if __name__ == "__main__":
    main()
