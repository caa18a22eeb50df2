"""A gallery index on disk: FAISS vectors + SQLite metadata + a manifest, written atomically.

Layout (ARCHITECTURE.md): `manifest.json`, `vectors.faiss` (ids are the SQLite row ids) and
`items.sqlite` (id, path, label, sha256, added_at). A save writes a complete temporary sibling
directory, fsyncs it and renames it into place, so a crash leaves the old index or the new one.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import time
from collections.abc import Iterable, Sequence
from contextlib import closing
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from retrieval.data import Item
from retrieval.errors import RetrievalError
from retrieval.extras import require
from retrieval.runs import fsync_dir, read_json

faiss = require("faiss", "cpu")  # or the gpu extra: faiss-gpu provides the same module

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
VECTORS = "vectors.faiss"
ITEMS = "items.sqlite"


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
        self.vectors = vectors

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
    def create(cls, directory: Path, additions: Iterable[Additions], encoder_sha256: str, dim: int) -> "GalleryIndex":
        """Builds a new exact index from chunks of items and saves it atomically to directory (replacing any there)."""
        return commit(Path(directory), None, additions, [], encoder_sha256, dim)

    def update(self, additions: Iterable[Additions], remove_ids: Sequence[int]) -> "GalleryIndex":
        """Saves a new version of this index with items added and removed; this object stays as it was."""
        return commit(self.directory, self, additions, remove_ids, self.encoder_sha256, self.dim)

    @classmethod
    def load(cls, directory: Path, encoder_sha256: str | None = None, dim: int | None = None) -> "GalleryIndex":
        """Opens a saved index, refusing one that is incomplete or was built by another encoder."""
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
        for name in (VECTORS, ITEMS):
            if not (directory / name).is_file():
                raise RetrievalError(f"{directory}: {name} is missing; rebuild the index with `retrieval index`")
        try:
            vectors = faiss.read_index(str(directory / VECTORS))
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
        return cls(directory, manifest, vectors)

    def search(self, queries: np.ndarray, k: int = 10) -> list[list[Hit]]:
        """Returns the k best hits for each query row, best first."""
        queries = np.ascontiguousarray(np.atleast_2d(queries), dtype=np.float32)
        if queries.shape[1] != self.dim:
            raise RetrievalError(f"queries have dimension {queries.shape[1]}, the index {self.dim}")
        k = max(1, min(k, len(self)))
        scores, ids = self.vectors.search(queries, k)
        found = self.rows(ids[ids >= 0].tolist())
        return [
            [Hit(int(i), found[int(i)][0], found[int(i)][1], float(s), found[int(i)][2]) for i, s in zip(row_ids, row_scores) if i >= 0]
            for row_ids, row_scores in zip(ids, scores)
        ]

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


def commit(directory: Path, base: GalleryIndex | None, additions: Iterable[Additions], remove_ids: Sequence[int], encoder_sha256: str, dim: int) -> GalleryIndex:
    """Writes base (or an empty index) with removals and additions to directory, atomically.

    Everything is written into a temporary sibling directory, fsynced and renamed into place, so a
    crash leaves the previous index whole. New items get ids after the highest ever given (ids of
    removed items are never reused).
    """
    now = datetime.now(timezone.utc).isoformat(timespec="seconds")
    staging = directory.with_name(f".{directory.name}.tmp-{time.time_ns()}")
    staging.mkdir(parents=True)
    try:
        if base is None:
            vectors = faiss.IndexIDMap2(faiss.IndexFlatIP(dim))
            _create_items(staging / ITEMS)
            created, next_id = now, 1
        else:
            vectors = faiss.clone_index(base.vectors)
            shutil.copyfile(base.directory / ITEMS, staging / ITEMS)
            created, next_id = base.manifest["created"], int(base.manifest["next_id"])
        with closing(sqlite3.connect(staging / ITEMS)) as connection:
            if remove_ids:
                vectors.remove_ids(np.asarray(remove_ids, dtype=np.int64))
                connection.executemany("DELETE FROM items WHERE id = ?", [(int(i),) for i in remove_ids])
            for chunk in additions:
                ids = np.arange(next_id, next_id + len(chunk.items), dtype=np.int64)
                vectors.add_with_ids(np.ascontiguousarray(chunk.vectors, dtype=np.float32), ids)
                connection.executemany(
                    "INSERT INTO items VALUES (?, ?, ?, ?, ?)",
                    [(int(i), str(item.path), item.label, digest, now) for i, item, digest in zip(ids, chunk.items, chunk.hashes)],
                )
                next_id += len(chunk.items)
            connection.commit()
        if vectors.ntotal == 0:
            raise RetrievalError(f"{directory}: nothing to index (no readable images)")
        manifest = {
            "format_version": FORMAT_VERSION,
            "index_type": "IDMap2,Flat",
            "metric": "inner_product",
            "dim": dim,
            "count": int(vectors.ntotal),
            "next_id": next_id,
            "encoder_sha256": encoder_sha256,
            "created": created,
            "updated": now,
        }
        faiss.write_index(vectors, str(staging / VECTORS))
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
        for name in (VECTORS, ITEMS, MANIFEST):
            with open(staging / name, "rb") as handle:
                os.fsync(handle.fileno())
        fsync_dir(staging)
        _swap_into_place(staging, directory)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return GalleryIndex(directory, manifest, vectors)


def _read_only(path: Path) -> closing[sqlite3.Connection]:
    return closing(sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, check_same_thread=False))


def _create_items(path: Path) -> None:
    with closing(sqlite3.connect(path)) as connection:
        connection.execute("CREATE TABLE items (id INTEGER PRIMARY KEY, path TEXT NOT NULL, label TEXT NOT NULL, sha256 TEXT NOT NULL, added_at TEXT NOT NULL)")
        connection.commit()


def _swap_into_place(staging: Path, directory: Path) -> None:
    """Renames staging to directory, moving any previous index aside first and removing it after."""
    previous = directory.with_name(f".{directory.name}.old-{time.time_ns()}")
    if directory.exists():
        directory.rename(previous)
    staging.rename(directory)
    fsync_dir(directory.parent)
    shutil.rmtree(previous, ignore_errors=True)
