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
from collections.abc import Sequence
from contextlib import closing
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import faiss
import numpy as np

from retrieval.data import Item
from retrieval.errors import RetrievalError
from retrieval.runs import fsync_dir, read_json

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

    @classmethod
    def build(cls, directory: Path, vectors: np.ndarray, items: Sequence[Item], hashes: Sequence[str], encoder_sha256: str) -> "GalleryIndex":
        """Builds an exact index of vectors (ids 1..N in item order) and saves it atomically to directory."""
        vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        if len(vectors) != len(items) or len(items) != len(hashes):
            raise RetrievalError(f"{len(vectors)} vectors for {len(items)} items and {len(hashes)} hashes")
        if len(items) == 0:
            raise RetrievalError(f"{directory}: nothing to index (no readable images)")
        dim = vectors.shape[1]
        index = faiss.IndexIDMap2(faiss.IndexFlatIP(dim))
        ids = np.arange(1, len(items) + 1, dtype=np.int64)
        index.add_with_ids(vectors, ids)
        now = datetime.now(timezone.utc).isoformat(timespec="seconds")
        manifest = {
            "format_version": FORMAT_VERSION,
            "index_type": "IDMap2,Flat",
            "metric": "inner_product",
            "dim": dim,
            "count": len(items),
            "encoder_sha256": encoder_sha256,
            "created": now,
            "updated": now,
        }
        directory = Path(directory)
        staging = directory.with_name(f".{directory.name}.tmp-{time.time_ns()}")
        staging.mkdir(parents=True)
        try:
            faiss.write_index(index, str(staging / VECTORS))
            _write_items(staging / ITEMS, ids, items, hashes, now)
            (staging / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
            for name in (VECTORS, ITEMS, MANIFEST):
                with open(staging / name, "rb") as handle:
                    os.fsync(handle.fileno())
            fsync_dir(staging)
            _swap_into_place(staging, directory)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return cls(directory, manifest, index)

    @classmethod
    def load(cls, directory: Path, encoder_sha256: str | None = None, dim: int | None = None) -> "GalleryIndex":
        """Opens a saved index, refusing one that is incomplete or was built by another encoder."""
        directory = Path(directory)
        if not (directory / MANIFEST).is_file():
            raise RetrievalError(f"{directory}: not an index (no {MANIFEST}); build one with `retrieval index RUN IMAGES`")
        manifest = read_json(directory / MANIFEST)
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


def _read_only(path: Path) -> closing[sqlite3.Connection]:
    return closing(sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, check_same_thread=False))


def _write_items(path: Path, ids: np.ndarray, items: Sequence[Item], hashes: Sequence[str], added_at: str) -> None:
    connection = sqlite3.connect(path)
    try:
        connection.execute("CREATE TABLE items (id INTEGER PRIMARY KEY, path TEXT NOT NULL, label TEXT NOT NULL, sha256 TEXT NOT NULL, added_at TEXT NOT NULL)")
        connection.executemany(
            "INSERT INTO items VALUES (?, ?, ?, ?, ?)",
            [(int(i), str(item.path), item.label, digest, added_at) for i, item, digest in zip(ids, items, hashes)],
        )
        connection.commit()
    finally:
        connection.close()


def _swap_into_place(staging: Path, directory: Path) -> None:
    """Renames staging to directory, moving any previous index aside first and removing it after."""
    previous = directory.with_name(f".{directory.name}.old-{time.time_ns()}")
    if directory.exists():
        directory.rename(previous)
    staging.rename(directory)
    fsync_dir(directory.parent)
    shutil.rmtree(previous, ignore_errors=True)
