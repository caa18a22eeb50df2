"""What every index backend shares: the file names, the result and addition types, and the Protocol.

The FAISS store (index.store) and the Milvus collection (index.milvus) both implement
`GalleryBackend`; index.backends.open_index picks one from the manifest, and the search path
(index.search), indexing (index.build) and editing (index.edit) only use this interface.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from retrieval.data import Item

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
VECTORS = "vectors.faiss"
ITEMS = "items.sqlite"
RAW = "raw.f32"  # compressed types only: the exact float32 vectors, row id - 1, read memory-mapped to re-rank


@dataclass(frozen=True)
class Hit:
    """One search result."""

    id: int
    path: str
    label: str
    score: float
    sha256: str


@dataclass(frozen=True)
class Additions:
    """A chunk of new items with their vectors and file hashes."""

    vectors: np.ndarray
    items: list[Item]
    hashes: list[str]


class GalleryBackend(Protocol):
    """A gallery index: vectors with the items they came from, searched by inner product."""

    directory: Path
    manifest: dict

    @property
    def dim(self) -> int: ...

    @property
    def encoder_sha256(self) -> str: ...

    @property
    def kind(self) -> str:
        """flat, ivf or hnsw: which search depth (none, nprobe or efSearch) the type has."""
        ...

    def __len__(self) -> int: ...

    def search(
        self,
        queries: np.ndarray,
        k: int = 10,
        depth: int | None = None,
        rerank: int | None = None,
        label: str | None = None,
    ) -> list[list[Hit]]:
        """The k best hits of each query row, best first (ties: the lower id first)."""
        ...

    def vectors_of(self, ids: Sequence[int]) -> np.ndarray:
        """The stored vectors of indexed items, in the order of ids."""
        ...

    def rows(self, ids: Sequence[int] | None = None) -> dict[int, tuple[str, str, str]]:
        """id -> (path, label, sha256) of the given ids that exist (every item when None)."""
        ...

    def items(self) -> dict[int, Item]:
        """Every indexed item, by id."""
        ...

    def update(self, additions: Iterable[Additions], remove_ids: Sequence[int]) -> GalleryBackend:
        """Saves a new version with items added and removed, and returns it."""
        ...


def index_kind(factory: str) -> str:
    """hnsw, ivf or flat: which search depth (efSearch, nprobe or none) a FAISS or Milvus type has."""
    upper = factory.upper()
    return "ivf" if "IVF" in upper else "hnsw" if "HNSW" in upper else "flat"  # IVF…_HNSW: a graph quantizer


def tuned_depth(manifest: dict) -> int | None:
    """The search depth saved in a manifest (nprobe or efSearch tuned at build time), if any."""
    value = next(iter(manifest.get("search", {}).values()), None)
    return None if value is None else int(value)
