"""FAISS index types on 1,000,000 generated 128-d vectors shaped like real embeddings: recall@10 against search depth, and the automatic choice through the project's search.

The gallery and the 10,000 held-out queries are drawn from one mixture (--data):

- `whitened` (default): fitted to the icons' embeddings by the demo run's default export (whitened);
  intrinsic dimension of the generated set about 30 (TwoNN), classes overlapping heavily;
- `encoder`: the same encoder exported without whitening: a steeper spectrum, intrinsic dimension
  about 13, embeddings in a cone;
- `clustered`: the earlier, easy set (isotropic noise around 10,000 random centres), where one IVF
  probe already finds nearly every neighbour.

A fitted set (bench/data/spectrum-NAME.json, written by bench/spectrum.py) is made like this: 10,000
class centres, drawn with the between-class share of the real variances of the top 128 principal
components; each vector a centre plus noise with the rest of those variances (so neighbours cross
classes as in the real embeddings); a random rotation; the real mean's share along one direction; unit
length.

Part 1, curves: every type is built as `retrieval index` builds it (index.faiss_ops.new_index) and
searched through index.faiss_ops.search_ids (the call under GalleryIndex.search; compressed codes
re-scored with the exact vectors, as searches do) at each depth (nprobe 1..512, efSearch 16..512):
recall@10 of --curve-queries held-out queries against exact search, and their batch QPS.
Part 2, the automatic choice: Flat and the type index.choice picks are built by GalleryIndex.create
(trained, filled and depth-tuned as `retrieval index` does) in a temporary folder, and the 10,000
held-out queries go through GalleryIndex.search_arrays in one call (ids, scores, paths, labels and
sha256 as arrays), beside the same batch as Hit objects (GalleryIndex.search) and the bare FAISS index
at the tuned depth, in --rounds rounds of exact then automatic (medians; the speed-up is the median of
the rounds' own), and one at a time for latency. Writes docs/index-<data>.png (the curves) and, with --out, the rows as JSON.

    python bench/index.py [--data whitened|encoder|clustered] [--size 1000000] [--types 'Flat;HNSW32;...'] [--no-auto] [--out F]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

# run as `python bench/index.py`, this file's own name would hide the `index` package
sys.path = [entry for entry in sys.path if Path(entry or ".").resolve() != Path(__file__).resolve().parent]

import faiss  # noqa: E402
import numpy as np  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from index.choice import nlist_for, parse_memory  # noqa: E402
import index.store  # noqa: E402
from index.faiss_ops import compressed, faiss_search, new_index, on_huge_pages, search_ids, search_parameters  # noqa: E402
from index.store import RERANK, GalleryIndex  # noqa: E402
from index.tuning import recall_at_10  # noqa: E402
from index.types import Additions, index_kind  # noqa: E402
from retrieval.data import Item  # noqa: E402

DATA = Path(__file__).with_name("data")
CLASSES = 10_000
CHUNK = 100_000
DEPTHS = {"ivf": [1, 2, 4, 8, 16, 32, 64, 128, 256, 512], "hnsw": [16, 32, 64, 128, 256, 512], "flat": [None]}


def clustered(size: int, dim: int, centres: int, seed: int) -> np.ndarray:
    """Unit vectors around random centres (the gallery and the queries share the centres, seed 0).

    With noise 0.6 per dimension, two vectors of one centre have cosine about 1 / (1 + 0.36) = 0.74;
    vectors of different centres about 0.
    """
    centre = np.random.default_rng(0).standard_normal((centres, dim)).astype(np.float32)
    rng = np.random.default_rng(seed)
    vectors = centre[rng.integers(0, centres, size)] + 0.6 * rng.standard_normal((size, dim)).astype(np.float32)
    return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)


def fitted(name: str, size: int, dim: int, seed: int) -> np.ndarray:
    """Unit vectors of the mixture fitted to bench/data/spectrum-<name>.json (centres and rotation: seed 0)."""
    shape = json.loads((DATA / f"spectrum-{name}.json").read_text())
    variances = np.asarray(shape["variances"][:dim], np.float64)
    if len(variances) < dim:
        raise SystemExit(f"{name}: the spectrum has {len(variances)} components, --dim {dim} needs more")
    variances /= variances.sum()
    between, mean_share = shape["between_class_share"], shape["mean_share"]
    setup = np.random.default_rng(0)
    rotation = np.linalg.qr(setup.standard_normal((dim, dim)))[0].astype(np.float32)
    centres = (setup.standard_normal((CLASSES, dim)) * np.sqrt(between * variances)).astype(np.float32)
    direction = setup.standard_normal(dim).astype(np.float32)
    direction /= np.linalg.norm(direction)
    rng, out = np.random.default_rng(seed), np.empty((size, dim), np.float32)
    for start in range(0, size, CHUNK):
        count = min(CHUNK, size - start)
        noise = rng.standard_normal((count, dim)) * np.sqrt((1 - between) * variances)
        rows = (centres[rng.integers(0, CLASSES, count)] + noise.astype(np.float32)) @ rotation.T
        rows = rows * np.sqrt(1 - mean_share) + direction * np.sqrt(mean_share)
        out[start : start + count] = rows / np.linalg.norm(rows, axis=1, keepdims=True)
    return out


def generated(data: str, size: int, dim: int, seed: int) -> np.ndarray:
    """The gallery (seed 1) or queries (seed 2) of one of the data sets."""
    return clustered(size, dim, CLASSES, seed) if data == "clustered" else fitted(data, size, dim, seed)


def built(factory: str, gallery: np.ndarray, sample: np.ndarray) -> tuple[faiss.Index, float]:
    """The FAISS index of factory holding gallery (ids 1..n), as retrieval index builds it, and the seconds it took."""
    started = time.perf_counter()
    index = new_index(factory, gallery.shape[1], sample)
    ids = np.arange(1, len(gallery) + 1, dtype=np.int64)
    for start in range(0, len(gallery), CHUNK):
        index.add_with_ids(gallery[start : start + CHUNK], ids[start : start + CHUNK])
    return index, time.perf_counter() - started


def curve(factory: str, gallery: np.ndarray, sample: np.ndarray, queries: np.ndarray, truth: np.ndarray | None) -> dict:
    """recall@10 and batch QPS of one type at each depth (truth None: this is Flat, which gives it)."""
    index, build = built(factory, gallery, sample)
    kind, rerank = index_kind(factory), RERANK if compressed(factory) else 0
    points = []
    for depth in DEPTHS[kind]:
        started = time.perf_counter()
        found = search_ids(index, queries, 10, search_parameters(kind, depth), gallery, rerank)[1]
        seconds = time.perf_counter() - started
        truth = found if truth is None else truth
        points.append({"depth": depth, "qps": len(queries) / seconds, "recall@10": recall_at_10(found, truth)})
        print(factory, points[-1], flush=True)
        if points[-1]["recall@10"] > 0.999:
            break
    size = len(faiss.serialize_index(index)) / 2**20
    return {"factory": factory, "build_s": build, "size_mib": size, "points": points, "truth": truth}


def additions(gallery: np.ndarray) -> list[Additions]:
    """The gallery as the chunks retrieval index commits: made-up paths and hashes, no labels."""
    chunks = []
    for start in range(0, len(gallery), CHUNK):
        rows = range(start, min(start + CHUNK, len(gallery)))
        items = [Item(Path(f"/gallery/{i}.png"), "") for i in rows]
        chunks.append(Additions(gallery[start : start + CHUNK], items, [f"{i:064x}" for i in rows]))
    return chunks


def through_search(factory: str | None, gallery: np.ndarray, queries: np.ndarray, memory: int, folder: Path) -> tuple[GalleryIndex, dict]:
    """Builds the index with GalleryIndex.create (factory None: index.choice's pick), reads its items into memory (one
    warm-up call) and times 300 queries one at a time; the batch is timed by rounds() beside the other index."""
    started = time.perf_counter()
    index = GalleryIndex.create(folder / (factory or "auto"), additions(gallery), "bench", gallery.shape[1], factory, memory)
    build = time.perf_counter() - started
    started = time.perf_counter()
    index.search_arrays(queries[:10], 10)
    columns = time.perf_counter() - started
    single = []
    for row in range(300):
        started = time.perf_counter()
        index.search(queries[row : row + 1], 10)
        single.append(time.perf_counter() - started)
    row = {
        "factory": index.manifest.index_type,
        "choice": index.manifest.choice,
        "build_s": build,
        "items_in_memory_s": columns,
        "depth": index.manifest.search,
        "tuned_recall@10": index.manifest.recall_at_10,
        "latency_ms": float(np.median(single)) * 1e3,
    }
    return index, row


def batch_round(index: GalleryIndex, queries: np.ndarray) -> tuple[dict, np.ndarray]:
    """Batch QPS of the bare FAISS index at the tuned depth, of search_arrays and of search (Hit objects); the ids."""
    qps, found = {}, None
    for name, call in (
        ("qps_faiss", lambda: faiss_search(index.vectors, queries, 10, search_parameters(index.kind, index.manifest.depth))),
        ("qps", lambda: index.search_arrays(queries, 10)),
        ("qps_hits", lambda: index.search(queries, 10)),
    ):
        started = time.perf_counter()
        result = call()
        qps[name] = len(queries) / (time.perf_counter() - started)
        found = result.ids if name == "qps" else found
    return qps, found


def rounds(exact: GalleryIndex, auto: GalleryIndex, queries: np.ndarray, count: int) -> tuple[dict, dict, np.ndarray, np.ndarray]:
    """count rounds of exact then auto batches, so that a change in the machine's speed reaches both; the medians
    of each QPS and of the per-round speed-up over exact (the cores here vary by 2x between minutes)."""
    measured: dict[str, list[dict]] = {"exact": [], "auto": []}
    found: dict[str, np.ndarray] = {}
    for _ in range(count):
        for name, index in (("exact", exact), ("auto", auto)):
            qps, found[name] = batch_round(index, queries)
            measured[name].append(qps)
    medians = {name: {key: float(np.median([row[key] for row in rows])) for key in rows[0]} for name, rows in measured.items()}
    speedups = [a["qps"] / e["qps"] for a, e in zip(measured["auto"], measured["exact"])]
    medians["auto"]["speedup_rounds"] = speedups
    medians["auto"]["speedup"] = float(np.median(speedups))
    return medians["exact"], medians["auto"], found["exact"], found["auto"]


def plot(curves: list[dict], exact_qps: float, title: str, path: Path) -> None:
    """recall@10 against speed-up over exact search, one line per type, depths labelled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 5))
    for row in curves[1:]:
        speed = [point["qps"] / exact_qps for point in row["points"]]
        recall = [point["recall@10"] for point in row["points"]]
        axes.plot(speed, recall, marker="o", label=row["factory"])
        for x, y, point in zip(speed, recall, row["points"]):
            axes.annotate(str(point["depth"]), (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    axes.axhline(0.95, color="grey", linestyle=":", label="recall@10 0.95")
    axes.axvline(20, color="grey", linestyle="--", label="20x exact")
    axes.set(xscale="log", xlabel="batch QPS / exact batch QPS", ylabel="recall@10 (held-out queries)", title=title)
    axes.legend(fontsize=8)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="whitened", choices=["whitened", "encoder", "clustered"], help="whitened or encoder (fitted: bench/data/spectrum-*.json), or clustered")
    parser.add_argument("--size", type=int, default=1_000_000)
    parser.add_argument("--queries", type=int, default=10_000)
    parser.add_argument("--curve-queries", type=int, default=2_000)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--memory", default="64GB", help="budget given to the automatic choice")
    parser.add_argument("--types", default=None, help="factory strings for the curves separated by ; with Flat first (default: Flat, HNSW32, IVF-Flat, IVF-SQ8, OPQ+IVF-PQ; '' for none)")
    parser.add_argument("--no-auto", action="store_true", help="the curves only, without part 2")
    parser.add_argument("--rounds", type=int, default=3, help="part 2: batch rounds of exact then auto (medians)")
    parser.add_argument("--pages-ab", action="store_true", help="part 2 twice in one process: the indexes on 4 KiB pages, then on huge pages (index.faiss_ops.on_huge_pages)")
    parser.add_argument("--plot", type=Path, default=None, help="default docs/index-<data>.png")
    parser.add_argument("--out", type=Path, default=None, help="write the rows as JSON (a part not run this time is kept from the file)")
    args = parser.parse_args()
    gallery = generated(args.data, args.size, args.dim, seed=1)
    queries = generated(args.data, args.queries, args.dim, seed=2)
    nlist = nlist_for(args.size)
    types = ["Flat", "HNSW32", f"IVF{nlist},Flat", f"IVF{nlist},SQ8", f"OPQ32,IVF{nlist},PQ32"] if args.types is None else [t for t in args.types.split(";") if t]
    if types and types[0] != "Flat":
        raise SystemExit("put Flat first: it gives the exact neighbours")
    sample = gallery[np.random.default_rng(3).permutation(args.size)[: 40 * nlist]]
    curves, truth = [], None
    for factory in types:
        curves.append(curve(factory, gallery, sample, queries[: args.curve_queries], truth))
        truth = curves[0]["truth"]
    title = f"{args.size:,} x {args.dim}-d '{args.data}' vectors, {faiss.omp_get_max_threads()} threads"
    if curves:
        exact_qps = curves[0]["points"][0]["qps"]
        plot(curves, exact_qps, title, args.plot or Path(f"docs/index-{args.data}.png"))
        show_curves(curves, exact_qps, title)
    searched = [] if args.no_auto else automatic(args, gallery, queries, title)
    if args.out:
        kept = json.loads(args.out.read_text()) if args.out.is_file() else {}
        rows = {"data": args.data, "size": args.size, "curves": [{k: v for k, v in c.items() if k != "truth"} for c in curves] or kept.get("curves", [])}
        rows["search"] = searched or kept.get("search", [])
        args.out.write_text(json.dumps(rows, indent=1) + "\n")


def automatic(args: argparse.Namespace, gallery: np.ndarray, queries: np.ndarray, title: str) -> list[dict]:
    """Part 2: exact search and the automatic choice, built and searched through GalleryIndex, batches in rounds
    on huge pages, as an index that has answered index.store.HUGE_PAGES_AFTER queries is (with --pages-ab, first on
    4 KiB pages, then moved, in the same process: the rows of both)."""
    moved = index.store.on_huge_pages
    index.store.on_huge_pages = lambda vectors: 0  # moved before the rounds, as a server's index is, not within them
    with tempfile.TemporaryDirectory() as folder:
        exact_index, exact = through_search("Flat", gallery, queries, parse_memory(args.memory), Path(folder))
        auto_index, auto = through_search(None, gallery, queries, parse_memory(args.memory), Path(folder))
        pages = ["4 KiB", "huge"] if args.pages_ab else ["huge"]
        rows = []
        for name in pages:
            if name == "huge":
                started = time.perf_counter()
                taken = [moved(built.vectors) / 2**20 for built in (exact_index, auto_index)]
                print(f"moved {taken[0]:.0f} MiB (exact) and {taken[1]:.0f} MiB ({auto['factory']}) to huge pages in {time.perf_counter() - started:.1f} s")
            exact_qps, auto_qps, truth, found = rounds(exact_index, auto_index, queries, args.rounds)
            rows += [{**exact, **exact_qps, "pages": name}, {**auto, **auto_qps, "pages": name, "recall@10": recall_at_10(found, truth)}]
            show_auto(rows[-2], rows[-1], f"{auto['choice']}; pages: {name}", title)
    index.store.on_huge_pages = moved
    return rows


def show_curves(curves: list[dict], exact_qps: float, title: str) -> None:
    """One table row per type and depth."""
    table = Table(title=f"{title}: recall@10 by depth ({len(curves[0]['truth']):,} held-out queries, index.faiss_ops.search_ids)")
    for column in ("index", "build s", "size MiB", "depth", "batch QPS", "vs exact", "recall@10"):
        table.add_column(column, justify="right")
    for row in curves:
        for point in row["points"]:
            first = point is row["points"][0]
            build, size = (f"{row['build_s']:.1f}", f"{row['size_mib']:.0f}") if first else ("", "")
            table.add_row(row["factory"] if first else "", build, size, str(point["depth"] or "-"), f"{point['qps']:,.0f}", f"{point['qps'] / exact_qps:.1f}x", f"{point['recall@10']:.3f}")
    Console(width=160).print(table)


def show_auto(exact: dict, auto: dict, reason: str, title: str) -> None:
    """Exact search and the automatic choice, both built and searched as retrieval index and its callers do."""
    table = Table(title=f"{title}: through GalleryIndex.search_arrays; auto = {auto['factory']} ({reason})")
    columns = ("index", "build s", "tuned depth", "tuned recall (held-out sample)", "batch QPS", "vs exact", "vs bare FAISS", "as Hit objects", "1-query ms", "recall@10 held-out")
    for column in columns:
        table.add_column(column, justify="right")
    for row in (exact, auto):
        depth = ", ".join(f"{k}={v}" for k, v in row["depth"].items()) or "-"
        recall = row.get("recall@10", 1.0)
        table.add_row(row["factory"], f"{row['build_s']:.1f}", depth, f"{row['tuned_recall@10']:.3f}", f"{row['qps']:,.0f}", f"{row.get('speedup', 1.0):.1f}x", f"{row['qps'] / row['qps_faiss']:.2f}x", f"{row['qps_hits'] / row['qps_faiss']:.2f}x", f"{row['latency_ms']:.2f}", f"{recall:.3f}")
    Console(width=180).print(table)


if __name__ == "__main__":
    main()
