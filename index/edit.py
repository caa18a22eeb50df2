"""Adding image files to an index and removing items from it, one atomic update each, under the writer lock.

`retrieval index` (index.build) commits its additions and removals with `commit_changes`; the app's
add and remove go through `add_images` and `remove_items`, which call it too. Every write holds the
index's writer lock around its read-modify-write, so two writers never lose each other's changes.
"""

from __future__ import annotations

import io
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from PIL import Image

from index.backends import open_index
from index.disk import writer_lock
from index.types import Additions, GalleryBackend, index_folder, item_ids
from retrieval.data import IMAGE_SUFFIXES, Item, Skipped, decode_image, read_image_bytes
from retrieval.embedders import Embedder, require_embedder
from retrieval.errors import ImageError, RetrievalError
from retrieval.runs import RunDir, write_atomic

WRITE_WAIT = 30.0  # seconds an add or remove waits for another writer


@dataclass(frozen=True)
class Added:
    """What add_images did: the new items' ids, in the order given, and the files left out with the reason."""

    ids: list[int]
    skipped: list[Skipped]


def commit_changes(base: GalleryBackend, additions: Iterable[Additions], removals: Sequence[int]) -> GalleryBackend:
    """base saved with removals and additions, refusing ids it does not hold; the caller holds the writer lock."""
    removals = sorted({int(i) for i in removals})
    missing = sorted(set(removals) - set(base.rows(removals)))
    if missing:
        raise RetrievalError(f"no item with id {', '.join(map(str, missing))} in {base.directory}")
    return base.update(additions, removals)


def add_images(
    directory: str | Path | RunDir | GalleryBackend,
    embedder: Embedder,
    paths: Sequence[str | Path],
    label: str,
    uploads: str | Path,
    wait: float = WRITE_WAIT,
) -> Added:
    """Copies readable images into uploads/<label>/ and adds them to the index (its folder, its run, or the opened
    index) with label ("": none), in one atomic update: the new ids, and the files left out (unreadable, or already
    indexed) with the reason.
    """
    if isinstance(paths, (str, Path)):
        raise RetrievalError(f"paths: a list of image files, not one file; write [{str(paths)!r}]")
    if not isinstance(label, str):
        raise RetrievalError(f'label: {label!r} is not text; give the images\' label, or "" for none')
    embedder, directory = require_embedder(embedder), index_folder(directory)
    uploads, label = Path(uploads), label.strip()
    added: list[Item] = []
    images, hashes, skipped = [], [], []
    with writer_lock(directory, wait):
        base = open_index(directory, embedder.fingerprint, embedder.dim)
        known = {row.sha256: item_id for item_id, row in base.rows().items()}
        for path in map(Path, paths):
            try:
                read = read_image_bytes(path)
                image = decode_image(read.data, path.name, embedder.input_size)
            except ImageError as error:
                skipped.append(Skipped(Path(path.name), error.reason))
                continue
            digest = read.sha256
            if digest in known or digest in hashes:
                where = f"item {known[digest]}" if digest in known else "another file of this upload"
                skipped.append(Skipped(Path(path.name), f"already indexed ({where} has the same content)"))
                continue
            target = uploads / folder_name(label) / f"{digest[:16]}{_suffix(read.data, path)}"
            write_atomic(target, read.data)
            added.append(Item(target, label))
            images.append(image)
            hashes.append(digest)
        if not added:
            return Added([], skipped)
        updated = commit_changes(base, [Additions(embedder.embed(images), added, hashes)], [])
    first = updated.manifest.next_id - len(added)
    return Added(list(range(first, first + len(added))), skipped)


def remove_items(
    directory: str | Path | RunDir | GalleryBackend,
    embedder: Embedder,
    ids: Sequence[int],
    uploads: str | Path | None = None,
    wait: float = WRITE_WAIT,
) -> int:
    """Removes items from the index (its folder, its run, or the opened index) in one atomic update; their files are
    deleted only where they lie in uploads."""
    embedder, directory = require_embedder(embedder), index_folder(directory)
    uploads = None if uploads is None else Path(uploads)
    ids = sorted(set(item_ids(ids)))
    if not ids:
        raise RetrievalError("no item to remove: pick one in the Browse tab or give its id")
    with writer_lock(directory, wait):
        base = open_index(directory, embedder.fingerprint, embedder.dim)
        rows = base.rows(ids)
        commit_changes(base, [], ids)
    for row in rows.values():
        if uploads is not None and Path(row.path).is_relative_to(uploads):
            Path(row.path).unlink(missing_ok=True)
    return len(ids)


def folder_name(label: str) -> str:
    """A label as a safe folder name (no separators, no leading dot): the uploads folder cannot be left."""
    name = re.sub(r"[^\w.-]+", "_", label).lstrip(".")
    return name or "unlabeled"


def _suffix(data: bytes, path: Path) -> str:
    """The suffix of the image's real format (the uploaded name may lie)."""
    suffix = f".{(Image.open(io.BytesIO(data)).format or '').lower()}".replace(".jpeg", ".jpg")
    return suffix if suffix in IMAGE_SUFFIXES else path.suffix.lower()
