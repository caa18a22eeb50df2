"""Indexing a collection of images: incremental by content hash, resumable after a crash."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from index.journal import Journal
from index.milvus import MilvusIndex, MilvusOptions
from index.ray_engine import RayOptions, iter_embedded_ray
from index.store import MANIFEST, Additions, GalleryIndex, writer_lock
from retrieval.data import Collection, Item, Skipped, write_skip_report
from retrieval.embedders import Embedder, OnnxEmbedder, iter_embedded
from retrieval.errors import RetrievalError


@dataclass
class IndexReport:
    """What one indexing job did."""

    index: GalleryIndex
    embedded: int  # embedded by this job (new or changed files)
    resumed: int  # embedded by an interrupted earlier job, taken from its journal
    unchanged: int  # already indexed with the same content
    removed: int  # entries whose file changed or (with sync) disappeared
    skipped: list[Skipped]


def journal_path(directory: Path) -> Path:
    """Where an indexing job into directory keeps its not-yet-committed embeddings."""
    return directory.with_name(f".{directory.name}.journal.sqlite")


class _Replay:
    """A re-iterable of additions: each iteration reads them again (a new index reads them twice)."""

    def __init__(self, read: Callable[[], Iterator[Additions]]) -> None:
        self.read = read

    def __iter__(self) -> Iterator[Additions]:
        return self.read()


def _current_only(chunks: Iterator[Additions], current: dict[str, str]) -> Iterator[Additions]:
    """Drops journal rows whose file is no longer listed or no longer has the content that was embedded."""
    for chunk in chunks:
        keep = [i for i, (item, digest) in enumerate(zip(chunk.items, chunk.hashes)) if current.get(str(item.path)) == digest]
        if keep:
            yield Additions(chunk.vectors[keep], [chunk.items[i] for i in keep], [chunk.hashes[i] for i in keep])


def build_index(
    embedder: Embedder,
    collection: Collection,
    directory: Path,
    sync: bool = False,
    rebuild: bool = False,
    batch_size: int | None = None,
    progress: bool = True,
    factory: str | None = None,
    memory: int | None = None,
    ray: RayOptions | None = None,
    milvus: MilvusOptions | None = None,
) -> IndexReport:
    """Adds the collection's new and changed images to the index at directory (creating it if needed).

    Files already indexed with the same content (sha256) are not embedded again; with sync, entries
    whose file is no longer in the collection are removed; rebuild ignores any existing index. A new
    index gets the FAISS type index.choice picks within memory bytes, or the factory string given.
    Embedded batches go to a journal first, so a killed job resumes where it stopped. The skipped
    files and their reasons are written to directory/skipped.json. With ray, the embedding runs on Ray
    Data (index.ray_engine) and everything else is the same. With milvus, a new index is a Milvus
    collection (index.milvus); an existing index keeps its backend.
    """
    directory = Path(directory)
    with writer_lock(directory):
        return _build_index(embedder, collection, directory, sync, rebuild, batch_size, progress, factory, memory, ray, milvus)


def _build_index(
    embedder: Embedder,
    collection: Collection,
    directory: Path,
    sync: bool,
    rebuild: bool,
    batch_size: int | None,
    progress: bool,
    factory: str | None,
    memory: int | None,
    ray: RayOptions | None,
    milvus: MilvusOptions | None,
) -> IndexReport:
    base = None if rebuild or not (directory / MANIFEST).is_file() else GalleryIndex.load(directory, embedder.fingerprint, embedder.dim)
    if base is not None and milvus is not None and base.manifest.get("backend") != "milvus":
        raise RetrievalError(f"{directory} is a FAISS index; add --rebuild to build it anew in Milvus")
    if base is not None and factory and factory != base.manifest.get("index_type"):
        raise RetrievalError(f"{directory} is a {base.manifest.get('index_type', 'Flat')} index; add --rebuild to build it anew as --faiss {factory!r}")
    indexed = {path: (item_id, digest) for item_id, (path, _, digest) in (base.rows() if base else {}).items()}
    journal = Journal(journal_path(directory), embedder.fingerprint, embedder.dim)
    skipped = list(collection.skipped)
    embedded = unchanged_count = 0
    pending = journal.hashes()
    # the check runs in the decoding threads: list.append and dict item assignment are atomic
    from_journal: list[str] = []
    current: dict[str, str] = {}  # sha256 of every readable listed file, as read by this job

    def unchanged(item: Item, digest: str) -> bool:
        path = str(item.path)
        current[path] = digest
        if pending.get(path) == digest:
            from_journal.append(path)
            return True
        return indexed.get(path, (None, None))[1] == digest

    if ray is None:
        batches = iter_embedded(embedder, collection.items, batch_size, unchanged, progress=progress)
    elif isinstance(embedder, OnnxEmbedder):
        known = {path: digest for path, (_, digest) in indexed.items()} | pending
        batches = iter_embedded_ray(embedder, collection.items, unchanged, known, directory.with_name(f".{directory.name}.ray"), ray, batch_size, progress)
    else:
        raise RetrievalError("--engine ray embeds with an exported model (model.onnx); export the run first")
    for batch in batches:
        if batch.items:
            journal.add(batch.items, batch.hashes, batch.vectors)
        embedded += len(batch.items)
        unchanged_count += batch.unchanged
        skipped += batch.skipped

    listed = {str(item.path) for item in collection.items}
    replaced = {path for path, digest in journal.hashes().items() if current.get(path) == digest}
    remove = [item_id for path, (item_id, _) in indexed.items() if path in replaced or (sync and path not in listed)]
    additions = _Replay(lambda: _current_only(journal.chunks(), current))
    if base is not None and not replaced and not remove:
        index = base  # nothing changed: the index on disk stays as it is
    elif base is None and milvus is not None:
        count = sum(len(chunk.items) for chunk in additions)
        index = MilvusIndex.create(directory, additions, embedder.fingerprint, embedder.dim, milvus.uri, count, memory, milvus.index_type)
    elif base is None:
        index = GalleryIndex.create(directory, additions, embedder.fingerprint, embedder.dim, factory, memory)
    else:
        index = base.update(additions, remove)
    journal.discard()
    write_skip_report(directory / "skipped.json", skipped)
    return IndexReport(index, embedded, len(from_journal), unchanged_count - len(from_journal), len(remove), skipped)
