"""Embedding and indexing speed, and indexing memory, measured side by side in one run.

1. Encoder throughput of ONNX Runtime (float32, and the int8 model of `retrieval export --int8`:
   static QDQ quantisation calibrated on 300 of the images) against PyTorch eager for the same encoder
   (freshly initialised: speed does not depend on the weights) at batch sizes 1, 32, 64 and 128.
2. End-to-end `build_index` (read, hash, decode, preprocess, embed, journal, commit) against the
   encoder alone on the same images, with each model, in alternating rounds: the ratio shows how well
   decoding is hidden behind inference. Two galleries: the icons (64 px PNG) and the same pictures as
   --jpeg px JPEGs, decoded at a reduced DCT scale (the default) and at full size, with how close the two
   decodings' embeddings are. Before it, reading, decoding and preparing the same images without a model, on one
   thread and on one per core: whether the decoding of the pipelines can run in parallel; and writing the
   indexing journal (index.journal) with SQLite pages of 4 KiB (SQLite's default) and of PAGE_SIZE.
3. Peak memory of `retrieval index` on galleries of two sizes, each in its own process.

    python bench/embed.py [--backbone resnet18] [--image-size 64] [--small 2000] [--large 10000] [--jpeg 256] [--fp16]

On a machine with CUDA, ONNX Runtime runs on the CUDA execution provider and PyTorch on the GPU;
--fp16 exports the float16 model and runs PyTorch in float16 too.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# run as `python bench/embed.py`, bench/index.py would hide the `index` package
sys.path = [entry for entry in sys.path if Path(entry or ".").resolve() != Path(__file__).resolve().parent]

import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image
from rich.console import Console
from rich.table import Table

import index.journal
from index.build import build_index
from index.journal import PAGE_SIZE, Journal
from retrieval.data import Item, decode_image, load_collection, load_image, read_image_bytes
from retrieval.datasets import icons
from retrieval.embedders import OnnxEmbedder, embed_items
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


def make_gallery(source: Path, target: Path, count: int, jpeg: int = 0, png: int = 0) -> Path:
    """Copies the icons of source under new names until target holds count images; jpeg=S: each one enlarged
    to S x S pixels and saved as a JPEG (quality 90), the shape of a gallery of photos; png=S: enlarged and saved
    as a PNG (a larger picture to decode, the same Python work around it)."""
    files = sorted(source.rglob("*.png"))
    side = jpeg or png
    for n in range(count):
        original = files[n % len(files)]
        copy = target / original.parent.name / f"{n // len(files)}-{original.stem}.{'jpg' if jpeg else 'png'}"
        copy.parent.mkdir(parents=True, exist_ok=True)
        if side:
            load_image(original).resize((side, side), Image.Resampling.BICUBIC).save(copy, quality=90)
        else:
            copy.write_bytes(original.read_bytes())
    return target


def indexing_table(
    gallery: Path, photos: Path, models: dict[str, OnnxEmbedder], scratch: Path, args: argparse.Namespace
) -> Table:
    """build_index end to end against the encoder alone on the same images, for each model and gallery, in
    --repeats alternating rounds (medians); on the JPEG gallery also with full-size decoding (no draft), and
    how close the reduced-scale decoding's embeddings are to the full-size ones."""
    rows = []
    for name, session in models.items():
        for label, folder, draft in (
            ("PNG 64 px", gallery, True),
            (f"JPEG {args.jpeg} px", photos, True),
            (f"JPEG {args.jpeg} px, full-size decode", photos, False),
        ):
            collection = load_collection(folder)
            prepared = [
                session.prepare([load_image(item.path) for item in collection.items[i : i + session.batch_size]])
                for i in range(0, len(collection.items), session.batch_size)
            ]
            rows.append((name, label, session, collection, prepared, draft))
    encoder, end_to_end = ({row[:2]: [] for row in rows} for _ in range(2))
    for _ in range(args.repeats):
        for name, label, session, collection, prepared, draft in rows:
            encoder[name, label].append(best_seconds(lambda: [session.embed_prepared(batch) for batch in prepared], 1))
            session.input_size = session.preprocessing.image_size if draft else 0
            end_to_end[name, label].append(
                best_seconds(
                    lambda: build_index(session, collection, scratch / "index-bench", rebuild=True, progress=False), 1
                )
            )
            session.input_size = session.preprocessing.image_size
    table = Table(
        title=f"indexing {len(rows[0][3].items):,} images (batch {rows[0][2].batch_size}; medians of {args.repeats} alternating rounds)"
    )
    for column in (
        "model",
        "gallery",
        "encoder only (prepared batches), images/s",
        "build_index end to end, images/s",
        "vs encoder only",
    ):
        table.add_column(column, justify="right")
    for name, label, _, collection, _, _ in rows:
        n = len(collection.items)
        alone, whole = float(np.median(encoder[name, label])), float(np.median(end_to_end[name, label]))
        table.add_row(name, label, f"{n / alone:,.0f}", f"{n / whole:,.0f}", f"{alone / whole:.2f}x")
    distinct = [item for item in load_collection(photos).items if item.path.name.startswith("0-")]  # one copy each
    table.caption = draft_agreement(models["float32"], distinct[:500])
    return table


