"""FAISS operations of the store: make and train an index, remove from it, read its vectors back, search it.

Searches order their candidates with retrieval.knn.ranked: by score, then by the lower id, for any
size of tie group. Compressed types (SQ, PQ) re-score rerank × k candidates with the exact vectors.
"""

from __future__ import annotations

import ctypes
import re
import sys
import threading
import warnings
from dataclasses import dataclass, field

import numpy as np

from index.choice import held_out
from index.types import index_kind
from retrieval.errors import RetrievalError
from retrieval.extras import require
from retrieval.knn import TIE_MARGIN, ranked

faiss = require("faiss", "cpu")  # or the gpu extra: faiss-gpu provides the same module

TRAIN_PER_LIST = 40  # IVF training vectors per inverted list (FAISS warns below 39)
PQ_TRAIN = 16_384  # at least 64 vectors for each of PQ's 256 centroids
SMALLEST = {"HNSW": 2, "IVF": 1}  # links or lists below which FAISS aborts or segfaults (measured)
RESCORED = "SQ and PQ types re-score their candidates with the exact vectors already"
REFUSED = {  # parts of a factory string whose index cannot grow or be searched as this store does (measured)
    "IDMap": "the index maps ids itself; leave IDMap out (e.g. {rest!r})",
    "NSG": "an NSG graph is built once and takes no additions (every `retrieval index` adds); give HNSW32",
    "Refine": f"leave Refine out: {RESCORED}",
    "RFlat": f"leave RFlat out: {RESCORED}",
}
EF_CONSTRUCTION = 80  # HNSW's candidates while linking a new vector (FAISS: 40); a better graph for 2x the build
MADV_COLLAPSE = 25  # Linux 6.1 on: back a range with 2 MiB pages now, not when the kernel's scanner gets to it
HUGE_PAGE = 1 << 21


def compressed(factory: str) -> bool:
    """Whether the type stores lossy codes (SQ, PQ) rather than the vectors."""
    return "PQ" in factory or "SQ" in factory


def parsed_factory(factory: str, dim: int, gallery: int | None = None) -> faiss.Index:
    """An empty index of the factory type (inner product), or one line saying why FAISS cannot build it; given the
    gallery's size, also when the type needs more vectors to train on than it has (checked before the gallery is
    embedded, and again when the index is made)."""
    for part, reason in REFUSED.items():  # a RuntimeError at the first addition or search
        if part in factory:
            raise RetrievalError(f"--faiss {factory!r}: {reason.format(rest=factory.split(',', 1)[-1])}")
    for part, size in re.findall(r"(HNSW|IVF)(\d+)", factory):
        if int(size) < SMALLEST[part]:
            raise RetrievalError(
                f"--faiss {factory!r}: {part}{size} is below {part}{SMALLEST[part]}, where FAISS fails or crashes; "
                f"give {part}{SMALLEST[part]} or more (e.g. HNSW32, IVF4096,Flat)"
            )
    try:
        index = faiss.index_factory(dim, factory, faiss.METRIC_INNER_PRODUCT)
    except RuntimeError as error:
        raise RetrievalError(
            f"--faiss {factory!r}: FAISS cannot build it ({first_line(error)}); see the FAISS index factory "
            "documentation (e.g. Flat, HNSW32, IVF4096,Flat, IVF4096,SQ8)"
        ) from None
    if gallery is not None and not index.is_trained:
        needed, trained_on = _needed(index, factory), gallery - held_out(gallery)
        if trained_on < needed:
            raise _too_few(factory, needed, trained_on, gallery)
    return index


def _needed(index: faiss.Index, factory: str) -> int:
    """The fewest vectors the type trains on: one per inverted list (or 256 for a type without lists: PQ's and SQ's
    codebooks), a PQ codebook's centroids (2^bits), and an OPQ rotation's output width (below it, FAISS corrupts its
    memory and the process aborts: OPQ16,PQ16 on 511 vectors of 512 dimensions, measured)."""
    needed = [faiss.extract_index_ivf(index).nlist if index_kind(factory) == "ivf" else 256]
    needed += [2 ** int(bits or 8) for bits in re.findall(r"(?<!O)PQ\d+(?:x(\d+))?", factory)]
    needed += [int(width or index.d) for width in re.findall(r"OPQ\d+(?:_(\d+))?", factory)]
    return max(needed)


