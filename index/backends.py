"""Choosing the backend: `open_index` opens any index directory, `create_index` makes a new one.

An index directory's manifest names its backend: FAISS files beside it (index.store, the default)
or a Milvus collection (index.milvus). Nothing else in the project picks a backend by name.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from index.disk import read_manifest
from index.milvus import MilvusIndex, MilvusOptions
from index.store import GalleryIndex
from index.types import MANIFEST, Additions, GalleryBackend, index_folder
from retrieval.extras import require
from retrieval.runs import RunDir


def open_index(
    directory: Path | str | RunDir, encoder_sha256: str | None = None, dim: int | None = None, mmap: bool = False
) -> GalleryBackend:
    """Opens the index at directory (a run given as its RunDir: the run's own, RUN/index) with its own backend,
    refusing one built by another encoder (or dimension).

    mmap (FAISS): leave the vectors on disk, memory-mapped, for galleries larger than memory.
    """
    directory = index_folder(directory)
    manifest = read_manifest(directory, encoder_sha256, dim)
    if manifest.backend == "milvus":
        return MilvusIndex.open(directory, manifest)
    return GalleryIndex.open(directory, manifest, mmap)


def built_with(directory: Path) -> str | None:
    """The sha256 of the encoder whose vectors the index at directory holds (None where there is no index yet)."""
    directory = Path(directory)
    return read_manifest(directory).encoder_sha256 if (directory / MANIFEST).is_file() else None


def create_index(
    directory: Path,
    additions: Iterable[Additions],
    encoder_sha256: str,
    dim: int,
    factory: str | None = None,
    memory: int | None = None,
    milvus: MilvusOptions | None = None,
) -> GalleryBackend:
    """Builds a new index from re-iterable additions: FAISS files (factory, or chosen), or Milvus."""
    if milvus is None:
        return GalleryIndex.create(directory, additions, encoder_sha256, dim, factory, memory)
    require("pymilvus", "milvus")
    count = sum(len(chunk.items) for chunk in additions)
    return MilvusIndex.create(directory, additions, encoder_sha256, dim, milvus.uri, count, memory, milvus.index_type)
