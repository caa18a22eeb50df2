"""What every index backend shares: the file names, the result and addition types, and the Protocol.

The FAISS store (index.store) and the Milvus collection (index.milvus) both implement
`GalleryBackend`; index.backends.open_index picks one from the manifest, and the search path
(index.search), indexing (index.build) and editing (index.edit) only use this interface.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields
from numbers import Integral
from pathlib import Path
from typing import NamedTuple, Protocol

import numpy as np

from retrieval.data import Item
from retrieval.errors import RetrievalError, whole_number
from retrieval.knn import require_searchable
from retrieval.runs import INDEX_ITEMS, INDEX_MANIFEST, RunDir, shell_path

FORMAT_VERSION = 1
UNIT_TOLERANCE = 1e-4  # a row whose squared length is this close to 1 is taken as unit, as float32 embeddings are
MANIFEST = INDEX_MANIFEST  # named in the core, whose collections leave an index kept among images out
VECTORS = "vectors.faiss"
ITEMS = INDEX_ITEMS
SKIP_REPORT = "skipped.json"  # the files the last indexing job skipped, and why
RAW = "raw.f32"  # compressed types only: the exact float32 vectors, row id - 1, read memory-mapped to re-rank
INDEX_FILES = {MANIFEST, VECTORS, ITEMS, SKIP_REPORT, RAW}  # what an index's folder holds


def item_ids(ids: Sequence[int]) -> list[int]:
    """Item ids given as a list, as ints: one id, or text, is refused (the text "34" was read as the ids 3 and 4)."""
    if isinstance(ids, Integral):
        raise RetrievalError(f"ids: a list of item ids, not one id; write [{ids}]")
    if isinstance(ids, (str, bytes)):
        raise RetrievalError(f"ids: {ids!r} is text, not a list of item ids; give whole numbers, e.g. [3, 4]")
    wrong = next((i for i in ids if not whole_number(i)), None)
    if wrong is not None:
        raise RetrievalError(f"ids: {wrong!r} is not an item id; give whole numbers (the id column of search)")
    return [int(i) for i in ids]


def unknown_ids(directory: Path, missing: Sequence[int]) -> RetrievalError:
    """The error for ids that no item of the index at directory has (named in up to 200 characters)."""
    named = ", ".join(str(int(i)) for i in missing)[:200]
    return RetrievalError(
        f"{directory}: no {'item with id' if len(missing) == 1 else 'items with ids'} {named} in this index"
    )


def storable(ids: Iterable[int]) -> list[int]:
    """The distinct ids an index can hold (64-bit), sorted: one beyond them is no item's, not a failure of the
    store (SQLite's OverflowError was a 500 of the API for /items/99999999999999999999/neighbours)."""
    return sorted({int(i) for i in ids if -(2**63) <= i < 2**63})


def index_folder(directory: str | Path | RunDir | GalleryBackend) -> Path:
    """The index's folder: the path given, for a run given as its RunDir the run's own index (RUN/index), and for an
    opened index (open_index's) its folder."""
    if isinstance(directory, RunDir):
        return directory.index
    if isinstance(directory, (str, os.PathLike)):
        return Path(directory)
    opened = getattr(directory, "directory", None)  # a GalleryBackend
    if isinstance(opened, Path):
        return opened
    raise RetrievalError(
        f"index: {directory!r} is a {type(directory).__name__}; give the index's folder, its run's RunDir or the "
        "opened index"
    )


def index_command(directory: Path, rebuild: bool = False) -> str:
    """The command that builds (or rebuilds) the index at directory: the run's own (RUN/index) or one given --index."""
    command = (
        f"retrieval index {shell_path(directory.parent)} IMAGES"
        if directory.name == "index"
        else f"retrieval index RUN IMAGES --index {shell_path(directory)}"
    )
    return command + (" --rebuild" if rebuild else "")


def rebuild_advice(directory: Path) -> str:
    """What to do about a damaged or mismatched index at directory, with the command that does it."""
    return f"rebuild the index with `{index_command(directory, rebuild=True)}`"


def search_queries(queries: np.ndarray, k: int, dim: int) -> np.ndarray:
    """The query rows as a contiguous float32 matrix of unit rows, refusing what no index search can answer: another
    dimension, a row with NaN or infinite values (it found no hit, without a word), a row of zeros and k below 1 (it
    was read as 1)."""
    queries = np.ascontiguousarray(np.atleast_2d(queries), dtype=np.float32)
    if queries.ndim != 2:
        raise RetrievalError(f"queries: a matrix of one row per query, not an array of shape {queries.shape}")
    if queries.shape[1] != dim:
        raise RetrievalError(f"queries have dimension {queries.shape[-1]}, the index {dim}")
    require_searchable(queries, int(k))
    return unit_rows(queries, "query")


def unit_rows(rows: np.ndarray, what: str, squared: np.ndarray | None = None) -> np.ndarray:
    """The float32 rows, those not of unit length scaled to it: an index scores by cosine similarity, and a row of
    length 2 scored up to 2, above every match threshold. Unit rows (an embedder's) are kept bit for bit; a row of
    zeros, which has no direction, is refused. squared: the rows' squared lengths, where the caller has them."""
    squared = np.einsum("ij,ij->i", rows, rows) if squared is None else squared
    off = np.flatnonzero(np.abs(squared - 1.0) > UNIT_TOLERANCE)
    if not len(off):
        return rows
    zero = off[squared[off] == 0]
    if len(zero):
        raise RetrievalError(f"{what} row {int(zero[0])} is all zeros: it has no direction to search by")
    rows = rows.copy()
    rows[off] /= np.sqrt(squared[off])[:, None]
    return rows


class Row(NamedTuple):
    """What the index keeps of an item beside its vector (SQLite's or Milvus's columns)."""

    path: str
    label: str
    sha256: str


@dataclass(frozen=True)
class Hit:
    """One search result; match: whether its score reaches the run's match threshold (None: no threshold known)."""

    id: int
    path: str
    label: str
    score: float
    sha256: str
    match: bool | None = None


@dataclass(frozen=True)
class HitArrays:
    """The hits of a batch of queries as arrays, [queries, k] each, best first: ids (-1 where a query has fewer
    hits), scores (-inf there) and the items' paths, labels and sha256 ("" there), looked up once for the batch.

    Batch callers read the arrays; hits() builds the Hit objects (one per result, in Python) only when asked.
    """

    ids: np.ndarray
    scores: np.ndarray
    paths: np.ndarray
    labels: np.ndarray
    sha256: np.ndarray

    def __len__(self) -> int:
        return len(self.ids)

    def hits(self) -> list[list[Hit]]:
        """Each query's hits as Hit objects, best first."""
        columns = (self.ids.tolist(), self.paths.tolist(), self.labels.tolist(), self.scores.tolist())
        digests = self.sha256.tolist()
        return [  # from Python lists: numpy scalars cost microseconds each at thousands of queries a second
            [Hit(i, p, label, s, d) for i, p, label, s, d in zip(*row, digest) if i >= 0]
            for *row, digest in zip(*columns, digests)
        ]

    @classmethod
    def of(cls, lists: Sequence[Sequence[Hit]], k: int) -> HitArrays:
        """Hit lists as arrays k wide (for backends that return Hit objects, such as Milvus)."""
        shape = (len(lists), k)
        ids, scores = np.full(shape, -1, np.int64), np.full(shape, -np.inf, np.float32)
        paths, labels, digests = (np.full(shape, "", object) for _ in range(3))
        for row, hits in enumerate(lists):
            for column, hit in enumerate(hits[:k]):
                ids[row, column], scores[row, column] = hit.id, hit.score
                paths[row, column], labels[row, column], digests[row, column] = hit.path, hit.label, hit.sha256
        return cls(ids, scores, paths, labels, digests)


@dataclass(frozen=True)
class Additions:
    """A chunk of new items with their vectors (as unit float32 rows) and file hashes."""

    vectors: np.ndarray
    items: list[Item]
    hashes: list[str]

    def __post_init__(self) -> None:
        """Refuses a vector no search could find (NaN or infinite values, zeros), naming its item, and scales the
        others to unit length (vectors made outside an embedder)."""
        vectors = np.ascontiguousarray(np.atleast_2d(self.vectors), dtype=np.float32)
        squared = np.einsum("ij,ij->i", vectors, vectors, dtype=np.float64)  # NaN, inf carry into it; 0: zeros
        bad = np.flatnonzero(~np.isfinite(squared) | (squared == 0))
        if len(bad) and len(self.items) == len(vectors):
            row = int(bad[0])
            said = "only zeros" if squared[row] == 0 else "NaN or infinite values"
            raise RetrievalError(f"the vector of {self.items[row].path} holds {said}; it cannot be indexed")
        object.__setattr__(self, "vectors", unit_rows(vectors, "added vector", squared) if len(vectors) else vectors)


DEPTH_NAMES = {"ivf": "nprobe", "hnsw": "efSearch"}  # the search depth of each kind of index, as FAISS names it


@dataclass(frozen=True)
class Manifest:
    """An index directory's manifest.json: what the index holds, how it was built and searches, and by which encoder.

    On disk it is the JSON of to_dict (keys as FAISS and earlier versions wrote them: `recall@10`).
    Milvus indexes also name their server (uri), collection and index parameters.
    """

    dim: int
    count: int
    next_id: int
    encoder_sha256: str
    created: str
    updated: str = ""
    index_type: str = "Flat"  # a FAISS factory string, or a Milvus index type
    choice: str = "built before index types were chosen"  # why the type was chosen
    search: dict[str, int] = field(default_factory=dict)  # the tuned depth, {"nprobe": n} or {"efSearch": n}
    recall_at_10: float | None = None  # measured at build time for vectors held out of the index
    rerank: int = 0  # compressed types: candidates re-scored exactly per wanted result
    sha256: dict[str, str] = field(default_factory=dict)  # of the files beside it
    backend: str = "faiss"
    uri: str | None = None
    collection: str | None = None
    index_params: dict = field(default_factory=dict)
    metric: str = "inner_product"
    format_version: int = FORMAT_VERSION

    @property
    def kind(self) -> str:
        """flat, ivf or hnsw: which search depth (none, nprobe or efSearch) the type has."""
        return index_kind(self.index_type)

    @property
    def depth(self) -> int | None:
        """The search depth tuned at build time (nprobe or efSearch), if any."""
        value = next(iter(self.search.values()), None)
        return None if value is None else int(value)

    @property
    def depth_name(self) -> str | None:
        """nprobe, efSearch, or None for exact search."""
        return DEPTH_NAMES.get(self.kind)

    def describe_search(self) -> str:
        """The type with its tuned depth, e.g. "HNSW32, efSearch 64"."""
        return self.index_type + "".join(f", {name} {value}" for name, value in self.search.items())

    def to_dict(self) -> dict:
        """The manifest as JSON values, with the keys manifest.json has (unset Milvus fields left out)."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values["recall@10"] = values.pop("recall_at_10")
        return {key: value for key, value in values.items() if value is not None}

    @classmethod
    def from_dict(cls, values: dict, source: Path) -> Manifest:
        """The manifest read from JSON at source (index.disk.read_manifest has checked its required keys)."""
        given = {key.replace("recall@10", "recall_at_10"): value for key, value in values.items()}
        unknown = set(given) - {f.name for f in fields(cls)}
        if unknown:
            raise RetrievalError(
                f"{source}: has unknown keys {sorted(unknown)} (damaged, or written by another version); "
                f"{rebuild_advice(source.parent)}"
            )
        return cls(**given)


@dataclass(frozen=True)
class IndexFacts:
    """What an index holds and how it was built, as `retrieval index-stats` shows them: the manifest's facts, the
    sizes on disk (FAISS; None for Milvus) and the server and its index parameters (Milvus; None and {} for FAISS)."""

    count: int
    index_type: str
    choice: str  # why the type was chosen
    search: dict[str, int]  # the tuned depth, {"nprobe": n} or {"efSearch": n}; {} for exact search
    dim: int
    encoder_sha256: str
    updated: str
    backend: str = "faiss"
    server: str | None = None  # Milvus: "Milvus at URI, collection NAME"
    parameters: dict = field(default_factory=dict)  # Milvus: the index parameters
    vectors_mib: float | None = None
    items_mib: float | None = None
    bytes_per_vector: float | None = None
    # recall@10 tuned at build time for held-out gallery vectors (None for exact search)
    recall_at_build: float | None = None
    rerank: int | None = None  # compressed codes re-ranked with the exact vectors: candidates re-scored per result

    @classmethod
    def of(cls, manifest: Manifest, count: int, **more: object) -> IndexFacts:
        """The manifest's facts, with count and the backend's own (sizes, server) given."""
        kept = ("index_type", "choice", "search", "dim", "encoder_sha256", "updated", "backend")
        return cls(count=count, **{name: getattr(manifest, name) for name in kept}, **more)  # type: ignore[arg-type]


class ManifestFacts:
    """What a backend reads off its manifest: the vectors' dimension, the encoder that made them, the kind of depth."""

    directory: Path
    manifest: Manifest

    @property
    def dim(self) -> int:
        return self.manifest.dim

    @property
    def encoder_sha256(self) -> str:
        return self.manifest.encoder_sha256

    @property
    def kind(self) -> str:
        """flat, ivf or hnsw: which search depth (none, nprobe or efSearch) the type has."""
        return self.manifest.kind


class GalleryBackend(Protocol):
    """A gallery index: vectors with the items they came from, searched by inner product."""

    directory: Path
    manifest: Manifest

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

    def search_arrays(
        self,
        queries: np.ndarray,
        k: int = 10,
        depth: int | None = None,
        rerank: int | None = None,
        label: str | None = None,
    ) -> HitArrays:
        """search's hits as arrays, for batches (no Python object per result)."""
        ...

    def vectors_of(self, ids: Sequence[int]) -> np.ndarray:
        """The stored vectors of indexed items, in the order of ids."""
        ...

    def stored(self) -> tuple[np.ndarray, np.ndarray] | None:
        """(ids, vectors) of every item, as exact search compares them; None where only lossy codes are kept."""
        ...

    def facts(self) -> IndexFacts:
        """What `retrieval index-stats` shows of this backend: type, parameters, sizes (before measured recall)."""
        ...

    def rows(self, ids: Sequence[int] | None = None) -> dict[int, Row]:
        """id -> Row(path, label, sha256) of the given ids that exist (every item when None)."""
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
