"""A gallery index on disk: FAISS vectors + SQLite metadata + a manifest, written atomically.

Layout (ARCHITECTURE.md): `manifest.json`, `vectors.faiss` (ids are the SQLite row ids) and
`items.sqlite` (id, path, label, sha256, added_at). A save writes a complete temporary sibling
directory, fsyncs it and renames it into place, so a crash leaves the old index or the new one.

The FAISS type is chosen by index.choice (or forced with a factory string) when an index is
created, and kept by later updates. Removal: Flat and IVF types remove natively; HNSW cannot, so
removing from it rebuilds the graph from the vectors it stores. Readers never see a half-written
index: each save is a new directory swapped into place, and an open GalleryIndex keeps reading the
version it loaded (reload to see a newer one). Writers go one at a time: `writer_lock` (an flock on
the sibling file `.NAME.lock`) is held by `retrieval index` and by the app's add/remove around their
read-modify-write, across processes; readers need no lock.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import sqlite3
import time
import warnings
from collections.abc import Iterable, Iterator, Sequence
from contextlib import closing, contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from index.choice import TARGET_RECALL, IndexChoice, choose_index
from retrieval.data import Item
from retrieval.errors import RetrievalError
from retrieval.extras import require
from retrieval.runs import file_sha256, fsync_dir, read_json, write_json

faiss = require("faiss", "cpu")  # or the gpu extra: faiss-gpu provides the same module

FORMAT_VERSION = 1
RECALL_SAMPLE = 1000  # own vectors used as queries to tune and measure recall@10 against exact search
TRAIN_PER_LIST = 40  # IVF training vectors per inverted list (FAISS warns below 39)
PQ_TRAIN = 16_384  # at least 64 vectors for each of PQ's 256 centroids
PLATEAU = 0.002  # recall@10 gained by doubling the search depth below which tuning stops
SAMPLE_LIMIT = TRAIN_PER_LIST * 16_384  # enough to train the lists of up to about 17 million vectors
MANIFEST = "manifest.json"
VECTORS = "vectors.faiss"
ITEMS = "items.sqlite"
RAW = "raw.f32"  # compressed types only: the exact float32 vectors, row id - 1, read memory-mapped to re-rank
RERANK = 8  # compressed types re-score this many candidates per result exactly


@dataclass(frozen=True)
class Hit:
    """One search result."""

    id: int
    path: str
    label: str
    score: float
    sha256: str


class GalleryIndex:
    """Exact inner-product search over L2-normalised embeddings, with the items they came from."""

    def __init__(self, directory: Path, manifest: dict, vectors: faiss.Index) -> None:
        self.directory = directory
        self.manifest = manifest
        self.vectors = vectors  # the CPU index, as saved
        self._searcher: faiss.Index | None = None
        self._raw: np.ndarray | None = None

    @property
    def raw(self) -> np.ndarray | None:
        """The exact vectors of a compressed index (row id - 1), memory-mapped; None for other types."""
        if self._raw is None and self.manifest.get("rerank"):
            self._raw = open_raw(self.directory, int(self.manifest["next_id"]) - 1, self.dim)
        return self._raw

    @property
    def searcher(self) -> faiss.Index:
        """The index searches run on: a copy sharded over every GPU FAISS sees, else the CPU index."""
        if self._searcher is None:
            self._searcher = on_gpus(self.vectors, self.kind)
        return self._searcher

    @property
    def dim(self) -> int:
        return int(self.manifest["dim"])

    def __len__(self) -> int:
        return int(self.vectors.ntotal)

    @property
    def encoder_sha256(self) -> str:
        return str(self.manifest["encoder_sha256"])

    @classmethod
    def build(cls, directory: Path, vectors: np.ndarray, items: Sequence[Item], hashes: Sequence[str], encoder_sha256: str) -> "GalleryIndex":
        """Builds an exact index of vectors (ids 1..N in item order) and saves it atomically to directory."""
        vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        if len(vectors) != len(items) or len(items) != len(hashes):
            raise RetrievalError(f"{len(vectors)} vectors for {len(items)} items and {len(hashes)} hashes")
        return cls.create(Path(directory), [Additions(vectors, list(items), list(hashes))], encoder_sha256, vectors.shape[1])

    @classmethod
    def create(
        cls, directory: Path, additions: Iterable[Additions], encoder_sha256: str, dim: int, factory: str | None = None, memory: int | None = None
    ) -> "GalleryIndex":
        """Builds a new index from re-iterable chunks of items and saves it atomically to directory (replacing any there).

        The type is index.choice's pick for the count and the memory budget in bytes, or the FAISS factory string given.
        """
        return commit(Path(directory), None, additions, [], encoder_sha256, dim, factory, memory)

    def update(self, additions: Iterable[Additions], remove_ids: Sequence[int]) -> "GalleryIndex":
        """Saves a new version of this index with items added and removed; this object stays as it was."""
        return commit(self.directory, self, additions, remove_ids, self.encoder_sha256, self.dim)

    @classmethod
    def load(cls, directory: Path, encoder_sha256: str | None = None, dim: int | None = None, mmap: bool = False) -> "GalleryIndex":
        """Opens a saved index, refusing one that is incomplete or was built by another encoder.

        With mmap, the vectors stay on disk and pages are read as searches touch them (IVF lists
        and flat storage), for galleries larger than memory.
        """
        directory = Path(directory)
        if not (directory / MANIFEST).is_file():
            raise RetrievalError(f"{directory}: not an index (no {MANIFEST}); build one with `retrieval index RUN IMAGES`")
        manifest = read_json(directory / MANIFEST)
        missing = {"format_version", "dim", "count", "next_id", "encoder_sha256", "created"} - set(manifest)
        if missing:
            raise RetrievalError(f"{directory / MANIFEST}: lacks {', '.join(sorted(missing))}; rebuild the index with `retrieval index --rebuild`")
        if manifest.get("format_version") != FORMAT_VERSION:
            raise RetrievalError(f"{directory}: index format {manifest.get('format_version')} is not {FORMAT_VERSION}; rebuild it with `retrieval index`")
        if encoder_sha256 is not None and manifest.get("encoder_sha256") != encoder_sha256:
            raise RetrievalError(
                f"{directory}: built with encoder {str(manifest.get('encoder_sha256'))[:12]}…, not with this model ({encoder_sha256[:12]}…); "
                "rebuild it with `retrieval index RUN IMAGES`"
            )
        if dim is not None and manifest.get("dim") != dim:
            raise RetrievalError(f"{directory}: holds {manifest.get('dim')}-dimensional vectors, the encoder makes {dim}; rebuild the index")
        if manifest.get("backend") == "milvus":
            from index.milvus import MilvusIndex

            return MilvusIndex.load(directory, manifest)  # type: ignore[return-value]
        for name in (VECTORS, ITEMS):
            if not (directory / name).is_file():
                raise RetrievalError(f"{directory}: {name} is missing; rebuild the index with `retrieval index`")
        for name, digest in manifest.get("sha256", {}).items():
            if mmap and name == VECTORS:
                continue  # memory-mapped: reading the whole file to hash it would defeat the purpose
            if not (directory / name).is_file() or file_sha256(directory / name) != digest:
                raise RetrievalError(f"{directory / name}: missing, or its bytes do not match the manifest's sha256 (damaged or truncated); rebuild the index")
        try:
            vectors = faiss.read_index(str(directory / VECTORS), faiss.IO_FLAG_MMAP if mmap else 0)
        except RuntimeError as error:
            raise RetrievalError(f"{directory / VECTORS}: FAISS cannot read it ({str(error).splitlines()[0]}); rebuild the index") from None
        if vectors.ntotal != manifest.get("count") or vectors.d != manifest.get("dim"):
            raise RetrievalError(f"{directory}: {VECTORS} holds {vectors.ntotal}x{vectors.d} vectors, the manifest says {manifest.get('count')}x{manifest.get('dim')}; rebuild the index")
        try:
            with _read_only(directory / ITEMS) as connection:
                (rows,) = connection.execute("SELECT COUNT(*) FROM items").fetchone()
        except sqlite3.DatabaseError as error:
            raise RetrievalError(f"{directory / ITEMS}: SQLite cannot read it ({error}); rebuild the index") from None
        if rows != vectors.ntotal:
            raise RetrievalError(f"{directory}: {ITEMS} has {rows} items for {vectors.ntotal} vectors; rebuild the index")
        index = cls(directory, manifest, vectors)
        _ = index.raw  # checks the exact vectors of a compressed index now, not at the first search
        return index

    @property
    def kind(self) -> str:
        """flat, ivf or hnsw, from the index type (indexes saved before types were chosen say IDMap2,Flat)."""
        return index_kind(str(self.manifest.get("index_type", "Flat")))

    def search(self, queries: np.ndarray, k: int = 10, depth: int | None = None, rerank: int | None = None, label: str | None = None) -> list[list[Hit]]:
        """Returns the k best hits for each query row, best first.

        depth is nprobe for IVF indexes and efSearch for HNSW (default: the value tuned at build time);
        exact indexes have none. Compressed indexes (SQ, PQ) fetch rerank × k candidates and re-score
        them with the exact vectors (default RERANK; 0 or 1: the compressed scores as they are).
        label: only items with this label (a FAISS ID selector, searched on the CPU index).
        """
        queries = np.ascontiguousarray(np.atleast_2d(queries), dtype=np.float32)
        if queries.shape[1] != self.dim:
            raise RetrievalError(f"queries have dimension {queries.shape[1]}, the index {self.dim}")
        if depth is not None and self.kind == "flat":
            raise RetrievalError(f"a search depth (nprobe/efSearch) does not apply to this {self.manifest.get('index_type', 'Flat')} index: it searches exactly")
        if depth is not None and depth < 1:
            raise RetrievalError(f"the search depth must be at least 1, got {depth}")
        tuned = next(iter(self.manifest.get("search", {}).values()), None)
        k = max(1, min(k, len(self)))
        factor = int(self.manifest.get("rerank", 0)) if rerank is None else rerank
        allowed = None if label is None else self._ids_with_label(label)
        if allowed is not None and not len(allowed):
            return [[] for _ in queries]
        searcher = self.searcher if allowed is None else self.vectors  # FAISS's GPU indexes take no selector
        selector = None if allowed is None else faiss.IDSelectorBatch(len(allowed), faiss.swig_ptr(allowed))
        scores, ids = search_ids(searcher, queries, k, search_parameters(self.kind, depth or tuned, selector), self.raw, factor)
        found = self.rows(ids[ids >= 0].tolist())
        return [
            [Hit(int(i), found[int(i)][0], found[int(i)][1], float(s), found[int(i)][2]) for i, s in zip(row_ids, row_scores) if i >= 0]
            for row_ids, row_scores in zip(ids, scores)
        ]

    def _ids_with_label(self, label: str) -> np.ndarray:
        with _read_only(self.directory / ITEMS) as connection:
            return np.array([row[0] for row in connection.execute("SELECT id FROM items WHERE label = ?", (label,))], dtype=np.int64)

    def search_items(self, ids: Sequence[int], k: int = 10, depth: int | None = None, label: str | None = None) -> list[list[Hit]]:
        """The k nearest items to items already indexed, each one itself left out (queries by id)."""
        found = self.search(self.vectors_of(ids), k + 1, depth, label=label)
        return [[hit for hit in row if hit.id != item][:k] for row, item in zip(found, ids)]

    def vectors_of(self, ids: Sequence[int]) -> np.ndarray:
        """The stored vectors of indexed items, to search with items already in the gallery."""
        known = self.rows(list(ids))
        if len(known) != len(set(ids)):
            raise RetrievalError(f"{self.directory}: no item with id(s) {', '.join(str(i) for i in ids if i not in known)[:200]} in this index")
        if self.raw is not None:
            return np.asarray(self.raw[np.asarray(ids, np.int64) - 1], np.float32)
        try:
            return np.stack([numpy_call(self.vectors, "reconstruct", int(i)) for i in ids]) if len(ids) else np.zeros((0, self.dim), np.float32)
        except RuntimeError as error:
            raise RetrievalError(f"{self.directory}: a {self.manifest.get('index_type')} index cannot give its vectors back ({str(error).splitlines()[0][:120]})") from None

    def items(self) -> dict[int, Item]:
        """Returns every indexed item by id."""
        return {i: Item(Path(path), label) for i, (path, label, _) in self.rows().items()}

    def rows(self, ids: Sequence[int] | None = None) -> dict[int, tuple[str, str, str]]:
        """Returns (path, label, sha256) of the items with these ids (all items when ids is None)."""
        query = "SELECT id, path, label, sha256 FROM items"
        with _read_only(self.directory / ITEMS) as connection:
            if ids is None:
                rows = connection.execute(f"{query} ORDER BY id").fetchall()
            else:
                unique = sorted(set(ids))
                rows = []
                for start in range(0, len(unique), 500):
                    chunk = unique[start : start + 500]
                    rows += connection.execute(f"{query} WHERE id IN ({','.join('?' * len(chunk))})", chunk).fetchall()
        return {int(i): (path, label, digest) for i, path, label, digest in rows}


@dataclass(frozen=True)
class Additions:
    """A chunk of new items with their vectors and file hashes."""

    vectors: np.ndarray
    items: list[Item]
    hashes: list[str]


def commit(
    directory: Path,
    base: GalleryIndex | None,
    additions: Iterable[Additions],
    remove_ids: Sequence[int],
    encoder_sha256: str,
    dim: int,
    factory: str | None = None,
    memory: int | None = None,
) -> GalleryIndex:
    """Writes base (or a new index) with removals and additions to directory, atomically.

    A new index gets the type index.choice picks for its size and the memory budget (or the FAISS
    factory string given); it reads additions twice (a seeded sample to train on and to measure
    recall with, then everything), so they must be re-iterable. Everything is written into a
    temporary sibling directory, fsynced and renamed into place, so a crash leaves the previous index
    whole. New items get ids after the highest ever given (ids of removed items are never reused).
    """
    now = datetime.now(timezone.utc).isoformat(timespec="seconds")
    for leftover in [*directory.parent.glob(f".{directory.name}.tmp-*"), *directory.parent.glob(f".{directory.name}.old-*")]:
        shutil.rmtree(leftover, ignore_errors=True)  # of a writer killed part-way (writers go one at a time)
    staging = directory.with_name(f".{directory.name}.tmp-{time.time_ns()}")
    staging.mkdir(parents=True)
    try:
        probe: RecallProbe | None = None
        if base is None:
            count, sample = _sample(additions, dim)
            if count == 0:
                raise RetrievalError(f"{directory}: nothing to index (no readable images)")
            choice = IndexChoice(factory, "given with --faiss") if factory else choose_index(count, dim, memory)
            vectors = new_index(choice.factory, dim, sample)
            probe = None if choice.factory == "Flat" else RecallProbe(sample[:RECALL_SAMPLE])
            _create_items(staging / ITEMS)
            created, next_id = now, 1
            described = {"index_type": choice.factory, "choice": choice.reason, "rerank": RERANK if compressed(choice.factory) else 0}
        else:
            vectors = faiss.clone_index(base.vectors)
            shutil.copyfile(base.directory / ITEMS, staging / ITEMS)
            created, next_id = base.manifest["created"], int(base.manifest["next_id"])
            described = {key: base.manifest[key] for key in ("index_type", "choice", "rerank", "search", "recall@10") if key in base.manifest}
        if described.get("rerank") and base is not None:
            shutil.copyfile(base.directory / RAW, staging / RAW)
        kind = index_kind(str(described.get("index_type", "Flat")))
        with closing(sqlite3.connect(staging / ITEMS)) as connection, open(staging / RAW if described.get("rerank") else os.devnull, "ab") as raw:
            if remove_ids:
                vectors = _remove(vectors, np.asarray(remove_ids, dtype=np.int64), kind)
                connection.executemany("DELETE FROM items WHERE id = ?", [(int(i),) for i in remove_ids])
            for chunk in additions:
                ids = np.arange(next_id, next_id + len(chunk.items), dtype=np.int64)
                rows = np.ascontiguousarray(chunk.vectors, dtype=np.float32)
                vectors.add_with_ids(rows, ids)
                raw.write(rows.tobytes())  # row id - 1: ids are given in order
                if probe is not None:
                    probe.see(rows, ids)
                connection.executemany(
                    "INSERT INTO items VALUES (?, ?, ?, ?, ?)",
                    [(int(i), str(item.path), item.label, digest, now) for i, item, digest in zip(ids, chunk.items, chunk.hashes)],
                )
                next_id += len(chunk.items)
            connection.commit()
        if vectors.ntotal == 0:
            raise RetrievalError(f"{directory}: nothing to index (no readable images)")
        if base is None:
            exact = open_raw(staging, next_id - 1, dim) if described["rerank"] else None
            described.update(tune_depth(vectors, kind, probe, exact, described["rerank"]))
        manifest = {
            "format_version": FORMAT_VERSION,
            **described,
            "metric": "inner_product",
            "dim": dim,
            "count": int(vectors.ntotal),
            "next_id": next_id,
            "encoder_sha256": encoder_sha256,
            "created": created,
            "updated": now,
        }
        faiss.write_index(vectors, str(staging / VECTORS))
        stored = (VECTORS, ITEMS, *([RAW] if described.get("rerank") else []))
        for name in stored:
            with open(staging / name, "rb") as handle:
                os.fsync(handle.fileno())
        manifest["sha256"] = {name: file_sha256(staging / name) for name in stored}
        write_json(staging / MANIFEST, manifest, sealed=True)  # fsyncs it and the staging folder
        _swap_into_place(staging, directory)
    except BaseException as error:
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(error, OSError):  # disk full, quota, read-only file system
            raise RetrievalError(f"{directory}: the index cannot be written ({error.strerror or error}); the previous version is kept") from None
        raise
    return GalleryIndex(directory, manifest, vectors)


def index_kind(factory: str) -> str:
    """hnsw, ivf or flat: which search depth (efSearch, nprobe or none) the type has."""
    return "hnsw" if "HNSW" in factory else "ivf" if "IVF" in factory else "flat"


def _sample(additions: Iterable[Additions], dim: int, size: int | None = None, seed: int = 0) -> tuple[int, np.ndarray]:
    """Counts the rows of additions and draws a seeded uniform sample of them.

    Every row gets a random key and the rows with the smallest keys form the sample; rows are kept
    until twice the sample size, then cut back, so the work stays linear in the number of rows.
    """
    rng = np.random.default_rng(seed)
    limit = size or SAMPLE_LIMIT
    count, held = 0, 0
    rows: list[np.ndarray] = [np.zeros((0, dim), np.float32)]
    keys: list[np.ndarray] = [np.zeros(0)]

    def cut() -> tuple[list[np.ndarray], list[np.ndarray]]:
        all_rows, all_keys = np.concatenate(rows), np.concatenate(keys)
        best = np.argsort(all_keys)[:limit]
        return [all_rows[best]], [all_keys[best]]

    for chunk in additions:
        rows.append(np.ascontiguousarray(chunk.vectors, dtype=np.float32))
        keys.append(rng.random(len(chunk.vectors)))
        count, held = count + len(chunk.vectors), held + len(chunk.vectors)
        if held > 2 * limit:
            rows, keys = cut()
            held = limit
    return count, cut()[0][0]


def new_index(factory: str, dim: int, sample: np.ndarray) -> faiss.Index:
    """An empty FAISS index of the factory type, trained on sample when the type needs training.

    IVF types keep the ids they are given (with a hash table from id to vector, so items can be
    found by id); the others are wrapped in IDMap2.
    """
    try:
        index = faiss.index_factory(dim, factory, faiss.METRIC_INNER_PRODUCT)
    except RuntimeError as error:
        raise RetrievalError(f"--faiss {factory!r}: FAISS cannot build it ({str(error).splitlines()[0][:200]}); see the FAISS index factory documentation") from None
    ivf = faiss.extract_index_ivf(index) if index_kind(factory) == "ivf" else None
    if ivf is not None:
        ivf.set_direct_map_type(faiss.DirectMap.Hashtable)
        needed, wanted = ivf.nlist, max(TRAIN_PER_LIST * ivf.nlist, PQ_TRAIN if "PQ" in factory else 0)
    else:
        index = faiss.IndexIDMap2(index)
        needed, wanted = 256, PQ_TRAIN
    if not index.is_trained:
        if len(sample) < needed:
            raise RetrievalError(f"--faiss {factory!r} needs at least {needed:,} vectors to train on, the gallery has {len(sample):,}; use a smaller type (e.g. Flat)")
        if ivf is not None and gpu_count():  # k-means of the inverted lists on the GPUs; the index stays a CPU one
            ivf.clustering_index = on_gpus(faiss.IndexFlatIP(dim), "flat")
        index.train(sample[:wanted])
    return index


def _remove(vectors: faiss.Index, ids: np.ndarray, kind: str) -> faiss.Index:
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
            return faiss.vector_to_array(vectors.id_map).astype(np.int64), numpy_call(inner, "reconstruct_n", 0, inner.ntotal)
    elif isinstance(vectors, faiss.IndexIVFFlat):  # the codes of each inverted list are its float vectors
        lists = vectors.invlists
        ids, rows = [np.zeros(0, np.int64)], [np.zeros((0, vectors.d), np.float32)]
        for number in range(vectors.nlist):
            size = lists.list_size(number)
            if size:
                ids.append(faiss.rev_swig_ptr(lists.get_ids(number), size).copy())
                rows.append(faiss.rev_swig_ptr(lists.get_codes(number), size * lists.code_size).view(np.float32).reshape(size, vectors.d).copy())
        return np.concatenate(ids), np.concatenate(rows)
    raise RetrievalError("this index stores compressed codes, not the vectors themselves")


class RecallProbe:
    """Exact top-10 of a few sample queries over everything added, kept up to date chunk by chunk."""

    def __init__(self, queries: np.ndarray, k: int = 10) -> None:
        self.queries, self.k = np.ascontiguousarray(queries, np.float32), k
        self.scores = np.full((len(queries), 0), -np.inf, np.float32)
        self.ids = np.zeros((len(queries), 0), np.int64)

    def see(self, rows: np.ndarray, ids: np.ndarray) -> None:
        scores, found = faiss.knn(self.queries, rows, min(self.k, len(rows)), metric=faiss.METRIC_INNER_PRODUCT)
        scores, candidates = np.concatenate([self.scores, scores], axis=1), np.concatenate([self.ids, ids[found]], axis=1)
        best = np.argsort(-scores, axis=1, kind="stable")[:, : self.k]
        self.scores, self.ids = np.take_along_axis(scores, best, axis=1), np.take_along_axis(candidates, best, axis=1)

    def recall(self, vectors: faiss.Index, params: object | None, raw: np.ndarray | None = None, rerank: int = 0) -> float:
        """Mean share of the exact top-10 that the index returns in its top-10 (re-ranked as search_ids does)."""
        return recall_at_10(search_ids(vectors, self.queries, self.k, params, raw, rerank)[1], self.ids)


def recall_at_10(found: Sequence[Sequence[int]] | np.ndarray, exact: np.ndarray) -> float:
    """Mean share of each row of exact ids (the true top-k) that the same row of found holds."""
    return float(np.mean([len(set(map(int, a)) & set(map(int, b))) / len(b) for a, b in zip(found, exact)]))


def tune_depth(vectors: faiss.Index, kind: str, probe: RecallProbe | None, raw: np.ndarray | None = None, rerank: int = 0) -> dict:
    """The smallest search depth reaching TARGET_RECALL on the probe, and its recall@10.

    Depths double from 1 (nprobe) or 16 (efSearch); when doubling stops paying (recall up by less than
    PLATEAU), as when compressed codes rather than the search cap the recall, the last depth that
    still helped is kept.
    """
    if probe is None:
        return {"search": {}, "recall@10": 1.0}
    if kind == "flat":
        return {"search": {}, "recall@10": probe.recall(vectors, None, raw, rerank)}
    name, depths = ("nprobe", [2**i for i in range(int(np.log2(faiss.extract_index_ivf(vectors).nlist)) + 1)]) if kind == "ivf" else ("efSearch", [16, 32, 64, 128, 256, 512, 1024])
    chosen, recall = depths[0], probe.recall(vectors, search_parameters(kind, depths[0]), raw, rerank)
    for depth in depths[1:]:
        if recall >= TARGET_RECALL:
            break
        deeper = probe.recall(vectors, search_parameters(kind, depth), raw, rerank)
        if deeper < recall + PLATEAU:
            break
        chosen, recall = depth, deeper
    return {"search": {name: chosen}, "recall@10": recall}


def compressed(factory: str) -> bool:
    """Whether the type stores lossy codes (SQ, PQ) rather than the vectors."""
    return "PQ" in factory or "SQ" in factory


def open_raw(directory: Path, rows: int, dim: int) -> np.ndarray:
    """The exact vectors file of a compressed index, memory-mapped read-only, checked for its size."""
    path = directory / RAW
    expected = rows * dim * 4
    if not path.is_file() or path.stat().st_size != expected:
        found = f"{path.stat().st_size:,} bytes" if path.is_file() else "missing"
        raise RetrievalError(f"{path}: {found}, expected {expected:,} bytes ({rows:,} vectors of {dim} floats); rebuild the index")
    return np.memmap(path, np.float32, "r", shape=(rows, dim)) if rows else np.zeros((0, dim), np.float32)


def search_ids(index: faiss.Index, queries: np.ndarray, k: int, params: object | None, raw: np.ndarray | None, rerank: int, block: int = 1024) -> tuple[np.ndarray, np.ndarray]:
    """(scores, ids) of the k best items for each query; with exact vectors (raw, row id - 1) and
    rerank > 1, the rerank × k best by the index's codes are re-scored exactly and the k best kept."""
    if raw is None or rerank <= 1:
        return faiss_search(index, queries, k, params)
    scores = np.full((len(queries), k), -np.inf, np.float32)
    ids = np.full((len(queries), k), -1, np.int64)
    for start in range(0, len(queries), block):
        rows = slice(start, start + block)
        candidates = faiss_search(index, queries[rows], k * rerank, params)[1]
        exact = np.einsum("qcd,qd->qc", np.asarray(raw[np.maximum(candidates, 1) - 1], np.float32), queries[rows])
        exact[candidates < 0] = -np.inf
        best = np.argsort(-exact, axis=1, kind="stable")[:, :k]
        scores[rows] = np.take_along_axis(exact, best, axis=1)
        ids[rows] = np.where(scores[rows] > -np.inf, np.take_along_axis(candidates, best, axis=1), -1)
    return scores, ids


