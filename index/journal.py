"""The on-disk journal of an indexing job: embeddings computed but not yet committed to the index.

Each batch is committed to SQLite as soon as it is embedded, so a job killed at any moment (even
with SIGKILL) and started again resumes where it stopped instead of embedding everything again.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator, Mapping, Sequence
from contextlib import closing
from pathlib import Path

import numpy as np

from index.types import Additions
from retrieval.data import Item

PAGE_SIZE = 65536  # bytes of a page of the journal's SQLite file (SQLite's largest)


class Journal:
    """Pending (path, label, sha256, vector) rows of one encoder, keyed by path."""

    def __init__(self, path: Path, encoder_sha256: str, dim: int) -> None:
        self.path = path
        self.dim = dim
        self.connection = sqlite3.connect(path)
        # pages of 64 KiB hold about 29 rows of a 512-d vector and its path (4 KiB pages: one, the rest left empty):
        # a third of the time to journal a batch (bench/embed.py); a journal that exists keeps its own size
        self.connection.execute(f"PRAGMA page_size={PAGE_SIZE}")
        # WAL keeps every committed batch through a killed process; NORMAL skips an fsync per batch,
        # which only a power cut (not a crash of this process) could cost
        self.connection.execute("PRAGMA journal_mode=WAL")
        self.connection.execute("PRAGMA synchronous=NORMAL")
        self.connection.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
        self.connection.execute(
            "CREATE TABLE IF NOT EXISTS pending (path TEXT PRIMARY KEY, label "
            "TEXT NOT NULL, sha256 TEXT NOT NULL, vector BLOB NOT NULL)"
        )
        owner = self.connection.execute("SELECT value FROM meta WHERE key = 'encoder'").fetchone()
        if owner is None or owner[0] != f"{encoder_sha256}:{dim}":
            # a journal of another encoder cannot be resumed: its vectors live in another space
            self.connection.execute("DELETE FROM pending")
            self.connection.execute("INSERT OR REPLACE INTO meta VALUES ('encoder', ?)", (f"{encoder_sha256}:{dim}",))
        self.connection.commit()

    def hashes(self) -> dict[str, str]:
        """Returns sha256 by path of every pending row."""
        return dict(self.connection.execute("SELECT path, sha256 FROM pending"))

    def add(self, items: Sequence[Item], hashes: Sequence[str], vectors: np.ndarray) -> None:
        """Stores one embedded batch durably (a later row for the same path replaces the earlier one)."""
        rows = [
            (str(item.path), item.label, digest, np.asarray(vector, np.float32).tobytes())
            for item, digest, vector in zip(items, hashes, vectors)
        ]
        self.connection.executemany("INSERT OR REPLACE INTO pending VALUES (?, ?, ?, ?)", rows)
        self.connection.commit()

    def chunks(
        self, size: int = 2048, current: Mapping[str, str] | None = None, paths: Mapping[str, Path] | None = None
    ) -> Iterator[Additions]:
        """Yields the pending rows in insertion order, size at a time (memory stays bounded).

        current (path -> the sha256 a job read): only the rows of the files it lists with the content that was
        embedded. paths: the Path of a path, where the caller holds them (parsing every path again took half the
        time of a new index's commit).
        """
        known = paths or {}
        cursor = self.connection.execute("SELECT path, label, sha256, vector FROM pending ORDER BY rowid")
        while rows := cursor.fetchmany(size):
            if current is not None and not (rows := [row for row in rows if current.get(row[0]) == row[2]]):
                continue
            vectors = np.frombuffer(b"".join(row[3] for row in rows), dtype=np.float32).reshape(len(rows), self.dim)
            items = [Item(known.get(row[0]) or Path(row[0]), row[1]) for row in rows]
            yield Additions(vectors, items, [row[2] for row in rows])

    def discard(self) -> None:
        """Closes and deletes the journal once its rows are committed to the index."""
        self.connection.close()
        for suffix in ("", "-wal", "-shm"):
            self.path.with_name(self.path.name + suffix).unlink(missing_ok=True)


def pending_rows(path: Path) -> int:
    """How many embedded rows the journal at path keeps (0 where there is none): what a stopped job goes on from."""
    if not path.is_file():
        return 0
    try:
        with closing(sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=1.0)) as connection:
            return int(connection.execute("SELECT COUNT(*) FROM pending").fetchone()[0])
    except sqlite3.Error:
        return 0
