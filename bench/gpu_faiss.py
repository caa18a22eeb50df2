"""faiss-gpu on the 1M benchmark: build and search times of exact and IVF indexes on the GPU, and recall@10.

The gallery and queries are bench/index.py's (1,000,000 128-d unit vectors of its --data set,
fitted to real embeddings by default, and 10,000 held-out queries); each index is built on the GPU (faiss.index_cpu_to_gpu), searched with all
queries in one call, and scored against the GPU's exact search.

    python bench/gpu_faiss.py [--size 1000000] [--queries 10000]
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
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from index.choice import nlist_for  # noqa: E402



def _bench_index_module() -> object:
    """bench/index.py, loaded by path: its data generator, without its name hiding the project's index package."""
    spec = importlib.util.spec_from_file_location("bench_index", Path(__file__).with_name("index.py"))
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=1_000_000)
    parser.add_argument("--queries", type=int, default=10_000)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--data", default="whitened", help="bench/index.py's data set: whitened, encoder or clustered")
    args = parser.parse_args()
    if not hasattr(faiss, "StandardGpuResources") or faiss.get_num_gpus() < 1:
        sys.exit("gpu_faiss: this faiss has no GPU (install the gpu extra: faiss-gpu-cu12) or no GPU is visible")
    generated = _bench_index_module().generated  # type: ignore[attr-defined]
    gallery = generated(args.data, args.size, args.dim, seed=1)
    queries = generated(args.data, args.queries, args.dim, seed=2)
    resources = faiss.StandardGpuResources()
    nlist = nlist_for(args.size)
    table = Table(title=f"faiss-gpu, {args.size:,} x {args.dim}-d, {args.queries:,} queries in one call")
    for column in ("index", "nprobe", "build s", "search s", "QPS", "recall@10"):
        table.add_column(column, justify="right")
    truth = None
    for factory, nprobes in (("Flat", [None]), (f"IVF{nlist},Flat", [8, 32, 128, 512]), (f"IVF{nlist},SQ8", [32])):
        started = time.perf_counter()
        index = faiss.index_cpu_to_gpu(resources, 0, faiss.index_factory(args.dim, factory, faiss.METRIC_INNER_PRODUCT))
        if not index.is_trained:
            index.train(gallery[np.random.default_rng(3).permutation(args.size)[: 40 * nlist]])
        index.add(gallery)
        build = time.perf_counter() - started
        for nprobe in nprobes:
            if nprobe is not None:
                faiss.GpuParameterSpace().set_index_parameter(index, "nprobe", nprobe)
            started = time.perf_counter()
            _, ids = index.search(queries, 10)
            seconds = time.perf_counter() - started
            truth = ids if truth is None else truth
            recall = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(ids, truth)])
            table.add_row(factory, str(nprobe or "-"), f"{build:.1f}", f"{seconds:.3f}", f"{args.queries / seconds:,.0f}", f"{recall:.3f}")
    Console(width=120).print(table)


if __name__ == "__main__":
    main()
