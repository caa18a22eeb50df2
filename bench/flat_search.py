"""Exact search of a Flat index by the number of queries searched at once: FAISS's own switch to BLAS against a
switch at a few queries (`--from 4,8`: one BLAS product from that many queries on, single queries still on the loop).

FAISS loops over the whole gallery once per query below its switch (`distance_compute_blas_threshold`; in FAISS 1.15
queries x dimensions below 128,000: 250 queries of 512-d, 1,000 of 128-d) and computes one matrix product above it.
The search server's batcher searches batches of up to 4 queries (app.service.MAX_BATCH). For each gallery (random unit
vectors, --sizes x --dims) and each batch of queries, the settings alternate --repeats times (best of each, ms per
query, on --threads threads: one, as the server's batcher searches); the last column counts the queries whose top 10
ids are the same under every setting.

    python bench/flat_search.py [--sizes 10000,100000] [--dims 128,512] [--batches 1,2,4,8,16,64,256] [--from 4,8]
"""

from __future__ import annotations

import argparse
import time

import faiss
import numpy as np
from rich.console import Console
from rich.table import Table

K = 18  # what a search of 10 fetches (k plus retrieval.knn.TIE_MARGIN)


def timed(index: faiss.Index, queries: np.ndarray, threshold: int) -> tuple[float, np.ndarray]:
    """Seconds of one search of queries with FAISS's switch at threshold, and the ids found."""
    faiss.cvar.distance_compute_blas_threshold = threshold
    started = time.perf_counter()
    ids = index.search(queries, K)[1]
    return time.perf_counter() - started, ids


def row(index: faiss.Index, queries: np.ndarray, thresholds: dict[str, int], repeats: int) -> list[str]:
    """One table row: ms per query under each threshold (best of repeats, alternated), and the agreeing queries."""
    best = dict.fromkeys(thresholds, float("inf"))
    found: dict[str, np.ndarray] = {}
    for _ in range(repeats):
        for name, threshold in thresholds.items():
            seconds, found[name] = timed(index, queries, threshold)
            best[name] = min(best[name], seconds)
    first = next(iter(found.values()))[:, :10]
    same = np.all([np.all(ids[:, :10] == first, axis=1) for ids in found.values()], axis=0)
    default = best["FAISS's switch"]
    cells = [f"{seconds / len(queries) * 1e3:.3f} ({default / seconds:.2f}x)" for seconds in best.values()]
    return [*cells, f"{int(same.sum())}/{len(queries)}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10000,100000")
    parser.add_argument("--dims", default="128,512")
    parser.add_argument("--batches", default="1,2,4,8,16,64,256")
    parser.add_argument("--from", dest="starts", default="4,8", help="switches to try: BLAS from this many queries on")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    faiss.omp_set_num_threads(args.threads)
    default = int(faiss.cvar.distance_compute_blas_threshold)
    per_element = default >= 1000  # FAISS 1.15 counts queries x dimensions; older versions count queries (20)
    starts = [int(start) for start in args.starts.split(",")]
    title = f"exact search, ms per query (speed-up), {args.threads} thread(s), best of {args.repeats} alternated"
    table = Table(title=title)
    for column in ("gallery", "dims", "queries", "FAISS's switch", *(f"BLAS from {s}" for s in starts), "same top 10"):
        table.add_column(column, justify="right")
    rng = np.random.default_rng(0)
    for size in map(int, args.sizes.split(",")):
        for dim in map(int, args.dims.split(",")):
            vectors = rng.standard_normal((size, dim)).astype(np.float32)
            vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
            index = faiss.IndexFlatIP(dim)
            index.add(vectors)
            thresholds = {"FAISS's switch": default}
            thresholds |= {f"from {s}": s * (dim if per_element else 1) for s in starts}
            for batch in map(int, args.batches.split(",")):
                queries = np.ascontiguousarray(vectors[rng.choice(size, batch, replace=False)])
                table.add_row(f"{size:,}", str(dim), str(batch), *row(index, queries, thresholds, args.repeats))
    faiss.cvar.distance_compute_blas_threshold = default
    Console(width=150).print(table)
    print(f"faiss {faiss.__version__}, numpy {np.__version__}")


if __name__ == "__main__":
    main()
