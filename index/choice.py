"""Which FAISS index a gallery gets: exact while that is cheap, approximate only where it must be.

The rules (after autofaiss's, simplified to the types this project saves and removes from):

- up to EXACT_LIMIT (100,000) vectors: `Flat`, exact inner product. Brute force over 100,000 × 512
  floats is a few milliseconds per query batch row on a CPU, and exact search needs no training,
  no tuning and loses no recall.
- more, when the full vectors and a 32-link graph over them fit in the memory budget: `HNSW32`.
  On embeddings whose neighbours cross cluster boundaries (bench/index.py's sets fitted to a real
  encoder's spectrum), inverted lists must visit a large share of the gallery to find 95% of the
  true top 10: at 1,000,000 vectors `IVF4096,Flat` found 0.939 at nprobe 64 (5.8× the speed of exact
  search) and 0.980 at 128 (2.8×), where the graph found 0.959 at efSearch 16 (21–34× through
  GalleryIndex.search; docs/benchmarks.md).
  The graph costs about GRAPH_BYTES a vector, a longer build, and removals rebuild it;
- the same, when the gallery's intrinsic dimension (TwoNN, measured on the build's sample) is at least
  HIGH_DIMENSION and twice the links fit: `HNSW64`. On the `whitened` set (intrinsic dimension about
  30, the default export's shape) HNSW64 reached recall@10 0.958 at efSearch 48 where HNSW32 needed
  efSearch 96 (bench/ann_alternatives.py); through the search call the automatic HNSW64 gave 0.960 at
  8.1x exact search, where HNSW32 built as FAISS builds by default gave 0.962 at 3.3x
  (docs/benchmarks.md). On the `encoder` set (about 13) HNSW32 is enough at efSearch 16. Every graph is
  built with efConstruction EF_CONSTRUCTION (index.faiss_ops: 80, FAISS's default is 40);
- more, when only the full vectors fit: `IVF<nlist>,Flat` (inverted lists over the uncompressed
  vectors: native removal, memory-mapping and exact scores of the candidates it visits);
- more, when one byte per dimension fits: `IVF<nlist>,SQ8` (8-bit scalar quantisation, 4× smaller);
- beyond that: `OPQ<m>,IVF<nlist>,PQ<m>` (product quantisation with a learned rotation), with the
  most bytes per vector m (64, 32, 16 or 8, dividing the dimension) that fits.

nlist is about 4·√n rounded to a power of two (1,000,000 vectors: 4096), within [256, 65536], as
FAISS's guidelines advise; IVF is trained on a seeded random sample of up to 40 vectors per list.
Every type's search depth (nprobe, or efSearch for HNSW) is then tuned at build time to the smallest
that reaches TARGET_RECALL recall@10 (plus two standard errors of the estimate) against exact search
for up to 2,000 of the gallery's vectors, held out of the index until then, so that the recall is that of new
queries (index.tuning).
Memory counts the codes, the graph, the ids and 20% for FAISS's own structures.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass

from retrieval.errors import RetrievalError

EXACT_LIMIT = 100_000
TARGET_RECALL = 0.95
RECALL_SAMPLE = 2000  # gallery vectors held out as queries to tune recall@10 against exact search (at most a tenth)
OVERHEAD = 1.2  # FAISS's lists, centroids and allocator slack over the raw codes and ids
ID_BYTES = 8
GRAPH_BYTES = 272  # HNSW32's links per vector: 64 at the bottom layer, 32 on the few upper ones (measured at 1M)
HNSW = "HNSW32"
DENSE_HNSW = "HNSW64"  # twice the links, for galleries of a high intrinsic dimension (2 x GRAPH_BYTES a vector)
HIGH_DIMENSION = 20.0  # TwoNN intrinsic dimension of the gallery's sample from which the denser graph pays
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 1e3,
    "MB": 1e6,
    "GB": 1e9,
    "TB": 1e12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


@dataclass(frozen=True)
class IndexChoice:
    """A FAISS factory string and why it was chosen."""

    factory: str
    reason: str


def parse_memory(text: str) -> int:
    """Bytes in "4GB", "512MiB", "2e9" (decimal units: KB, MB, GB, TB; binary: KiB, MiB, GiB, TiB)."""
    match = re.fullmatch(r"\s*((?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:e[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    size = float(match.group(1)) * _UNITS[match.group(2).upper()] if match and match.group(2).upper() in _UNITS else 0
    if not 1 <= size < math.inf:  # 0GB chose as if nothing fitted; 1e400GB overflowed
        raise RetrievalError(f"--memory {text!r}: give a size such as 4GB, 512MiB or 2e9 (bytes)")
    return int(size)


def default_memory() -> int:
    """Half of this machine's physical memory: the budget when --memory is not given."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2


