"""Building a gallery index from a collection of images with any embedder."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from index.store import GalleryIndex
from retrieval.data import Collection, Skipped, write_skip_report
from retrieval.embedders import Embedder, embed_items


@dataclass
class Built:
    """The index that was written, and the files left out of it."""

    index: GalleryIndex
    skipped: list[Skipped]


def build_index(embedder: Embedder, collection: Collection, directory: Path, progress: bool = True) -> Built:
    """Embeds every readable image of the collection and saves the index to directory (skipped.json beside it lists the rest)."""
    embedded = embed_items(embedder, collection.items, progress=progress)
    index = GalleryIndex.build(directory, embedded.vectors, embedded.items, embedded.hashes, embedder.fingerprint)
    skipped = collection.skipped + embedded.skipped
    write_skip_report(Path(directory) / "skipped.json", skipped)
    return Built(index, skipped)
