"""The FAISS backend of the gallery index: FAISS vectors + SQLite metadata + a manifest, written atomically.

Layout (ARCHITECTURE.md): `manifest.json`, `vectors.faiss` (ids are the SQLite row ids) and
`items.sqlite` (id, path, label, sha256, added_at). Each save is a new directory swapped into place
(index.disk), and an open GalleryIndex keeps reading the version it loaded (reload to see a newer one).

The FAISS type is chosen by index.choice (or forced with a factory string) when an index is
created, and kept by later updates; its search depth is tuned then (index.tuning). Removal: Flat
and IVF types remove natively; HNSW cannot, so removing from it rebuilds the graph from the vectors
it stores (index.faiss_ops).
"""

from __future__ import annotations

import errno
import os
import shutil
import sqlite3
import sys
from collections.abc import Iterable, Sequence
from contextlib import closing
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from index.choice import IndexChoice, approximate, choose_index, held_out
from index.disk import create_items, open_raw, read_only, staging_directory, swap_into_place
from index.faiss_ops import (
    compressed,
    faiss,
    first_line,
    new_index,
    numpy_call,
    on_gpus,
    on_huge_pages,
    remove_ids,
    search_ids,
    search_parameters,
    stored_vectors,
)
from index.tuning import RecallProbe, intrinsic_dimension, sample_rows, tune_depth
from index.types import (
    ITEMS,
    MANIFEST,
    RAW,
    VECTORS,
    Additions,
    Hit,
    HitArrays,
    IndexFacts,
    Manifest,
    ManifestFacts,
    Row,
    rebuild_advice,
    search_queries,
    storable,
    unknown_ids,
)
from retrieval.data import Item
from retrieval.errors import RetrievalError
from retrieval.knn import nearest_neighbours
from retrieval.runs import file_sha256, write_json, write_refused

RERANK = 8  # compressed types re-score this many candidates per result exactly
ID_CHUNK = 500  # ids per SQLite query (below its limit on bound parameters)
EXACT_LABEL = 1024  # a label of at most this many items is searched exactly, over its stored vectors
HUGE_PAGES_AFTER = 10_000  # queries answered before the index moves to huge pages (see GalleryIndex._settle)
COLUMN_LIMIT = 4_000_000  # up to this many items, searches look items up in memory (about 300 bytes an item)


@dataclass(frozen=True)
class ItemColumns:
    """The items of an index version as arrays indexed by id ("" at 0 and at removed ids), for batch look-ups."""

    paths: np.ndarray  # object (str)
    labels: np.ndarray  # object (str, one object per distinct label)
    sha256: np.ndarray  # object (str): decoding bytes per batch would cost a third of a graph search's time

    @classmethod
    def read(cls, items: Path, size: int) -> ItemColumns:
        """Reads every item of the SQLite file items, whose ids are below size."""
        paths, labels, digests = (np.full(size, "", object) for _ in range(3))
        with read_only(items) as connection:
            rows = connection.execute("SELECT id, path, label, sha256 FROM items").fetchall()
        if rows:
            ids, path, label, digest = zip(*rows)
            at = np.asarray(ids, np.int64)
            paths[at], labels[at] = path, [sys.intern(name) for name in label]
            digests[at] = digest
        return cls(paths, labels, digests)