def numpy_call(index: faiss.Index, method: str, *args: object, **options: object) -> object:
    """Calls FAISS's numpy method, also when faiss.contrib.torch_utils (imported by
    pytorch-metric-learning, for one) has replaced it by one that returns torch tensors or takes no
    search parameters; the numpy originals are then kept as <method>_numpy."""
    return getattr(index, f"{method}_numpy", getattr(index, method))(*args, **options)


def faiss_search(index: faiss.Index, queries: np.ndarray, k: int, params: object | None = None) -> tuple[np.ndarray, np.ndarray]:
    """index.search with per-call search parameters (see numpy_call)."""
    return numpy_call(index, "search", queries, k, params=params)  # type: ignore[return-value]


def gpu_count() -> int:
    """GPUs FAISS can use here (0 with faiss-cpu, or with faiss-gpu on a machine without one)."""
    return int(faiss.get_num_gpus()) if hasattr(faiss, "get_num_gpus") and hasattr(faiss, "GpuMultipleClonerOptions") else 0


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
        warnings.warn(f"searching on the CPU: FAISS cannot move this index to the GPU ({str(error).splitlines()[0][:200]})", stacklevel=2)
        return vectors


def search_parameters(kind: str, depth: int | None, selector: object | None = None) -> object | None:
    """FAISS per-call search parameters: nprobe for IVF, efSearch for HNSW, and an ID selector (None: the index's own)."""
    options = {} if selector is None else {"sel": selector}
    if kind != "flat" and depth is not None:
        options["nprobe" if kind == "ivf" else "efSearch"] = int(depth)
    if not options:
        return None
    return {"ivf": faiss.SearchParametersIVF, "hnsw": faiss.SearchParametersHNSW}.get(kind, faiss.SearchParameters)(**options)


