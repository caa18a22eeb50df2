"""Indexing a collection of images: incremental by content hash, resumable after a crash."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path

from index.backends import create_index, open_index
from index.choice import parse_memory
from index.disk import writer_lock
from index.edit import commit_changes
from index.faiss_ops import parsed_factory
from index.journal import Journal
from index.milvus import MilvusIndex, MilvusOptions
from index.ray_engine import RayOptions, iter_embedded_ray
from index.types import MANIFEST, SKIP_REPORT, Additions, GalleryBackend, index_folder
from retrieval.data import Collection, Item, Skipped, as_collection, none_readable, write_skip_report
from retrieval.embedders import EmbeddedBatch, Embedder, OnnxEmbedder, iter_embedded, require_embedder
from retrieval.errors import RetrievalError, require_whole
from retrieval.runs import RunDir

SYNC_SAMPLE = 20  # indexed files looked for before --sync may empty an index for another folder


@dataclass
class IndexReport:
    """What one indexing job did."""

    index: GalleryBackend
    embedded: int  # embedded by this job (new or changed files)
    resumed: int  # embedded by an interrupted earlier job, taken from its journal
    unchanged: int  # already indexed with the same content
    removed: int  # entries whose file changed or (with sync) disappeared or can no longer be read
    skipped: list[Skipped]
    stale: list[str] = field(default_factory=list)  # indexed files now unreadable, their entries kept (without sync)


def journal_path(directory: Path) -> Path:
    """Where an indexing job into directory keeps its not-yet-committed embeddings."""
    return directory.with_name(f".{directory.name}.journal.sqlite")


class _Replay:
    """A re-iterable of additions: each iteration reads them again (a new index reads them twice)."""

    def __init__(self, read: Callable[[], Iterator[Additions]]) -> None:
        self.read = read

    def __iter__(self) -> Iterator[Additions]:
        return self.read()


def build_index(
    embedder: Embedder,
    collection: Collection | str | Path,
    directory: str | Path | RunDir,
    sync: bool = False,
    rebuild: bool = False,
    batch_size: int | None = None,
    progress: bool = True,
    factory: str | None = None,
    memory: int | str | None = None,
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
    collection (index.milvus); an existing index keeps its backend. A path given for the collection is read as
    load_collection reads it, and memory may be written as --memory takes it ("4GB"); a run given as its RunDir
    stands for its own index (RUN/index).
    """
    embedder, directory = require_embedder(embedder), index_folder(directory)
    collection = as_collection(collection, use="index")
    if isinstance(memory, str):
        memory = parse_memory(memory)
    given = ("--faiss", factory) if factory else ("--milvus-index", milvus.index_type) if milvus else (None, None)
    if memory is not None and given[1]:  # it was ignored: the type given is built whatever it needs
        raise RetrievalError(
            f"--memory sets the budget within which the index type is chosen, and {given[0]} {given[1]} chooses it: "
            "drop one of the two"
        )
    if batch_size is not None:
        require_whole("batch_size", batch_size, 1)
    with writer_lock(directory):
        return _build_index(
            embedder, collection, directory, sync, rebuild, batch_size, progress, factory, memory, ray, milvus
        )


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
    base = (
        None
        if rebuild or not (directory / MANIFEST).is_file()
        else open_index(directory, embedder.fingerprint, embedder.dim)
    )
    _check_kept_type(directory, base, factory, milvus)
    if factory and milvus is None and base is None:
        parsed_factory(factory, embedder.dim, len(collection.items))  # said before the gallery is embedded
    indexed = {row.path: (item_id, row.sha256) for item_id, row in (base.rows() if base else {}).items()}
    if sync:
        _refuse_other_gallery(directory, collection, indexed)
    journal = Journal(journal_path(directory), embedder.fingerprint, embedder.dim)
    scan = _Scan({path: digest for path, (_, digest) in indexed.items()}, journal.hashes())
    skipped = list(collection.skipped)
    embedded = unchanged_count = 0
    for batch in _batches(embedder, collection, directory, scan, batch_size, progress, ray):
        if batch.items:
            journal.add(batch.items, batch.hashes, batch.vectors)
        embedded += len(batch.items)
        unchanged_count += batch.unchanged
        skipped += batch.skipped
    pending = journal.hashes()
    if base is None and skipped and not pending:  # a new index, and not one image could be read
        journal.discard()
        raise none_readable(collection.source, skipped)
    paths = {str(item.path): item.path for item in collection.items}
    listed = paths.keys()
    replaced = {path for path, digest in pending.items() if scan.current.get(path) == digest}
    unreadable = {str(entry.path) for entry in skipped} & indexed.keys()  # an indexed file broken since
    drop = sync and unreadable < listed & indexed.keys()  # not when none can be read: a disk gone, not the files
    gone = (indexed.keys() - listed if sync else set()) | (unreadable if drop else set())
    remove = [item_id for path, (item_id, _) in indexed.items() if path in replaced or path in gone]
    additions = _Replay(lambda: journal.chunks(current=scan.current, paths=paths))
    if base is not None and not replaced and not remove:
        index = base  # nothing changed: the index on disk stays as it is
    elif base is None:
        index = create_index(directory, additions, embedder.fingerprint, embedder.dim, factory, memory, milvus)
    else:
        index = commit_changes(base, additions, remove)
    journal.discard()
    write_skip_report(directory / SKIP_REPORT, skipped)
    resumed = len(scan.from_journal)
    stale = [] if drop else sorted(unreadable)
    return IndexReport(index, embedded, resumed, unchanged_count - resumed, len(remove), skipped, stale)


