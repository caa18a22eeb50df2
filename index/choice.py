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
- more, when only the full vectors fit: `IVF<nlist>,Flat` (inverted lists over the uncompressed
  vectors: native removal, memory-mapping and exact scores of the candidates it visits);
- more, when one byte per dimension fits: `IVF<nlist>,SQ8` (8-bit scalar quantisation, 4× smaller);
- beyond that: `OPQ<m>,IVF<nlist>,PQ<m>` (product quantisation with a learned rotation), with the
  most bytes per vector m (64, 32, 16 or 8, dividing the dimension) that fits.

nlist is about 4·√n rounded to a power of two (1,000,000 vectors: 4096), within [256, 65536], as
FAISS's guidelines advise; IVF is trained on a seeded random sample of up to 40 vectors per list.
Every type's search depth (nprobe, or efSearch for HNSW) is then tuned at build time to the smallest
that reaches TARGET_RECALL recall@10 (plus a measured margin) against exact search for up to 1,000
of the gallery's vectors, held out of the index until then, so that the recall is that of new
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
OVERHEAD = 1.2  # FAISS's lists, centroids and allocator slack over the raw codes and ids
ID_BYTES = 8
GRAPH_BYTES = 272  # HNSW32's links per vector: 64 at the bottom layer, 32 on the few upper ones (measured at 1M)
HNSW = "HNSW32"
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
    match = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).upper() not in _UNITS:
        raise RetrievalError(f"--memory {text!r}: give a size such as 4GB, 512MiB or 2e9 (bytes)")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def default_memory() -> int:
    """Half of this machine's physical memory: the budget when --memory is not given."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2


def nlist_for(count: int) -> int:
    """Inverted lists for count vectors: about 4·√count, a power of two within [256, 65536]."""
    return int(min(65536, max(256, 2 ** round(math.log2(4 * math.sqrt(max(count, 1)))))))


def choose_index(count: int, dim: int, memory: int | None = None) -> IndexChoice:
    """The index type for count vectors of dim floats within memory bytes (default: half of RAM)."""
    budget = default_memory() if memory is None else memory
    if count <= EXACT_LIMIT:
        return IndexChoice("Flat", f"{count:,} vectors: exact search is fast enough up to {EXACT_LIMIT:,}")
    nlist = nlist_for(count)

    def size(code_bytes: int) -> float:
        return count * (code_bytes + ID_BYTES) * OVERHEAD

    if size(4 * dim + GRAPH_BYTES) <= budget:
        return IndexChoice(
            HNSW,
            (
                f"{count:,} vectors; the full vectors and a graph over them "
                f"({size(4 * dim + GRAPH_BYTES) / 1e9:.2f} GB) fit in {budget / 1e9:.2f} GB"
            ),
        )
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
