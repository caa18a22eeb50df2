"""The scale-out paths on this machine: the Ray engine against the local one, and Milvus Lite against FAISS.

1. Embedding a gallery (`retrieval index`): images/s of the local engine (decoding threads + one ONNX
   Runtime session) and of the Ray engine (`--engine ray`, on a local Ray started with the machine's
   CPUs) with 1 and 2 encoder actors, each into a new index, on the same --images images (variants of
   the icons dataset made by bench/app_load.py, and the same small run). Ray's start-up is timed
   apart. On one 2-core machine Ray can only add overhead; the point is to measure it.
2. Milvus Lite (`--backend milvus`) against FAISS on --vectors generated 128-d unit vectors (clustered
   as in bench/index.py) through the project's own index classes: build time, batch QPS (1,000
   queries in one call), 1-query latency and recall@10 against exact search, for the exact types and
   HNSW.

    python bench/scale.py [--images 2000] [--vectors 100000] [--work /tmp/app_load]
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import sys
import tempfile
import time
from pathlib import Path

# run as `python bench/scale.py`, bench/index.py would hide the `index` package
sys.path = [entry for entry in sys.path if Path(entry or ".").resolve() != Path(__file__).resolve().parent]

import faiss  # noqa: E402
import numpy as np  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from index.build import build_index  # noqa: E402
from index.milvus import MilvusIndex  # noqa: E402
from index.ray_engine import RayOptions, connect  # noqa: E402
from index.store import Additions, GalleryIndex  # noqa: E402
from index.tuning import recall_at_10  # noqa: E402
from retrieval.data import Item, load_collection  # noqa: E402
from retrieval.embedders import OnnxEmbedder  # noqa: E402
from retrieval.runs import RunDir  # noqa: E402



def _bench(name: str) -> object:
    """Another script of bench/ as a module (bench/index.py's name is taken by the index package)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


prepare = _bench("app_load").prepare  # type: ignore[attr-defined]
clustered = _bench("index").clustered  # type: ignore[attr-defined]


def engines(work: Path, images: int, console: Console) -> Table:
    run, _, _ = prepare(work, 10_000)
    collection = load_collection(work / "gallery-10000")
    collection.items = collection.items[:images]
    embedder = OnnxEmbedder.from_run(RunDir(run))
    table = Table(title=f"embedding {images:,} images into a new index (this 2-core machine, resnet18 at 64 px)")
    for column in ("engine", "seconds", "images/s", "vs local"):
        table.add_column(column, justify="right")
    started = time.perf_counter()
    connect(None)
    startup = time.perf_counter() - started
    rows = []
    for name, options in (("local", None), ("ray, 1 actor", RayOptions(workers=1)), ("ray, 2 actors", RayOptions(workers=2))):
        target = Path(tempfile.mkdtemp(prefix="scale-")) / "index"
        started = time.perf_counter()
        report = build_index(embedder, collection, target, progress=False, ray=options)
        seconds = time.perf_counter() - started
        rows.append((name, seconds, report.embedded / seconds))
        shutil.rmtree(target.parent)
        console.print(f"{name}: {report.embedded / seconds:.0f} images/s")
    for name, seconds, rate in rows:
        table.add_row(name, f"{seconds:.1f}", f"{rate:.0f}", f"{rate / rows[0][2]:.2f}x")
    table.caption = f"Ray's start-up (ray.init on this machine), not in the rows: {startup:.1f} s"
    return table


def backends(count: int, console: Console) -> Table:
    gallery = clustered(count, 128, max(10, count // 100), seed=1)
    queries = clustered(1000, 128, max(10, count // 100), seed=2)
    exact = faiss.knn(queries, gallery, 10, metric=faiss.METRIC_INNER_PRODUCT)[1] + 1  # ids are rows + 1
    items = [Item(Path(f"/gallery/{row}.png"), f"c{row % 100}") for row in range(count)]
    chunks = [Additions(gallery[start : start + 10_000], items[start : start + 10_000], ["0" * 64] * len(items[start : start + 10_000])) for start in range(0, count, 10_000)]
    table = Table(title=f"{count:,} vectors of 128-d, 1,000 held-out queries, this 2-core machine")
    for column in ("backend", "type", "build (s)", "batch QPS", "1-query ms", "recall@10"):
        table.add_column(column, justify="right")
    work = Path(tempfile.mkdtemp(prefix="backends-"))
    cases = [
        ("FAISS", "Flat", lambda: GalleryIndex.create(work / "faiss-flat", chunks, "bench", 128, "Flat")),
        ("FAISS", "HNSW32", lambda: GalleryIndex.create(work / "faiss-hnsw", chunks, "bench", 128, "HNSW32")),
        ("Milvus Lite", "FLAT", lambda: MilvusIndex.create(work / "milvus-flat", chunks, "bench", 128, str(work / "lite.db"), count, index_type="FLAT")),
        ("Milvus Lite", "HNSW", lambda: MilvusIndex.create(work / "milvus-hnsw", chunks, "bench", 128, str(work / "lite.db"), count, index_type="HNSW")),
    ]
    for backend, kind, build in cases:
        started = time.perf_counter()
        index = build()
        seconds = time.perf_counter() - started
        index.search(queries[:10], 10)  # warm-up
        started = time.perf_counter()
        found = index.search(queries, 10)
        qps = len(queries) / (time.perf_counter() - started)
        single = []
        for query in queries[:100]:
            started = time.perf_counter()
            index.search(query[None], 10)
            single.append(time.perf_counter() - started)
        recall = recall_at_10([[hit.id for hit in hits] for hits in found], exact)
        table.add_row(backend, kind, f"{seconds:.1f}", f"{qps:,.0f}", f"{np.median(single) * 1000:.2f}", f"{recall:.3f}")
        console.print(f"{backend} {kind}: build {seconds:.1f} s, {qps:,.0f} QPS, recall@10 {recall:.3f}")
    shutil.rmtree(work)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--vectors", type=int, default=100_000)
    parser.add_argument("--work", type=Path, default=Path("/tmp/app_load"))
    args = parser.parse_args()
    console = Console(width=150)
    first = engines(args.work, args.images, console)
    second = backends(args.vectors, console)
    console.print(first)
    console.print(second)


if __name__ == "__main__":
    main()
