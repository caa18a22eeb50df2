"""Approximate search on the whitened set beside the shipped graph: IVF with fast-scan PQ codes and a graph over the
top principal components, each with its candidates re-scored exactly in the full space.

The gallery and queries are bench/index.py's (`--data whitened` by default); recall@10 is against exact search
for --queries held-out queries, speed is batch QPS over exact search's in the same run. Each line:
`TYPE depth D candidates R: recall … qps … (…x)`.

    python bench/ann_alternatives.py [--size 1000000] [--data whitened] [--ivf 'IVF1024,PQ64x4fs'] [--pca '64;48'] [--hnsw 'HNSW32:80;HNSW64:80']
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

sys.path = [entry for entry in sys.path if Path(entry or ".").resolve() != Path(__file__).resolve().parent]

import faiss  # noqa: E402
import numpy as np  # noqa: E402

from index.tuning import recall_at_10  # noqa: E402

_spec = importlib.util.spec_from_file_location("bench_index", Path(__file__).with_name("index.py"))
bench_index = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_index)  # type: ignore[union-attr]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="whitened", choices=["whitened", "encoder", "clustered"])
    parser.add_argument("--size", type=int, default=1_000_000)
    parser.add_argument("--queries", type=int, default=2000)
    parser.add_argument("--ivf", default="IVF1024,PQ64x4fs", help="IVF factory strings separated by ; ('' for none)")
    parser.add_argument("--pca", default="64", help="HNSW32 over this many top principal components, separated by ;")
    parser.add_argument("--hnsw", default="", help="full-space graphs as TYPE:efConstruction separated by ; (e.g. HNSW32_SQ8:80)")
    args = parser.parse_args()
    gallery = bench_index.generated(args.data, args.size, 128, seed=1)
    queries = bench_index.generated(args.data, args.queries, 128, seed=2)
    started = time.perf_counter()
    truth = bench_index.faiss_search(flat(gallery), queries, 10)[1]
    exact = len(queries) / (time.perf_counter() - started)
    print(f"exact: {exact:,.0f} QPS", flush=True)
    sample = gallery[np.random.default_rng(3).permutation(args.size)[:100_000]]

    def report(name: str, search: object) -> None:
        started = time.perf_counter()
        found = search()  # type: ignore[operator]
        qps = len(queries) / (time.perf_counter() - started)
        print(f"{name}: recall {recall_at_10(found, truth):.3f} qps {qps:,.0f} ({qps / exact:.1f}x)", flush=True)

    def rescored(candidates: np.ndarray) -> np.ndarray:
        scores = np.einsum("qcd,qd->qc", gallery[np.maximum(candidates, 0)], queries)
        scores[candidates < 0] = -np.inf
        return np.take_along_axis(candidates, np.argsort(-scores, axis=1)[:, :10], axis=1)

    for factory in filter(None, args.ivf.split(";")):
        index = faiss.index_factory(128, factory, faiss.METRIC_INNER_PRODUCT)
        index.train(sample)
        index.add(gallery)
        for nprobe in (16, 32, 64, 128, 256):
            params = faiss.SearchParametersIVF(nprobe=nprobe)
            for candidates in (10, 50, 100, 200):
                report(f"{factory} nprobe {nprobe} candidates {candidates}", lambda: rescored(index.search(queries, candidates, params=params)[1]))
    mean = sample.mean(axis=0)
    components = np.linalg.svd(sample - mean, full_matrices=False)[2]
    graphs = [(f"HNSW32 over PCA{d}", "HNSW32", int(d), 40) for d in filter(None, args.pca.split(";"))]
    graphs += [(f"{spec} (efConstruction {spec.split(':')[1]})", spec.split(":")[0], 128, int(spec.split(":")[1])) for spec in filter(None, args.hnsw.split(";"))]
    for name, factory, dims, construction in graphs:
        projection = components[:dims].T.astype(np.float32)
        points = np.ascontiguousarray(gallery @ projection if dims < 128 else gallery)
        asked = np.ascontiguousarray(queries @ projection if dims < 128 else queries)
        index = faiss.index_factory(dims, factory, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = construction
        index.train(points[:100_000])  # the scalar quantiser's ranges (a no-op for flat storage)
        index.add(points)
        for ef in (16, 32, 48, 64, 96, 128):
            params = faiss.SearchParametersHNSW(efSearch=ef)
            for candidates in (10, 20, 40, 80) if dims < 128 or "SQ" in factory else (10,):  # compressed codes: re-scored
                if candidates <= ef:
                    report(f"{name} efSearch {ef} candidates {candidates}", lambda: rescored(index.search(asked, candidates, params=params)[1]))


def flat(vectors: np.ndarray) -> faiss.Index:
    index = faiss.IndexFlatIP(vectors.shape[1])
    index.add(vectors)
    return index


if __name__ == "__main__":
    main()
