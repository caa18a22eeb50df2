"""Embedding and indexing speed, and indexing memory, measured side by side in one run.

1. Encoder throughput of ONNX Runtime (float32, and the int8 model of `retrieval export --int8`:
   static QDQ quantisation calibrated on 300 of the images) against PyTorch eager for the same encoder
   (freshly initialised: speed does not depend on the weights) at batch sizes 1, 32, 64 and 128.
2. End-to-end `build_index` (read, hash, decode, preprocess, embed, journal, commit) against the
   encoder alone on the same images, with each model: the ratio shows how well decoding is hidden
   behind inference.
3. Peak memory of `retrieval index` on galleries of two sizes, each in its own process.

    python bench/embed.py [--backbone resnet18] [--image-size 64] [--small 2000] [--large 10000] [--fp16]

On a machine with CUDA, ONNX Runtime runs on the CUDA execution provider and PyTorch on the GPU;
--fp16 exports the float16 model and runs PyTorch in float16 too.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# run as `python bench/embed.py`, bench/index.py would hide the `index` package
sys.path = [entry for entry in sys.path if Path(entry or ".").resolve() != Path(__file__).resolve().parent]

import numpy as np  # noqa: E402
import torch  # noqa: E402
from rich.console import Console
from rich.table import Table

from index.build import build_index
from retrieval.data import load_collection, load_image
from retrieval.datasets import icons
from retrieval.embedders import OnnxEmbedder
from retrieval.runs import RunDir, write_json
from training.config import TrainConfig
from training.exporting import export
from training.model import Encoder
from training.checkpoints import save_checkpoint
from training.quantise import quantise

# VmHWM, not ru_maxrss: Linux carries ru_maxrss over from the parent across fork and exec
PEAK_MEMORY = """
import sys
from retrieval.commands import main
code = main(sys.argv[1:])
peak = next(line for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(f"PEAK_RSS_KIB={peak.split()[1]}")
sys.exit(code)
"""


def best_seconds(work, repeats: int) -> float:
    """Returns the fastest wall time of several runs of work()."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return min(times)


def make_gallery(source: Path, target: Path, count: int) -> Path:
    """Copies the icons of source under new names until target holds count images."""
    files = sorted(source.rglob("*.png"))
    for n in range(count):
        original = files[n % len(files)]
        copy = target / original.parent.name / f"{n // len(files)}-{original.name}"
        copy.parent.mkdir(parents=True, exist_ok=True)
        copy.write_bytes(original.read_bytes())
    return target


def peak_rss_mib(run: Path, gallery: Path, index: Path) -> float:
    done = subprocess.run([sys.executable, "-c", PEAK_MEMORY, "index", str(run), str(gallery), "--index", str(index)], capture_output=True, text=True, check=True)
    return int(done.stdout.split("PEAK_RSS_KIB=")[1].split()[0]) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backbone", default="resnet18")
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--small", type=int, default=2000)
    parser.add_argument("--large", type=int, default=10000)
    parser.add_argument("--fp16", action="store_true", help="float16 model for ONNX Runtime and PyTorch")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.float16 if args.fp16 else torch.float32
    console = Console()
    source = icons() / "test"
    config = TrainConfig(data=str(source), backbone=args.backbone, image_size=args.image_size)

    with tempfile.TemporaryDirectory() as scratch:
        run = RunDir(Path(scratch) / "run")
        torch.manual_seed(0)
        model = Encoder(config.backbone, config.embedding_dim).eval()
        write_json(run.config, config.to_dict())
        save_checkpoint(run.last_checkpoint, model, {})
        export(run, float16=args.fp16)
        embedder = OnnxEmbedder.from_run(run)
        int8_path = Path(scratch) / "model.int8.onnx"
        quantise(embedder, load_collection(source).items[:300], int8_path)
        int8 = OnnxEmbedder(int8_path, {**embedder.card, "precision": "int8"})
        model = model.to(device, dtype)
        providers = ", ".join(embedder.session.get_providers())

        title = f"encoder throughput, {args.backbone} at {args.image_size}px, {'float16' if args.fp16 else 'float32'}, torch on {device}, ONNX Runtime on {providers}"
        table = Table(title=f"{title} ({torch.get_num_threads()} CPU threads; images/s)")
        for column in ("batch", "PyTorch eager", "ONNX Runtime", "ONNX Runtime / PyTorch", "ORT int8", "int8 / PyTorch", "int8 / ORT float32"):
            table.add_column(column, justify="right")
        for batch_size in (1, 32, 64, 128):
            batch = np.random.default_rng(batch_size).standard_normal((batch_size, 3, args.image_size, args.image_size)).astype(np.float32)
            steps = max(1, 256 // batch_size)

            def run_torch() -> None:
                with torch.inference_mode():
                    for _ in range(steps):
                        model(torch.from_numpy(batch).to(device, dtype)).cpu()

            def run_onnx(session: OnnxEmbedder = embedder) -> None:
                for _ in range(steps):
                    session.embed_prepared(batch)

            torch_rate = steps * batch_size / best_seconds(run_torch, args.repeats)
            onnx_rate = steps * batch_size / best_seconds(run_onnx, args.repeats)
            int8_rate = steps * batch_size / best_seconds(lambda: run_onnx(int8), args.repeats)
            table.add_row(str(batch_size), f"{torch_rate:,.0f}", f"{onnx_rate:,.0f}", f"{onnx_rate / torch_rate:.2f}x", f"{int8_rate:,.0f}", f"{int8_rate / torch_rate:.2f}x", f"{int8_rate / onnx_rate:.2f}x")
        console.print(table)

        gallery = make_gallery(source, Path(scratch) / "gallery", args.small)
        collection = load_collection(gallery)
        prepared = [embedder.prepare([load_image(item.path) for item in collection.items[i : i + embedder.batch_size]]) for i in range(0, len(collection.items), embedder.batch_size)]
        n = len(collection.items)
        table = Table(title=f"indexing {n:,} images (batch {embedder.batch_size})")
        for column in ("model", "path", "images/s", "vs encoder only"):
            table.add_column(column, justify="right")
        for name, session in (("float32", embedder), ("int8", int8)):
            encoder_only = best_seconds(lambda: [session.embed_prepared(batch) for batch in prepared], args.repeats)
            end_to_end = best_seconds(lambda: build_index(session, collection, Path(scratch) / f"index-{name}", rebuild=True, progress=False), args.repeats)
            table.add_row(name, "encoder only (prepared batches)", f"{n / encoder_only:,.0f}", "1.00x")
            table.add_row(name, "build_index end to end", f"{n / end_to_end:,.0f}", f"{encoder_only / end_to_end:.2f}x")
        console.print(table)

        large = make_gallery(source, Path(scratch) / "large", args.large)
        table = Table(title="peak memory of `retrieval index` (own process)")
        for column in ("images", "peak RSS MiB"):
            table.add_column(column, justify="right")
        for count, folder in ((args.small, gallery), (args.large, large)):
            table.add_row(f"{count:,}", f"{peak_rss_mib(run.root, folder, Path(scratch) / f'index-{count}'):,.0f}")
        console.print(table)
    print(f"numpy {np.__version__}, torch {torch.__version__}")


if __name__ == "__main__":
    main()