def _too_few(factory: str, needed: int, count: int, gallery: int | None = None) -> RetrievalError:
    """The refusal of a type that needs more vectors to train on than count (of a gallery of that many, where given:
    a tenth of it is held out to measure the index's recall)."""
    had = (
        f"the gallery has {gallery:,}, of which {count:,} train it"
        if gallery and gallery != count
        else f"it has {count:,}"
    )
    return RetrievalError(
        f"--faiss {factory!r} needs at least {needed:,} vectors to train on, {had}; use a smaller type (e.g. Flat)"
    )


def new_index(factory: str, dim: int, sample: np.ndarray, gallery: int | None = None) -> faiss.Index:
    """An empty FAISS index of the factory type, trained on sample (of a gallery of that many, for the refusal of a
    sample too small) when the type needs training.

    IVF types keep the ids they are given (with a hash table from id to vector, so items can be
    found by id); the others are wrapped in IDMap2.
    """
    index = parsed_factory(factory, dim)
    needed = _needed(index, factory)
    ivf = faiss.extract_index_ivf(index) if index_kind(factory) == "ivf" else None
    if ivf is not None:
        ivf.set_direct_map_type(faiss.DirectMap.Hashtable)
        wanted = max(TRAIN_PER_LIST * ivf.nlist, PQ_TRAIN if "PQ" in factory else 0)
    else:
        if isinstance(index, faiss.IndexHNSW):
            index.hnsw.efConstruction = EF_CONSTRUCTION  # saved with the graph: later additions use it too
        index = faiss.IndexIDMap2(index)
        wanted = PQ_TRAIN
    if not index.is_trained:
        if len(sample) < needed:
            raise _too_few(factory, needed, len(sample), gallery)
        if ivf is not None and gpu_count():  # k-means of the inverted lists on the GPUs; the index stays a CPU one
            ivf.clustering_index = on_gpus(faiss.IndexFlatIP(dim), "flat")
        try:
            index.train(sample[:wanted])
        except RuntimeError as error:  # a requirement of FAISS's not checked above
            raise RetrievalError(f"--faiss {factory!r}: FAISS cannot train it ({first_line(error)})") from None
    return index


def remove_ids(vectors: faiss.Index, ids: np.ndarray, kind: str) -> faiss.Index:
    """vectors without ids: natively, or for HNSW (which cannot remove) by rebuilding from its stored vectors."""
    if kind != "hnsw":
        vectors.remove_ids(ids)
        return vectors
    stored_ids, stored = stored_vectors(vectors)
    keep = ~np.isin(stored_ids, ids)
    graph = faiss.clone_index(faiss.downcast_index(vectors.index))
    graph.reset()
    rebuilt = faiss.IndexIDMap2(graph)
    rebuilt.add_with_ids(stored[keep], stored_ids[keep])
    return rebuilt


def stored_vectors(vectors: faiss.Index) -> tuple[np.ndarray, np.ndarray]:
    """(ids, vectors) held by an index whose codes are the vectors themselves (Flat, HNSW over Flat, IVF-Flat).

    Raises RetrievalError for compressed codes (SQ, PQ), which only approximate the vectors.
    """
    if isinstance(vectors, faiss.IndexIDMap2):
        inner = faiss.downcast_index(vectors.index)
        storage = faiss.downcast_index(inner.storage) if isinstance(inner, faiss.IndexHNSW) else inner
        if isinstance(storage, faiss.IndexFlat):
            ids = faiss.vector_to_array(vectors.id_map).astype(np.int64)
            return ids, numpy_call(inner, "reconstruct_n", 0, inner.ntotal)  # type: ignore[return-value]
    elif isinstance(vectors, faiss.IndexIVFFlat):  # the codes of each inverted list are its float vectors
        return _inverted_lists(vectors)
    raise RetrievalError("this index stores compressed codes, not the vectors themselves")


