"""Approximate search on the whitened set beside the shipped graph: IVF with fast-scan PQ codes, a graph over the
top principal components, and a graph over the vectors with their principal components re-weighted (--sharpen
ALPHA: each scaled by its singular value's share of the largest to the power ALPHA, which gives the strong
directions back the weight whitening took from them), each with its candidates re-scored exactly in the full space;
and NSG graphs (--nsg), searched directly.

The gallery and queries are bench/index.py's (`--data whitened` by default); recall@10 is against exact search
for --queries held-out queries, speed is batch QPS over exact search's in the same run. Each line:
`TYPE depth D candidates R: recall … qps … (…x)`.

    python bench/ann_alternatives.py [--size 1000000] [--data whitened] [--ivf 'IVF1024,PQ64x4fs'] [--nprobes '16;256'] [--candidates '10;100'] [--pca '64;48'] [--hnsw 'HNSW32:80;HNSW64:80'] [--sharpen '0.5;1'] [--nsg 'NSG32;NSG64'] [--rewhiten]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path = [entry for entry in sys.path if Path(entry or ".").resolve() != Path(__file__).resolve().parent]

import faiss  # noqa: E402
import numpy as np  # noqa: E402

from index.tuning import recall_at_10  # noqa: E402
from retrieval.embedders import l2_normalise  # noqa: E402

_spec = importlib.util.spec_from_file_location("bench_index", Path(__file__).with_name("index.py"))
bench_index = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_index)  # type: ignore[union-attr]


Report = Callable[[str, Callable[[], np.ndarray]], None]  # prints a search's recall and speed
Rescored = Callable[[np.ndarray], np.ndarray]  # candidates re-ordered by their exact similarity


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="whitened", choices=["whitened", "encoder", "clustered"])
    parser.add_argument("--size", type=int, default=1_000_000)
    parser.add_argument("--queries", type=int, default=2000)
    parser.add_argument("--ivf", default="IVF1024,PQ64x4fs", help="IVF factory strings separated by ; ('' for none)")
    parser.add_argument("--nprobes", default="16;32;64;128;256", help="the IVF types' nprobe values, separated by ;")
    parser.add_argument("--candidates", default="10;50;100;200", help="the IVF types' candidates re-scored, by ;")
    parser.add_argument("--pca", default="64", help="HNSW32 over this many top principal components, separated by ;")
    parser.add_argument(
        "--hnsw", default="", help="full-space graphs as TYPE:efConstruction separated by ; (e.g. HNSW32_SQ8:80)"
    )
    parser.add_argument(
        "--nsg", default="", help="NSG graphs (FAISS IndexNSGFlat, L2 on the unit vectors) as NSG<R> separated by ;"
    )
    parser.add_argument(
        "--sharpen", default="", help="HNSW32 graphs over re-weighted components, the powers separated by ;"
    )
    parser.add_argument(
        "--rewhiten",
        action="store_true",
        help="only: the encoder set whitened as export does, exact unwhitened candidates re-scored",
    )
    args = parser.parse_args()
    if args.rewhiten:
        return rewhitened(args.size, args.queries)
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
        return rescore(gallery, queries, candidates)

    inverted_lists(args, gallery, queries, sample, report, rescored)
    mean = sample.mean(axis=0)
    _, values, components = np.linalg.svd(sample - mean, full_matrices=False)
    for alpha in filter(None, args.sharpen.split(";")):
        sharpened(
            gallery,
            queries,
            (components.T * (values / values[0]) ** float(alpha)).astype(np.float32),
            alpha,
            report,
            rescored,
        )
    graphs(args, components, gallery, queries, report, rescored)
    for spec in filter(None, args.nsg.split(";")):
        navigating(spec, gallery, queries, report)


def inverted_lists(
    args: argparse.Namespace,
    gallery: np.ndarray,
    queries: np.ndarray,
    sample: np.ndarray,
    report: Report,
    rescored: Rescored,
) -> None:
    """IVF types (--ivf) trained on sample, searched at each of --nprobes, their --candidates re-scored exactly."""
    for factory in filter(None, args.ivf.split(";")):
        index = faiss.index_factory(128, factory, faiss.METRIC_INNER_PRODUCT)
        index.train(sample)
        index.add(gallery)
        for nprobe in (int(value) for value in args.nprobes.split(";")):
            params = faiss.SearchParametersIVF(nprobe=nprobe)
            for candidates in (int(value) for value in args.candidates.split(";")):
                report(
                    f"{factory} nprobe {nprobe} candidates {candidates}",
                    lambda: rescored(index.search(queries, candidates, params=params)[1]),
                )


def graphs(
    args: argparse.Namespace,
    components: np.ndarray,
    gallery: np.ndarray,
    queries: np.ndarray,
    report: Report,
    rescored: Rescored,
) -> None:
    """HNSW32 over top principal components (--pca) and full-space graphs (--hnsw), candidates re-scored."""
    specs = [(f"HNSW32 over PCA{d}", "HNSW32", int(d), 40) for d in filter(None, args.pca.split(";"))]
    specs += [
        (f"{spec} (efConstruction {spec.split(':')[1]})", spec.split(":")[0], 128, int(spec.split(":")[1]))
        for spec in filter(None, args.hnsw.split(";"))
    ]
    for name, factory, dims, construction in specs:
        projection = components[:dims].T.astype(np.float32)
        points = np.ascontiguousarray(gallery @ projection if dims < 128 else gallery)
        asked = np.ascontiguousarray(queries @ projection if dims < 128 else queries)
        index = faiss.index_factory(dims, factory, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = construction
        index.train(points[:100_000])  # the scalar quantiser's ranges (a no-op for flat storage)
        index.add(points)
        for ef in (16, 32, 48, 64, 96, 128):
            params = faiss.SearchParametersHNSW(efSearch=ef)
            for candidates in (
                (10, 20, 40, 80) if dims < 128 or "SQ" in factory else (10,)
            ):  # compressed codes: re-scored
                if candidates <= ef:
                    report(
                        f"{name} efSearch {ef} candidates {candidates}",
                        lambda: rescored(index.search(asked, candidates, params=params)[1]),
                    )


def navigating(spec: str, gallery: np.ndarray, queries: np.ndarray, report: Report) -> None:
    """An NSG graph (FAISS's IndexNSGFlat: a k-NN graph by NN-descent, then pruned to R links; L2, which orders unit
    vectors as the inner product does), searched at growing search_L."""
    index = faiss.IndexNSGFlat(gallery.shape[1], int(spec.removeprefix("NSG")))
    started = time.perf_counter()
    index.add(gallery)
    print(f"{spec}: built in {time.perf_counter() - started:.0f} s", flush=True)
    for depth in (16, 32, 48, 64, 96, 128):
        index.nsg.search_L = depth
        report(f"{spec} search_L {depth}", lambda: index.search(queries, 10)[1])


def rescore(gallery: np.ndarray, queries: np.ndarray, candidates: np.ndarray) -> np.ndarray:
    """[Q, 10]: each query's candidates (ids, -1 for none) re-ordered by their exact inner product in gallery's space."""
    scores = np.einsum("qcd,qd->qc", gallery[np.maximum(candidates, 0)], queries)
    scores[candidates < 0] = -np.inf
    return np.take_along_axis(candidates, np.argsort(-scores, axis=1)[:, :10], axis=1)


def sharpened(
    gallery: np.ndarray,
    queries: np.ndarray,
    forward: np.ndarray,
    alpha: str,
    report: Report,
    rescored: Rescored,
) -> None:
    """HNSW32 (efConstruction 80) over gallery @ forward, searched with queries @ forward, candidates re-scored in the
    full space: the graph walks a space of lower intrinsic dimension, the re-scoring restores the whitened order."""
    index = faiss.index_factory(gallery.shape[1], "HNSW32", faiss.METRIC_INNER_PRODUCT)
    index.hnsw.efConstruction = 80
    started = time.perf_counter()
    index.add(np.ascontiguousarray(gallery @ forward))
    print(f"sharpened {alpha}: built in {time.perf_counter() - started:.0f} s", flush=True)
    asked = np.ascontiguousarray(queries @ forward)
    for ef in (32, 48, 64, 96, 128):
        params = faiss.SearchParametersHNSW(efSearch=ef)
        for candidates in (20, 40, 80):
            if candidates <= ef:
                report(
                    f"HNSW32 sharpened {alpha} efSearch {ef} candidates {candidates}",
                    lambda: rescored(index.search(asked, candidates, params=params)[1]),
                )


def rewhitened(size: int, count: int) -> None:
    """The `encoder` set and its queries whitened by the export's own fit (shrinkage 0.8 on a 100,000 sample): how much
    of each query's whitened top 10 the exact unwhitened top K holds once re-scored whitened, and the spectra."""
    from training.whitening import fit_whitening

    gallery = bench_index.generated("encoder", size, 128, seed=1)
    queries = bench_index.generated("encoder", count, 128, seed=2)
    mean, projection = fit_whitening(gallery[np.random.default_rng(3).permutation(size)[:100_000]], 0.8)

    white, asked = (l2_normalise((vectors - mean) @ projection) for vectors in (gallery, queries))
    for name, vectors in (
        ("encoder set whitened", white[:20_000]),
        ("whitened set", bench_index.generated("whitened", 20_000, 128, seed=5)),
    ):
        shares = np.linalg.svd(vectors - vectors.mean(axis=0), compute_uv=False) ** 2
        print(f"{name}: top 10 components hold {shares[:10].sum() / shares.sum():.2f} of the variance", flush=True)
    truth = bench_index.faiss_search(flat(white), asked, 10)[1]
    unwhitened = flat(gallery)
    for k in (10, 50, 100, 200):
        candidates = bench_index.faiss_search(unwhitened, queries, k)[1]
        found = rescore(white, asked, candidates)
        print(f"exact unwhitened top {k} re-scored whitened: recall {recall_at_10(found, truth):.3f}", flush=True)


def flat(vectors: np.ndarray) -> faiss.Index:
    index = faiss.IndexFlatIP(vectors.shape[1])
    index.add(vectors)
    return index


if __name__ == "__main__":
    main()