def decoding_table(galleries: dict[str, Path], embedder: OnnxEmbedder, args: argparse.Namespace) -> Table:
    """Reading, hashing, decoding and preparing each gallery's images (no model) in batches on one thread and on
    one thread per core, best of --repeats: whether the decoding of the indexing pipelines runs in parallel."""
    cores = os.cpu_count() or 1
    table = Table(title=f"reading, decoding and preparing images, no model (best of {args.repeats})")
    for column in ("gallery", "images", "1 thread, images/s", f"{cores} threads, images/s", f"{cores} threads vs 1", "µs of a core an image"):
        table.add_column(column, justify="right")

    def prepared(chunk: list) -> np.ndarray:
        return embedder.prepare([decode_image(read_image_bytes(item.path).data, item.path, embedder.input_size) for item in chunk])

    for label, folder in galleries.items():
        items = load_collection(folder).items
        chunks = [items[start : start + embedder.batch_size] for start in range(0, len(items), embedder.batch_size)]
        seconds = {}
        for threads in (1, cores):
            with ThreadPoolExecutor(threads) as pool:
                seconds[threads] = best_seconds(lambda: list(pool.map(prepared, chunks)), args.repeats)
        n = len(items)
        table.add_row(label, f"{n:,}", f"{n / seconds[1]:,.0f}", f"{n / seconds[cores]:,.0f}", f"{seconds[1] / seconds[cores]:.2f}x", f"{seconds[1] / n * 1e6:.0f}")
    return table


def journal_table(dim: int, scratch: Path, args: argparse.Namespace, rows: int = 10_000, batch: int = 64) -> Table:
    """Journaling rows of dim-d vectors in batches (one commit each), with SQLite's default pages of 4 KiB and with
    the journal's PAGE_SIZE, alternated, best of --repeats; and reading them back."""
    vectors = np.random.default_rng(0).standard_normal((rows, dim)).astype(np.float32)
    items = [Item(scratch / f"class-{n % 50}" / f"{n:06d}-an-image-name.png", f"class-{n % 50}") for n in range(rows)]
    digests = [f"{n:064x}" for n in range(rows)]
    timings: dict[int, list[tuple[float, float]]] = {4096: [], PAGE_SIZE: []}
    for _ in range(args.repeats):
        for page in timings:
            index.journal.PAGE_SIZE = page
            journal = Journal(scratch / "journal-bench.sqlite", "encoder", dim)
            started = time.perf_counter()
            for start in range(0, rows, batch):
                journal.add(items[start : start + batch], digests[start : start + batch], vectors[start : start + batch])
            written = time.perf_counter() - started
            started = time.perf_counter()
            sum(len(chunk.items) for chunk in journal.chunks())
            timings[page].append((written, time.perf_counter() - started))
            journal.discard()
    index.journal.PAGE_SIZE = PAGE_SIZE
    table = Table(title=f"journaling {rows:,} rows of {dim}-d vectors, batches of {batch} (best of {args.repeats})")
    for column in ("page size", "write ms", "µs a row", "read back ms"):
        table.add_column(column, justify="right")
    for page, runs in timings.items():
        written, read = min(w for w, _ in runs), min(r for _, r in runs)
        table.add_row(f"{page:,} B", f"{written * 1e3:.0f}", f"{written / rows * 1e6:.1f}", f"{read * 1e3:.0f}")
    return table