def _refuse_other_gallery(directory: Path, collection: Collection, indexed: dict[str, tuple[int, str]]) -> None:
    """Raises RetrievalError where --sync would empty the index for another folder: none of IMAGES is indexed yet and
    the indexed files are still there (a command from the shell's history, with another gallery): every entry would
    go, and the gallery would be embedded again to get it back."""
    if not indexed or any(str(item.path) in indexed for item in collection.items):
        return
    present = [path for path in islice(indexed, SYNC_SAMPLE) if Path(path).is_file()]
    if present:
        raise RetrievalError(
            f"{directory}: --sync would remove all {len(indexed):,} entries, whose files are still there (e.g. "
            f"{present[0]}) but not in {collection.source}; to index it alone add --rebuild (or give --index another "
            "folder), to add it to this index leave out --sync"
        )


def _check_kept_type(
    directory: Path, base: GalleryBackend | None, factory: str | None, milvus: MilvusOptions | None
) -> None:
    """An existing index keeps its backend and type: asking for another needs --rebuild."""
    if base is not None and milvus is not None and not isinstance(base, MilvusIndex):
        raise RetrievalError(f"{directory} is a FAISS index; add --rebuild to build it anew in Milvus")
    if base is not None and factory and factory != base.manifest.index_type:
        kept = base.manifest.index_type
        raise RetrievalError(f"{directory} is a {kept} index; add --rebuild to build it anew as --faiss {factory!r}")


class _Scan:
    """Which listed files need embedding: not when indexed or journaled with the content they have now.

    unchanged runs in the decoding threads: list.append and dict item assignment are atomic.
    """

    def __init__(self, indexed: dict[str, str], pending: dict[str, str]) -> None:
        self.indexed, self.pending = indexed, pending
        self.from_journal: list[str] = []
        self.current: dict[str, str] = {}  # sha256 of every readable listed file, as read by this job

    def unchanged(self, item: Item, digest: str) -> bool:
        path = str(item.path)
        self.current[path] = digest
        if self.pending.get(path) == digest:
            self.from_journal.append(path)
            return True
        return self.indexed.get(path) == digest


def _batches(
    embedder: Embedder,
    collection: Collection,
    directory: Path,
    scan: _Scan,
    batch_size: int | None,
    progress: bool,
    ray: RayOptions | None,
) -> Iterator[EmbeddedBatch]:
    """The embedded batches of the files to index, from this process or from Ray Data."""
    if ray is None:
        return iter_embedded(embedder, collection.items, batch_size, scan.unchanged, progress=progress)
    if not isinstance(embedder, OnnxEmbedder):
        raise RetrievalError("--engine ray embeds with an exported model (model.onnx); export the run first")
    known = scan.indexed | scan.pending
    shards = directory.with_name(f".{directory.name}.ray")
    return iter_embedded_ray(embedder, collection.items, scan.unchanged, known, shards, ray, batch_size, progress)
