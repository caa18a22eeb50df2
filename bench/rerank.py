"""Query latency of re-ranking through the one search path, at 10,000 and 100,000 gallery items.

Builds an exact index (index.store.GalleryIndex, as `retrieval index` does for these sizes) of unit
vectors clustered like embeddings (512-d, about 10 per cluster, as the icons' classes), then times
`index.search.search_vectors` for batches of queries with each re-ranker against none: the median
milliseconds per query over the batches, and the ratio to no re-ranking measured in the same run.

    python bench/rerank.py [--sizes 10000,100000] [--batch 16] [--batches 8] [--shortlist 100]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

# run as `python bench/rerank.py`, this file's folder would hide the `index` package
sys.path = [entry for entry in sys.path if Path(entry or ".").resolve() != Path(__file__).resolve().parent]

import numpy as np  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from index.search import Query, search_vectors  # noqa: E402
from index.store import GalleryIndex  # noqa: E402
from retrieval.data import Item  # noqa: E402
from retrieval.rerank import parse_rerank  # noqa: E402

SPECS = ("none", "qe:n=1", "dba:n=1", "kreciprocal:k1=20,k2=6,lambda=0.3")
DIM = 512


def gallery(size: int, seed: int = 0) -> np.ndarray:
    """Unit vectors around size/10 random centres."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((max(1, size // 10), DIM)).astype(np.float32)
    vectors = centres[rng.integers(0, len(centres), size)] + 0.8 * rng.standard_normal((size, DIM)).astype(np.float32)
    return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10000,100000")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--shortlist", type=int, default=100)
    args = parser.parse_args()
    table = Table(title=f"ms per query, batches of {args.batch}, median of {args.batches} batches; shortlist {args.shortlist}; k=10")
    for column in ("items", *SPECS):
        table.add_column(column)
    for size in (int(text) for text in args.sizes.split(",")):
        vectors = gallery(size)
        queries = gallery(args.batch * args.batches, seed=1)
        with tempfile.TemporaryDirectory() as scratch:
            items = [Item(Path(f"/gallery/{n}.png"), f"c{n % 1000}") for n in range(size)]
            index = GalleryIndex.build(Path(scratch) / "index", vectors, items, [f"{n:064x}" for n in range(size)], "0" * 64)
            cells, base = [], None
            for spec in SPECS:
                reranker = parse_rerank(spec if spec == "none" else f"{spec},shortlist={args.shortlist}")
                times = []
                for start in range(0, len(queries), args.batch):
                    began = time.perf_counter()
                    search_vectors(index, queries[start : start + args.batch], [Query(10, rerank=reranker)] * args.batch)
                    times.append((time.perf_counter() - began) * 1000 / args.batch)
                median = float(np.median(times))
                base = base or median
                cells.append(f"{median:.2f}" + ("" if spec == "none" else f" ({median / base:.1f}x)"))
        table.add_row(f"{size:,}", *cells)
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
