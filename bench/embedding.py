"""Embedding throughput: ONNX Runtime (the search side) against PyTorch eager (the training side).

Both run the same encoder (freshly initialised: speed does not depend on the weights) on the same
preprocessed images of the embedded icons test split, in one process, and the table reports each
one's images per second and the ratio. Decoding + preprocessing is timed on its own.

    python bench/embedding.py [--backbone resnet18] [--image-size 64] [--batch-size 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from retrieval.data import load_collection, load_image
from retrieval.datasets import icons
from retrieval.embedders import OnnxEmbedder
from retrieval.runs import RunDir, write_json
from training.config import TrainConfig
from training.export import export
from training.model import Encoder
from training.train import save_checkpoint


def best_rate(work, count: int, repeats: int) -> float:
    """Returns items per second of the fastest of several runs of work()."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return count / min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backbone", default="resnet18")
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    paths = [item.path for item in load_collection(icons() / "test").items]
    config = TrainConfig(data=str(icons() / "test"), backbone=args.backbone, image_size=args.image_size)
    with tempfile.TemporaryDirectory() as scratch:
        run = RunDir(Path(scratch))
        torch.manual_seed(0)
        model = Encoder(config.backbone, config.embedding_dim).eval()
        write_json(run.config, config.to_dict())
        save_checkpoint(run.last_checkpoint, model, {})
        export(run)
        embedder = OnnxEmbedder.from_run(run)

        images = [load_image(path) for path in paths]
        batches = [config.preprocessing(images[i : i + args.batch_size]) for i in range(0, len(images), args.batch_size)]

        def run_onnx() -> None:
            for batch in batches:
                embedder.session.run(None, {embedder.input_name: batch})

        def run_torch() -> None:
            with torch.inference_mode():
                for batch in batches:
                    model(torch.from_numpy(batch))

        def decode() -> None:
            config.preprocessing([load_image(path) for path in paths])

        rates = {
            "decode + preprocess (Pillow/numpy)": best_rate(decode, len(paths), args.repeats),
            "encoder, PyTorch eager": best_rate(run_torch, len(paths), args.repeats),
            "encoder, ONNX Runtime": best_rate(run_onnx, len(paths), args.repeats),
        }

    baseline = rates["encoder, PyTorch eager"]
    table = Table(title=f"embedding throughput: {len(paths)} icons, {args.backbone} at {args.image_size}px, batch {args.batch_size}, {torch.get_num_threads()} threads")
    table.add_column("stage")
    table.add_column("images/s", justify="right")
    table.add_column("vs PyTorch eager", justify="right")
    for name, rate in rates.items():
        table.add_row(name, f"{rate:,.0f}", f"{rate / baseline:.2f}x")
    Console().print(table)
    print(f"numpy {np.__version__}, torch {torch.__version__}")


if __name__ == "__main__":
    main()