class GalleryIndex(ManifestFacts):
    """Inner-product search over L2-normalised embeddings, with the items they came from (a GalleryBackend)."""

    def __init__(self, directory: Path, manifest: Manifest, vectors: faiss.Index) -> None:
        self.directory = directory
        self.manifest = manifest
        self.vectors = vectors  # the CPU index, as saved
        self._searcher: faiss.Index | None = None
        self._raw: np.ndarray | None = None
        self._columns: ItemColumns | None = None
        self._answered = 0  # queries searched, for _settle
        self._settled = False

    @property
    def raw(self) -> np.ndarray | None:
        """The exact vectors of a compressed index (row id - 1), memory-mapped; None for other types."""
        if self._raw is None and self.manifest.rerank:
            self._raw = open_raw(self.directory, self.manifest.next_id - 1, self.dim)
        return self._raw

    @property
    def searcher(self) -> faiss.Index:
        """The index searches run on: a copy sharded over every GPU FAISS sees, else the CPU index."""
        if self._searcher is None:
            self._searcher = on_gpus(self.vectors, self.kind)
        return self._searcher

    def _settle(self, queries: int) -> None:
        """Counts the queries answered; once HUGE_PAGES_AFTER have been, moves the CPU index's arrays to huge pages
        (faiss_ops.on_huge_pages: 1-2.5 s for a million vectors, then searches 7-11% faster), so that a server or a
        long evaluation pays the move and a one-off search does not."""
        if self._answered >= HUGE_PAGES_AFTER and not self._settled and self.searcher is self.vectors:
            self._settled = True
            on_huge_pages(self.vectors)
        self._answered += queries

    def __len__(self) -> int:
        return int(self.vectors.ntotal)

    @classmethod
    def build(
        cls, directory: Path, vectors: np.ndarray, items: Sequence[Item], hashes: Sequence[str], encoder_sha256: str
    ) -> GalleryIndex:
        """Builds an exact index of vectors (ids 1..N in item order) and saves it atomically to directory."""
        vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        if len(vectors) != len(items) or len(items) != len(hashes):
            raise RetrievalError(f"{len(vectors)} vectors for {len(items)} items and {len(hashes)} hashes")
        additions = [Additions(vectors, list(items), list(hashes))]
        return cls.create(Path(directory), additions, encoder_sha256, vectors.shape[1])

    @classmethod
    def create(
        cls,
        directory: Path,
        additions: Iterable[Additions],
        encoder_sha256: str,
        dim: int,
        factory: str | None = None,
        memory: int | None = None,
    ) -> GalleryIndex:
        """Builds a new index from re-iterable chunks of items, saved atomically to directory (replacing any).

        The type is index.choice's pick for the count and the memory budget in bytes, or the FAISS factory string given.
        """
        return commit(Path(directory), None, additions, [], encoder_sha256, dim, factory, memory)

    def update(self, additions: Iterable[Additions], remove_ids: Sequence[int]) -> GalleryIndex:
        """Saves a new version of this index with items added and removed; this object stays as it was."""
        return commit(self.directory, self, additions, remove_ids, self.encoder_sha256, self.dim)

    @classmethod
    def open(cls, directory: Path, manifest: Manifest, mmap: bool = False) -> GalleryIndex:
        """Opens the FAISS index whose manifest has been read and checked (index.backends.open_index does both).

        With mmap, the vectors stay on disk and pages are read as searches touch them (IVF lists
        and flat storage), for galleries larger than memory.
        """
        if manifest.backend != "faiss":
            raise RetrievalError(f"{directory}: a {manifest.backend} index; open it with index.open_index")
        _check_files(directory, manifest, mmap)
        try:
            vectors = faiss.read_index(str(directory / VECTORS), faiss.IO_FLAG_MMAP if mmap else 0)
        except RuntimeError as error:
            raise RetrievalError(
                f"{directory / VECTORS}: FAISS cannot read it ({first_line(error)}); {rebuild_advice(directory)}"
            ) from None
        if vectors.ntotal != manifest.count or vectors.d != manifest.dim:
            raise RetrievalError(
                f"{directory}: {VECTORS} holds {vectors.ntotal}x{vectors.d} vectors, the manifest says "
                f"{manifest.count}x{manifest.dim}; {rebuild_advice(directory)}"
            )
        try:
            with read_only(directory / ITEMS) as connection:
                (rows,) = connection.execute("SELECT COUNT(*) FROM items").fetchone()
        except sqlite3.DatabaseError as error:
            raise RetrievalError(
                f"{directory / ITEMS}: SQLite cannot read it ({error}); {rebuild_advice(directory)}"
            ) from None
        if rows != vectors.ntotal:
            raise RetrievalError(
                f"{directory}: {ITEMS} has {rows} items for {vectors.ntotal} vectors; {rebuild_advice(directory)}"
            )
        index = cls(directory, manifest, vectors)
        _ = index.raw  # checks the exact vectors of a compressed index now, not at the first search
        return index

    def search(
        self,
        queries: np.ndarray,
        k: int = 10,
        depth: int | None = None,
        rerank: int | None = None,
        label: str | None = None,
    ) -> list[list[Hit]]:
        """Returns the k best hits for each query row, best first (ties: the lower id first).

        depth is nprobe for IVF indexes and efSearch for HNSW (default: the value tuned at build time);
        exact indexes have none. Compressed indexes (SQ, PQ) fetch rerank × k candidates and re-score
        them with the exact vectors (default RERANK; 0 or 1: the compressed scores as they are).
        label: only items with this label (a FAISS ID selector, searched on the CPU index).
        """
        return self.search_arrays(queries, k, depth, rerank, label).hits()

    def search_arrays(
        self,
        queries: np.ndarray,
        k: int = 10,
        depth: int | None = None,
        rerank: int | None = None,
        label: str | None = None,
    ) -> HitArrays:
        """search's hits as arrays ([queries, k] ids, scores, paths, labels, sha256), for batches: the items are
        looked up once for the whole batch, in memory (ItemColumns) up to COLUMN_LIMIT items, and no Hit is made."""
        queries = search_queries(queries, k, self.dim)
        self._check_search(depth)
        k = max(1, min(k, len(self)))
        factor = self.manifest.rerank if rerank is None else rerank
        allowed = None if label is None else self._ids_with_label(label)
        if allowed is not None and not len(allowed):
            return self._arrays(np.full((len(queries), 0), -1, np.int64), np.zeros((len(queries), 0), np.float32))
        if allowed is not None and self.kind != "flat" and len(allowed) <= EXACT_LABEL:
            exact = self._label_exact(queries, allowed, k)
            if exact is not None:
                return self._arrays(*exact)
        self._settle(len(queries))
        searcher = self.searcher if allowed is None else self.vectors  # FAISS's GPU indexes take no selector
        selector = None if allowed is None else faiss.IDSelectorBatch(len(allowed), faiss.swig_ptr(allowed))
        reachable = len(self) if allowed is None else len(allowed)
        params = search_parameters(self.kind, self._filtered_depth(depth or self.manifest.depth, reachable), selector)
        scores, ids = search_ids(searcher, queries, min(k, reachable), params, self.raw, factor, reachable)
        return self._arrays(ids, scores)

    def _label_exact(self, queries: np.ndarray, allowed: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray] | None:
        """(ids, scores) of the k best of a small label's items, compared exactly with their stored vectors (None
        where the index cannot give them back): cheaper than a graph or lists deepened to meet a rare label."""
        try:
            vectors = self.vectors_of(allowed.tolist())
        except RetrievalError:
            return None
        positions, scores = nearest_neighbours(queries, vectors, k)  # ties: the lower position, so the lower id
        return allowed[positions], scores

    def _filtered_depth(self, depth: int | None, reachable: int) -> int | None:
        """The depth for a search among `reachable` of the items (one label's): the tuned one, deepened by the share
        the label leaves out, as a graph or the inverted lists meet the label's items that much more rarely (a label
        of 12 of 1,004 items got 1 hit of k=5 through HNSW8 at efSearch 27)."""
        if depth is None or reachable >= len(self) or self.kind not in ("hnsw", "ivf"):
            return depth
        return min(self._deepest(), -(-depth * len(self) // max(reachable, 1)))

    def _deepest(self) -> int:
        """The deepest search: every inverted list of an IVF index, every item of a graph."""
        return faiss.extract_index_ivf(self.vectors).nlist if self.kind == "ivf" else len(self)

    def _arrays(self, ids: np.ndarray, scores: np.ndarray) -> HitArrays:
        """The hits of ids (-1: none) with their items' paths, labels and sha256."""
        columns = self.columns
        if columns is not None:
            at = np.maximum(ids, 0)  # slot 0 (no id) holds ""
            return HitArrays(ids, scores, columns.paths[at], columns.labels[at], columns.sha256[at])
        found = self.rows(ids[ids >= 0].tolist())
        empty = Row("", "", "")
        rows = [[found.get(i, empty) for i in row] for row in ids.tolist()]
        paths, labels, digests = (
            np.array([[r[n] for r in row] for row in rows], object).reshape(ids.shape) for n in range(3)
        )
        return HitArrays(ids, scores, paths, labels, digests)

    @property
    def columns(self) -> ItemColumns | None:
        """The items' paths, labels and sha256 by id, read once from SQLite (None above COLUMN_LIMIT items)."""
        if self._columns is None and len(self) <= COLUMN_LIMIT:
            self._columns = ItemColumns.read(self.directory / ITEMS, self.manifest.next_id)
        return self._columns

    def _check_search(self, depth: int | None) -> None:
        if depth is not None and self.kind == "flat":
            raise RetrievalError(
                f"a search depth (nprobe/efSearch) does not apply to this {self.manifest.index_type} index: "
                "it searches exactly"
            )
        if depth is not None and depth < 1:
            raise RetrievalError(f"the search depth must be at least 1, got {depth}")
        deepest = len(self) if depth is None else self._deepest()
        if depth is not None and depth > deepest:
            what = f"{deepest:,} inverted lists" if self.kind == "ivf" else f"{deepest:,} items"
            raise RetrievalError(
                f"--depth {depth}: this {self.manifest.index_type} index has {what}; give at most {deepest:,} "
                f"(tuned: {self.manifest.describe_search()})"
            )

    def _ids_with_label(self, label: str) -> np.ndarray:
        with read_only(self.directory / ITEMS) as connection:
            found = connection.execute("SELECT id FROM items WHERE label = ? ORDER BY id", (label,))
            return np.array([row[0] for row in found], dtype=np.int64)

    def vectors_of(self, ids: Sequence[int]) -> np.ndarray:
        """The stored vectors of indexed items, to search with items already in the gallery."""
        known = self.rows(list(ids))
        if len(known) != len(set(ids)):
            raise unknown_ids(self.directory, [i for i in ids if i not in known])
        if self.raw is not None:
            return np.asarray(self.raw[np.asarray(ids, np.int64) - 1], np.float32)
        if not len(ids):
            return np.zeros((0, self.dim), np.float32)
        try:
            return np.stack([numpy_call(self.vectors, "reconstruct", int(i)) for i in ids])  # type: ignore[misc]
        except RuntimeError as error:
            raise RetrievalError(
                f"{self.directory}: a {self.manifest.index_type} index cannot give its vectors back "
                f"({first_line(error, 120)})"
            ) from None

    def stored(self) -> tuple[np.ndarray, np.ndarray] | None:
        """(ids, vectors) of every item: the vectors this index stores, or for compressed types the exact ones kept
        for re-ranking; None for compressed codes forced without them (they only approximate the vectors)."""
        if self.raw is not None:
            ids = np.array(sorted(self.rows()), np.int64)
            return ids, np.asarray(self.raw[ids - 1], np.float32)
        try:
            return stored_vectors(self.vectors)
        except RetrievalError:
            return None

    def facts(self) -> IndexFacts:
        """The manifest's facts and the sizes on disk, as `retrieval index-stats` shows them."""
        manifest, vectors = self.manifest, (self.directory / VECTORS).stat().st_size
        return IndexFacts.of(
            manifest,
            len(self),
            vectors_mib=vectors / 2**20,
            items_mib=(self.directory / ITEMS).stat().st_size / 2**20,
            bytes_per_vector=vectors / max(len(self), 1),
            # exact search has no depth to tune
            recall_at_build=manifest.recall_at_10 if self.kind != "flat" else None,
            rerank=manifest.rerank if self.raw is not None else None,
        )

    def items(self) -> dict[int, Item]:
        """Returns every indexed item by id."""
        return {i: Item(Path(row.path), row.label) for i, row in self.rows().items()}

    def rows(self, ids: Sequence[int] | None = None) -> dict[int, Row]:
        """Returns Row(path, label, sha256) of the items with these ids (all items when ids is None)."""
        query = "SELECT id, path, label, sha256 FROM items"
        with read_only(self.directory / ITEMS) as connection:
            if ids is None:
                rows = connection.execute(f"{query} ORDER BY id").fetchall()
            else:
                unique = storable(ids)
                rows = []
                for start in range(0, len(unique), ID_CHUNK):
                    chunk = unique[start : start + ID_CHUNK]
                    rows += connection.execute(f"{query} WHERE id IN ({','.join('?' * len(chunk))})", chunk).fetchall()
        return {int(i): Row(path, label, digest) for i, path, label, digest in rows}


def _check_files(directory: Path, manifest: Manifest, mmap: bool) -> None:
    """Refuses an index directory whose files are missing or differ from the manifest's sha256."""
    for name in (VECTORS, ITEMS):
        if not (directory / name).is_file():
            raise RetrievalError(f"{directory}: {name} is missing; {rebuild_advice(directory)}")
    for name, digest in manifest.sha256.items():
        if mmap and name == VECTORS:
            continue  # memory-mapped: reading the whole file to hash it would defeat the purpose
        if not (directory / name).is_file() or file_sha256(directory / name) != digest:
            raise RetrievalError(
                f"{directory / name}: missing, or its bytes do not match the manifest's sha256 (damaged or truncated); "
                f"{rebuild_advice(directory)}"
            )


def commit(
    directory: Path,
    base: GalleryIndex | None,
    additions: Iterable[Additions],
    removals: Sequence[int],
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
    staging = staging_directory(directory)
    try:
        draft = (
            _Draft.new(directory, staging, additions, dim, factory, memory, encoder_sha256, now)
            if base is None
            else _Draft.of(base, staging)
        )
        draft.fill(staging, removals, additions, now)
        if draft.vectors.ntotal == 0:
            raise RetrievalError(f"{directory}: nothing to index (no readable images)")
        if base is None:
            draft.tune(staging)
        manifest = _seal(staging, draft, now)
        swap_into_place(staging, directory)
    except BaseException as error:
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(error, (OSError, sqlite3.OperationalError)):  # disk full, quota, read-only file system
            raise write_refused(directory, error, "the index") from None
        raise
    return GalleryIndex(directory, manifest, draft.vectors)


class _Draft:
    """The next version of an index while commit writes it into the staging directory.

    manifest is the base's (or a new one's) until _seal writes the new count, ids, times and hashes.
    """

    def __init__(self, vectors: faiss.Index, manifest: Manifest, probe: RecallProbe | None) -> None:
        self.vectors = vectors
        self.manifest = manifest
        self.next_id = manifest.next_id
        self.probe = probe
        self.held: list[tuple[np.ndarray, np.ndarray]] = []  # the probe's rows and ids, added after tuning

    @classmethod
    def new(
        cls,
        directory: Path,
        staging: Path,
        additions: Iterable[Additions],
        dim: int,
        factory: str | None,
        memory: int | None,
        encoder_sha256: str,
        now: str,
    ) -> _Draft:
        """An empty index of the chosen type, trained on a sample of additions."""
        drawn = sample_rows(additions, dim)
        count, sample = drawn.count, drawn.rows
        if count == 0:
            raise RetrievalError(f"{directory}: nothing to index (no readable images)")
        intrinsic = intrinsic_dimension(sample) if approximate(count) and not factory else None
        choice = IndexChoice(factory, "given with --faiss") if factory else choose_index(count, dim, memory, intrinsic)
        queries = held_out(count)
        probe = None if choice.factory == "Flat" or not queries else RecallProbe(sample[:queries])
        create_items(staging / ITEMS)
        manifest = Manifest(
            dim=dim,
            count=0,
            next_id=1,
            encoder_sha256=encoder_sha256,
            created=now,
            updated=now,
            index_type=choice.factory,
            choice=choice.reason,
            rerank=RERANK if compressed(choice.factory) else 0,
        )
        training = sample[len(probe.queries) :] if probe else sample  # the probe's vectors stay unseen
        return cls(new_index(choice.factory, dim, training, count), manifest, probe)

    @classmethod
    def of(cls, base: GalleryIndex, staging: Path) -> _Draft:
        """A copy of base's index, items and exact vectors, to change."""
        shutil.copyfile(base.directory / ITEMS, staging / ITEMS)
        if base.manifest.rerank:
            shutil.copyfile(base.directory / RAW, staging / RAW)
        return cls(faiss.clone_index(base.vectors), base.manifest, None)

    def fill(self, staging: Path, removals: Sequence[int], additions: Iterable[Additions], now: str) -> None:
        """Removes items, then adds the additions with the next ids, to the vectors, the items and the exact vectors."""
        raw_path = staging / RAW if self.manifest.rerank else os.devnull
        with closing(sqlite3.connect(staging / ITEMS)) as connection, open(raw_path, "ab") as raw:
            if removals:
                self.vectors = remove_ids(self.vectors, np.asarray(removals, dtype=np.int64), self.manifest.kind)
                connection.executemany("DELETE FROM items WHERE id = ?", [(int(i),) for i in removals])
            for chunk in additions:
                ids = np.arange(self.next_id, self.next_id + len(chunk.items), dtype=np.int64)
                rows = np.ascontiguousarray(chunk.vectors, dtype=np.float32)
                raw.write(rows.tobytes())  # row id - 1: ids are given in order
                if self.probe is not None:
                    held = self.probe.held(rows)
                    self.held.append((rows[held], ids[held]))
                    rows, ids = rows[~held], ids[~held]
                    self.probe.see(rows, ids)
                self.vectors.add_with_ids(rows, ids)
                records = [
                    (self.next_id + i, str(item.path), item.label, digest, now)
                    for i, (item, digest) in enumerate(zip(chunk.items, chunk.hashes))
                ]
                connection.executemany("INSERT INTO items VALUES (?, ?, ?, ?, ?)", records)
                self.next_id += len(chunk.items)
            connection.commit()

    def tune(self, staging: Path) -> None:
        """Tunes the search depth of a new index on its probe, then adds the probe's held-out rows."""
        manifest = self.manifest
        exact = open_raw(staging, self.next_id - 1, manifest.dim) if manifest.rerank else None
        tuned = tune_depth(self.vectors, manifest.kind, self.probe, exact, manifest.rerank)
        self.manifest = replace(manifest, search=tuned.search, recall_at_10=tuned.recall_at_10)
        for rows, ids in self.held:
            self.vectors.add_with_ids(rows, ids)
        self.held = []


def _write_vectors(vectors: faiss.Index, staging: Path) -> None:
    """Writes the FAISS index into the staging folder; a write FAISS could not finish (a full disk) is the OSError it
    is (commit words it), not FAISS's C++ assertion."""
    try:
        faiss.write_index(vectors, str(staging / VECTORS))
    except RuntimeError as error:
        full = "No space left" in str(error) or "Disk quota" in str(error)
        raise (OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)) if full else OSError(errno.EIO, str(error))) from None


def _seal(staging: Path, draft: _Draft, now: str) -> Manifest:
    """Writes the vectors, fsyncs every file and writes the manifest with their sha256, sealed; returns it."""
    _write_vectors(draft.vectors, staging)
    stored = (VECTORS, ITEMS, *([RAW] if draft.manifest.rerank else []))
    for name in stored:
        with open(staging / name, "rb") as handle:
            os.fsync(handle.fileno())
    manifest = replace(
        draft.manifest,
        count=int(draft.vectors.ntotal),
        next_id=draft.next_id,
        updated=now,
        sha256={name: file_sha256(staging / name) for name in stored},
    )
    write_json(staging / MANIFEST, manifest.to_dict(), sealed=True)  # fsyncs it and the staging folder
    return manifest
