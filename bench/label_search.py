"""Search among one label's items (`search --label`, the app's "only the query label", the API's label=) on
approximate indexes: recall@10 against exact search over that label, and the time a query takes, through
GalleryIndex.search_arrays and, beside it, through FAISS's own filter (an ID selector) at the tuned depth.

    python bench/label_search.py [--items 20000] [--dim 64] [--factories HNSW32 IVF256,Flat IVF256,PQ16]

Labels of four sizes (0.1 %, 1 %, 10 % and 50 % of the items) are spread at random over clustered unit vectors;
100 queries from the same clusters search each label through GalleryIndex.search_arrays, as every caller does.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from index.faiss_ops import faiss, search_ids, search_parameters  # noqa: E402
from index.store import GalleryIndex  # noqa: E402
from index.types import Additions  # noqa: E402
from retrieval.data import Item  # noqa: E402

SHARES = {"0.1 %": 0.001, "1 %": 0.01, "10 %": 0.1, "50 %": 0.5}
QUERIES, K = 100, 10


def clustered(rng: np.random.Generator, count: int, dim: int, centres: np.ndarray) -> np.ndarray:
    """Unit vectors around randomly chosen centres."""
    rows = centres[rng.integers(0, len(centres), count)] + 0.8 * rng.standard_normal((count, dim))
    return (rows / np.linalg.norm(rows, axis=1, keepdims=True)).astype(np.float32)


def labelled(rng: np.random.Generator, count: int) -> np.ndarray:
    """Each item's label: the shares of SHARES at random places, "rest" elsewhere."""
    labels, order, start = np.array(["rest"] * count, object), rng.permutation(count), 0
    for name, share in SHARES.items():
        size = max(1, int(share * count))
        labels[order[start : start + size]] = name
        start += size
    return labels


def faiss_filter(index: GalleryIndex, queries: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """The ids FAISS's ID selector finds among allowed at the index's tuned depth (compressed types re-scored)."""
    selector = faiss.IDSelectorBatch(len(allowed), faiss.swig_ptr(allowed))
    params = search_parameters(index.kind, index.manifest.depth, selector)
    k = min(K, len(allowed))
    return search_ids(index.vectors, queries, k, params, index.raw, index.manifest.rerank, len(allowed))[1]


def measure(index: GalleryIndex, vectors: np.ndarray, labels: np.ndarray, queries: np.ndarray) -> list[tuple]:
    """(label share, then recall@10, hits a query and ms a query through search_arrays and through FAISS's filter)
    for each label."""
    rows = []
    for name in SHARES:
        ids = np.where(labels == name)[0]
        truth = [set(ids[row] + 1) for row in np.argsort(-(queries @ vectors[ids].T), axis=1)[:, :K]]
        row: list = [name]
        for search in (lambda: index.search_arrays(queries, K, label=name).ids, lambda: faiss_filter(index, queries, ids + 1)):
            start = time.perf_counter()
            found = search()
            took = (time.perf_counter() - start) * 1000 / len(queries)
            recall = np.mean([len(truth[i] & set(found[i][found[i] >= 0])) / min(K, len(ids)) for i in range(len(queries))])
            row += [float(recall), float((found >= 0).sum(1).mean()), took]
        rows.append(tuple(row))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, default=20_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--factories", nargs="+", default=["HNSW32", "IVF256,Flat", "IVF256,PQ16"])
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    centres = rng.standard_normal((200, args.dim))
    vectors, labels = clustered(rng, args.items, args.dim, centres), labelled(rng, args.items)
    queries = clustered(rng, QUERIES, args.dim, centres)
    items = [Item(Path(f"/gallery/{i}.png"), str(label)) for i, label in enumerate(labels)]
    digests = [f"{i:064x}" for i in range(args.items)]
    print(f"{args.items:,} items of {args.dim} dimensions, {QUERIES} queries, recall@{K} against exact search")
    print(
        "| index | label's share | recall@10 | hits a query | ms a query | FAISS's filter at the tuned depth: recall@10 "
        "| hits a query | ms a query |\n| --- | --- | --- | --- | --- | --- | --- | --- |"
    )
    with tempfile.TemporaryDirectory() as folder:
        for factory in args.factories:
            index = GalleryIndex.create(
                Path(folder) / factory, [Additions(vectors, items, digests)], "bench", args.dim, factory
            )
            for name, *figures in measure(index, vectors, labels, queries):
                recall, hits, took, plain_recall, plain_hits, plain_took = figures
                print(
                    f"| {factory} | {name} | {recall:.3f} | {hits:.1f} | {took:.2f} | {plain_recall:.3f} | "
                    f"{plain_hits:.1f} | {plain_took:.2f} |"
                )


if __name__ == "__main__":
    main()