def _read_only(path: Path) -> closing[sqlite3.Connection]:
    return closing(sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, check_same_thread=False))


def _create_items(path: Path) -> None:
    with closing(sqlite3.connect(path)) as connection:
        connection.execute("CREATE TABLE items (id INTEGER PRIMARY KEY, path TEXT NOT NULL, label TEXT NOT NULL, sha256 TEXT NOT NULL, added_at TEXT NOT NULL)")
        connection.commit()


@contextmanager
def writer_lock(directory: Path, timeout: float = 600.0) -> Iterator[None]:
    """Holds the writer lock of the index at directory (one writer at a time, across processes), waiting up to timeout seconds."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    path = directory.with_name(f".{directory.name}.lock")
    deadline = time.monotonic() + timeout
    with open(path, "a") as handle:
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise RetrievalError(
                        f"{directory}: another writer (a `retrieval index` job, or an app started with --allow-write) has held {path.name} "
                        f"for over {timeout:.0f} s; try again when it has finished"
                    ) from None
                time.sleep(0.05)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _swap_into_place(staging: Path, directory: Path) -> None:
    """Renames staging to directory, moving any previous index aside first and removing it after."""
    previous = directory.with_name(f".{directory.name}.old-{time.time_ns()}")
    if directory.exists():
        directory.rename(previous)
    staging.rename(directory)
    fsync_dir(directory.parent)
    shutil.rmtree(previous, ignore_errors=True)