def draft_agreement(embedder: OnnxEmbedder, items: list) -> str:
    """How the reduced-scale JPEG decoding changes the embeddings of distinct pictures: cosine to the full-size
    decode's, and whether each one's nearest full-size embedding is its own."""
    drafted = embed_items(embedder, items, progress=False).vectors
    embedder.input_size = 0
    full = embed_items(embedder, items, progress=False).vectors
    embedder.input_size = embedder.preprocessing.image_size
    cosine = np.sum(drafted * full, axis=1)
    same_top1 = np.mean(np.argsort(-(drafted @ full.T), axis=1)[:, 0] == np.arange(len(items)))
    return f"JPEG draft vs full-size decode on {len(items)} images: cosine mean {cosine.mean():.4f}, min {cosine.min():.4f}; each drafted image's nearest full-size one is itself for {same_top1:.1%}"


def peak_rss_mib(run: Path, gallery: Path, index: Path) -> float:
    done = subprocess.run(
        [sys.executable, "-c", PEAK_MEMORY, "index", str(run), str(gallery), "--index", str(index)],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(done.stdout.split("PEAK_RSS_KIB=")[1].split()[0]) / 1024


def throughput_table(
    model: torch.nn.Module,
    embedder: OnnxEmbedder,
    int8: OnnxEmbedder,
    device: torch.device,
    dtype: torch.dtype,
    args: argparse.Namespace,
) -> Table:
    """Images/s of PyTorch eager, ONNX Runtime float32 and int8 on random batches of 1, 32, 64 and 128."""
    providers = ", ".join(embedder.session.get_providers())
    title = f"encoder throughput, {args.backbone} at {args.image_size}px, {'float16' if args.fp16 else 'float32'}, torch on {device}, ONNX Runtime on {providers}"
    table = Table(title=f"{title} ({torch.get_num_threads()} CPU threads; images/s)")
    for column in (
        "batch",
        "PyTorch eager",
        "ONNX Runtime",
        "ONNX Runtime / PyTorch",
        "ORT int8",
        "int8 / PyTorch",
        "int8 / ORT float32",
    ):
        table.add_column(column, justify="right")
    for batch_size in (1, 32, 64, 128):
        batch = (
            np.random.default_rng(batch_size)
            .standard_normal((batch_size, 3, args.image_size, args.image_size))
            .astype(np.float32)
        )
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
        table.add_row(
            str(batch_size),
            f"{torch_rate:,.0f}",
            f"{onnx_rate:,.0f}",
            f"{onnx_rate / torch_rate:.2f}x",
            f"{int8_rate:,.0f}",
            f"{int8_rate / torch_rate:.2f}x",
            f"{int8_rate / onnx_rate:.2f}x",
        )
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backbone", default="resnet18")
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--small", type=int, default=2000)
    parser.add_argument("--large", type=int, default=10000)
    parser.add_argument("--jpeg", type=int, default=256, help="side of the JPEG gallery's images")
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
        console.print(throughput_table(model, embedder, int8, device, dtype, args))

        gallery = make_gallery(source, Path(scratch) / "gallery", args.small)
        photos = make_gallery(source, Path(scratch) / "photos", args.small, jpeg=args.jpeg)
        large_png = make_gallery(source, Path(scratch) / "large-png", args.small // 4, png=args.jpeg)
        decoded = {"PNG 64 px": gallery, f"JPEG {args.jpeg} px": photos, f"PNG {args.jpeg} px": large_png}
        console.print(decoding_table(decoded, int8, args))
        console.print(journal_table(embedder.dim, Path(scratch), args))
        console.print(indexing_table(gallery, photos, {"float32": embedder, "int8": int8}, Path(scratch), args))

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