def _inverted_lists(vectors: faiss.IndexIVFFlat) -> tuple[np.ndarray, np.ndarray]:
    lists = vectors.invlists
    ids, rows = [np.zeros(0, np.int64)], [np.zeros((0, vectors.d), np.float32)]
    for number in range(vectors.nlist):
        size = lists.list_size(number)
        if size:
            ids.append(faiss.rev_swig_ptr(lists.get_ids(number), size).copy())
            codes = faiss.rev_swig_ptr(lists.get_codes(number), size * lists.code_size)
            rows.append(codes.view(np.float32).reshape(size, vectors.d).copy())
    return np.concatenate(ids), np.concatenate(rows)


def search_ids(
    index: faiss.Index,
    queries: np.ndarray,
    k: int,
    params: object | None,
    raw: np.ndarray | None,
    rerank: int,
    total: int | None = None,
    block: int = 1024,
) -> tuple[np.ndarray, np.ndarray]:
    """(scores, ids) of the k best items for each query, by score, then by the lower id.

    With exact vectors (raw, row id - 1) and rerank > 1, the rerank × k best by the index's codes are
    re-scored exactly and the k best kept. total: how many items the search can reach (default: all).
    """
    total = int(index.ntotal) if total is None else total

    def fetch(rows: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
        return faiss_search(index, rows, n, params)

    if raw is None or rerank <= 1:
        ids, scores = ranked(fetch, queries, k, total, margin=_tie_margin(params, k))
        return scores, ids
    scores = np.full((len(queries), k), -np.inf, np.float32)
    ids = np.full((len(queries), k), -1, np.int64)
    for start in range(0, len(queries), block):
        rows = slice(start, start + block)
        candidates = faiss_search(index, queries[rows], min(k * rerank, total), params)[1]
        exact = np.einsum("qcd,qd->qc", np.asarray(raw[np.maximum(candidates, 1) - 1], np.float32), queries[rows])
        exact[candidates < 0] = -np.inf
        best = np.lexsort((candidates, candidates < 0, -exact), axis=1)[:, :k]
        scores[rows, : best.shape[1]] = np.take_along_axis(exact, best, axis=1)
        ids[rows, : best.shape[1]] = np.where(
            scores[rows, : best.shape[1]] > -np.inf, np.take_along_axis(candidates, best, axis=1), -1
        )
    return scores, ids


def _tie_margin(params: object | None, k: int) -> int:
    """The candidates fetched beyond k, to see tie groups at the k-th place whole: TIE_MARGIN, but for a graph no
    more than its depth leaves (a graph keeps max(efSearch, k) candidates: 18 at efSearch 16 searched deeper than
    the depth tuned, at 0.82x of the bare graph's speed against 0.90x fetching 16)."""
    if isinstance(params, faiss.SearchParametersHNSW):
        return min(TIE_MARGIN, params.efSearch - k)
    return TIE_MARGIN


def numpy_call(index: faiss.Index, method: str, *args: object, **options: object) -> object:
    """Calls FAISS's numpy method, also when faiss.contrib.torch_utils (imported by
    pytorch-metric-learning, for one) has replaced it by one that returns torch tensors or takes no
    search parameters; the numpy originals are then kept as <method>_numpy."""
    return getattr(index, f"{method}_numpy", getattr(index, method))(*args, **options)


def faiss_search(
    index: faiss.Index, queries: np.ndarray, k: int, params: object | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """index.search with per-call search parameters (see numpy_call), on the cores serve_on gave (if it was called).
    An HNSW search keeps at least k candidates (efSearch >= k), or it returned fewer hits than asked: 297 of k=500
    on 1,004 items at efSearch 27."""
    if isinstance(params, faiss.SearchParametersHNSW) and params.efSearch < k:
        params = faiss.SearchParametersHNSW(efSearch=int(k), sel=params.sel)
    if _SERVING.threads and getattr(_SERVING.here, "threads", 0) != _SERVING.threads:
        faiss.omp_set_num_threads(_SERVING.threads)  # OpenMP's thread count belongs to each calling thread
        _SERVING.here.threads = _SERVING.threads
    return numpy_call(index, "search", queries, k, params=params)  # type: ignore[return-value]


def gpu_count() -> int:
    """GPUs FAISS can use here (0 with faiss-cpu, or with faiss-gpu on a machine without one)."""
    if hasattr(faiss, "get_num_gpus") and hasattr(faiss, "GpuMultipleClonerOptions"):
        return int(faiss.get_num_gpus())
    return 0


def on_gpus(vectors: faiss.Index, kind: str) -> faiss.Index:
    """vectors copied to all GPUs, sharded (each holds a part), or vectors itself without GPUs.

    HNSW has no GPU version and stays on the CPU; a type the GPU cloner refuses stays there too,
    with a warning that says why.
    """
    if kind == "hnsw" or gpu_count() == 0:
        return vectors
    options = faiss.GpuMultipleClonerOptions()
    options.shard = True
    try:
        return faiss.index_cpu_to_all_gpus(vectors, co=options)
    except RuntimeError as error:
        warnings.warn(
            f"searching on the CPU: FAISS cannot move this index to the GPU ({first_line(error)})", stacklevel=2
        )
        return vectors


def on_huge_pages(vectors: faiss.Index) -> int:
    """Backs what a search reads at random, the stored codes and a graph's links, with 2 MiB pages where Linux can
    (madvise MADV_COLLAPSE, 6.1 on); returns the bytes moved (0 on other systems, where the kernel cannot, or for
    memory-mapped codes). A graph search reads thousands of vectors scattered over the gallery, and with 4 KiB pages
    nearly every read also misses the TLB: HNSW on a million vectors searched 7-11% faster after the move, on 200,000
    17% (docs/benchmarks.md), which took 1-2 s a GiB, once."""
    if not sys.platform.startswith("linux"):
        return 0
    inner = faiss.downcast_index(vectors.index) if isinstance(vectors, faiss.IndexIDMap2) else vectors
    arrays = [(inner.hnsw.neighbors, 4)] if isinstance(inner, faiss.IndexHNSW) else []
    storage = faiss.downcast_index(inner.storage) if isinstance(inner, faiss.IndexHNSW) else inner
    if isinstance(storage, faiss.IndexFlatCodes):
        arrays.append((storage.codes, 1))
    return sum(_collapse(array, width) for array, width in arrays if array.is_owned and array.size())


def _collapse(array: object, width: int) -> int:
    """The whole 2 MiB pages within a FAISS array of items width bytes wide, collapsed; the bytes (0: refused)."""
    start = int(faiss.rev_swig_ptr(array.data(), 1).__array_interface__["data"][0])  # type: ignore[attr-defined]
    end = start + array.size() * width  # type: ignore[attr-defined]
    first, last = -(-start // HUGE_PAGE) * HUGE_PAGE, end // HUGE_PAGE * HUGE_PAGE
    if last <= first:
        return 0
    libc = ctypes.CDLL(None)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return last - first if libc.madvise(first, last - first, MADV_COLLAPSE) == 0 else 0


def search_parameters(kind: str, depth: int | None, selector: object | None = None) -> object | None:
    """Per-call search parameters: nprobe (IVF) or efSearch (HNSW) and an ID selector; None: the index's."""
    options: dict = {} if selector is None else {"sel": selector}
    if kind != "flat" and depth is not None:
        options["nprobe" if kind == "ivf" else "efSearch"] = int(depth)
    if not options:
        return None
    return {"ivf": faiss.SearchParametersIVF, "hnsw": faiss.SearchParametersHNSW}.get(kind, faiss.SearchParameters)(
        **options
    )


def first_line(error: BaseException, limit: int = 200) -> str:
    """The first line of an error's message, cut to limit characters, without the C++ function and source line that
    FAISS's messages start with ("Error in <function> at <file>:<line>: <what>")."""
    line = (str(error).splitlines() or [""])[0]
    return re.sub(r"^Error in .* at \S+:\d+: ", "", line)[:limit]


@dataclass
class _Serving:
    threads: int = 0  # 0: FAISS's own default (every core)
    here: threading.local = field(default_factory=threading.local)  # the count each searching thread has set


_SERVING = _Serving()


def serve_on(threads: int) -> None:
    """FAISS's OpenMP on `threads` cores in every thread that searches from now on: a search server's batches are
    small, and OpenMP's threads spin after each call, which such a server pays for in CPU (twice its cost)."""
    _SERVING.threads = max(1, threads)