def _graph(count: int, budget: int, intrinsic: float | None, sparse: float, dense: float) -> IndexChoice | None:
    """HNSW64 where the gallery's intrinsic dimension is high and its graph fits, else HNSW32 where it fits."""
    fits = f"the full vectors and a graph over them ({{:.2f}} GB) fit in {budget / 1e9:.2f} GB"
    if intrinsic is not None and intrinsic >= HIGH_DIMENSION and dense <= budget:
        return IndexChoice(
            DENSE_HNSW,
            f"{count:,} vectors of intrinsic dimension {intrinsic:.0f} (≥ {HIGH_DIMENSION:.0f}: a graph of 64 links "
            f"finds their neighbours with fewer visits); {fits.format(dense / 1e9)}",
        )
    if sparse <= budget:
        measured = "" if intrinsic is None else f" of intrinsic dimension {intrinsic:.0f}"
        return IndexChoice(HNSW, f"{count:,} vectors{measured}; {fits.format(sparse / 1e9)}")
    return None


def approximate(count: int) -> bool:
    """Whether count vectors get an approximate index (above EXACT_LIMIT), whose choice needs their measured shape."""
    return count > EXACT_LIMIT


def nlist_for(count: int) -> int:
    """Inverted lists for count vectors: about 4·√count, a power of two within [256, 65536]."""
    return int(min(65536, max(256, 2 ** round(math.log2(4 * math.sqrt(max(count, 1)))))))


def choose_index(count: int, dim: int, memory: int | None = None, intrinsic: float | None = None) -> IndexChoice:
    """The index type for count vectors of dim floats within memory bytes (default: half of RAM), given the
    intrinsic dimension measured on a sample of them (index.tuning.intrinsic_dimension; None: not measured)."""
    budget = default_memory() if memory is None else memory
    if not approximate(count):
        return IndexChoice("Flat", f"{count:,} vectors: exact search is fast enough up to {EXACT_LIMIT:,}")
    nlist = nlist_for(count)

    def size(code_bytes: int) -> float:
        return count * (code_bytes + ID_BYTES) * OVERHEAD

    graph = _graph(count, budget, intrinsic, size(4 * dim + GRAPH_BYTES), size(4 * dim + 2 * GRAPH_BYTES))
    if graph is not None:
        return graph
    if size(4 * dim) <= budget:
        return IndexChoice(
            f"IVF{nlist},Flat",
            (
                f"{count:,} vectors; the full vectors ({size(4 * dim) / 1e9:.2f} GB) fit in "
                f"{budget / 1e9:.2f} GB, with a graph over them they do not"
            ),
        )
    if size(dim) <= budget:
        return IndexChoice(
            f"IVF{nlist},SQ8",
            (
                f"{count:,} vectors; 8-bit codes ({size(dim) / 1e9:.2f} GB) "
                f"fit in {budget / 1e9:.2f} GB, the full vectors do not"
            ),
        )
    for m in (64, 32, 16, 8):
        if dim % m == 0 and size(m) <= budget:
            return IndexChoice(
                f"OPQ{m},IVF{nlist},PQ{m}",
                (
                    f"{count:,} vectors; {m}-byte product-quantised codes "
                    f"({size(m) / 1e9:.2f} GB) fit in {budget / 1e9:.2f} GB"
                ),
            )
    smallest = next((m for m in (8, 16, 32, 64) if dim % m == 0), None)
    need = f"{size(smallest) / 1e9:.2f} GB" if smallest else "a dimension divisible by 8"
    raise RetrievalError(
        f"--memory {budget / 1e9:.2f} GB is too small for {count:,} {dim}-d "
        f"vectors: the smallest index here needs {need}; raise --memory"
    )


def held_out(count: int) -> int:
    """Of a new index's count vectors, how many are held out as queries that tune its recall@10 against exact search
    (at most a tenth, RECALL_SAMPLE at most): the others train it."""
    return min(RECALL_SAMPLE, count // 10)
