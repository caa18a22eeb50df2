"""FAISS index types on 1,000,000 clustered 128-d vectors: build time, size, latency, batch QPS and recall@10.

The script generates the gallery (unit vectors scattered around 10,000 random centres, about 100
vectors each) and 10,000
held-out queries from the same distribution. Every type is built the way `retrieval index` builds it
(index.faiss_ops.new_index: trained on a seeded sample, ids kept) and its search depth tuned the same
way (index.tuning.tune_depth: the smallest nprobe/efSearch whose recall@10 on 1,000 of its own vectors
reaches 0.95); compressed types (SQ, PQ) re-score 8 candidates per result with the exact vectors, as
searches do (the gallery array plays the memory-mapped raw.f32). Then, for the held-out queries: recall@10 against exact search, batch QPS (all 10,000
queries in one call) and single-query latency (median of 300 calls with one query). "auto" is the
type index.choice picks for this size within --memory.

    python bench/index.py [--size 1000000] [--queries 10000] [--memory 64GB] [--types 'Flat;HNSW32;...']
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

# run as `python bench/index.py`, this file's own name would hide the `index` package
sys.path = [entry for entry in sys.path if Path(entry or ".").resolve() != Path(__file__).resolve().parent]

import faiss  # noqa: E402
import numpy as np  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from index.choice import choose_index, nlist_for, parse_memory  # noqa: E402
from index.faiss_ops import compressed, new_index, search_ids, search_parameters  # noqa: E402
from index.store import RERANK  # noqa: E402
from index.tuning import RECALL_SAMPLE, RecallProbe, recall_at_10, tune_depth  # noqa: E402
from index.types import index_kind  # noqa: E402


def clustered(size: int, dim: int, centres: int, seed: int) -> np.ndarray:
    """Unit vectors around random centres (the gallery and the queries share the centres, seed 0).

    With noise 0.6 per dimension, two vectors of one centre have cosine about 1 / (1 + 0.36) = 0.74,
    like images of one class under a trained encoder; vectors of different centres about 0.
    """
    centre = np.random.default_rng(0).standard_normal((centres, dim)).astype(np.float32)
    rng = np.random.default_rng(seed)
    vectors = centre[rng.integers(0, centres, size)] + 0.6 * rng.standard_normal((size, dim)).astype(np.float32)
    return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=1_000_000)
    parser.add_argument("--queries", type=int, default=10_000)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--memory", default="64GB", help="budget given to the automatic choice")
    parser.add_argument("--types", default=None, help="factory strings separated by ; with Flat first (default: Flat, HNSW32, IVF-Flat, IVF-SQ8, OPQ+IVF-PQ and auto)")
    args = parser.parse_args()
    gallery = clustered(args.size, args.dim, 10_000, seed=1)
    queries = clustered(args.queries, args.dim, 10_000, seed=2)
    ids = np.arange(1, args.size + 1, dtype=np.int64)
    nlist = nlist_for(args.size)
    auto = choose_index(args.size, args.dim, parse_memory(args.memory))
    types = args.types.split(";") if args.types else ["Flat", "HNSW32", f"IVF{nlist},Flat", f"IVF{nlist},SQ8", f"OPQ32,IVF{nlist},PQ32"]
    if auto.factory not in types:
        types.append(auto.factory)
    sample = gallery[np.random.default_rng(3).permutation(args.size)[: 40 * nlist]]
    truth: np.ndarray | None = None
    rows = []
    for factory in types:
        started = time.perf_counter()
        index = new_index(factory, args.dim, sample)
        for start in range(0, args.size, 100_000):
            index.add_with_ids(gallery[start : start + 100_000], ids[start : start + 100_000])
        build = time.perf_counter() - started
        kind = index_kind(factory)
        probe = RecallProbe(sample[:RECALL_SAMPLE])
        probe.see(gallery, ids)
        rerank = RERANK if compressed(factory) else 0  # re-scored with the exact vectors, as searches do
        tuned = tune_depth(index, kind, probe if factory != "Flat" else None, gallery, rerank)
        params = search_parameters(kind, next(iter(tuned["search"].values()), None))
        started = time.perf_counter()
        found = search_ids(index, queries, 10, params, gallery, rerank)[1]
        batch = time.perf_counter() - started
        if truth is None:
            if factory != "Flat":
                raise SystemExit("put Flat first: it gives the exact neighbours")
            truth = found
        single = []
        for row in range(300):
            started = time.perf_counter()
            search_ids(index, queries[row : row + 1], 10, params, gallery, rerank)
            single.append(time.perf_counter() - started)
        recall = recall_at_10(found, truth)
        size = len(faiss.serialize_index(index)) / 2**20
        rows.append((factory + (" (auto)" if factory == auto.factory else ""), build, size, tuned["search"], float(np.median(single)) * 1e3, args.queries / batch, recall))
        print(rows[-1], flush=True)
    exact_qps = rows[0][5]
    table = Table(title=f"{args.size:,} x {args.dim}-d clustered vectors, {args.queries:,} held-out queries, {faiss.omp_get_max_threads()} threads; auto = {auto.factory} ({auto.reason})")
    for column in ("index", "build s", "size MiB", "search depth", "1-query ms", "batch QPS", "QPS vs exact", "recall@10"):
        table.add_column(column, justify="right")
    for name, build, size, depth, latency, qps, recall in rows:
        table.add_row(name, f"{build:.1f}", f"{size:.0f}", ", ".join(f"{k}={v}" for k, v in depth.items()) or "-", f"{latency:.2f}", f"{qps:,.0f}", f"{qps / exact_qps:.1f}x", f"{recall:.3f}")
    Console().print(table)


if __name__ == "__main__":
    main()
