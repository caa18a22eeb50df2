"""The one search path: images, vectors or indexed items in, typed hits out, for every caller.

`retrieval search`, the app, its API and evaluation on a deployed index all call these functions.
Each query says how many hits it wants, how deep to search and which label to keep (`Query`); a
batch of image queries is decoded one by one and embedded in one call; an image that cannot be read
fails only its own query, with a typed value (`QueryResult.error`, a retrieval.errors.Failure: its
kind and message), as does an unknown id or label. The query itself is left out of its results: an
indexed item by its id, an image by its bytes (the first gallery file with the same sha256 is the query; other
copies are hits).
Works with any backend (index.types.GalleryBackend).
"""

from __future__ import annotations

import difflib
import hashlib
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from index.types import GalleryBackend, Hit, item_ids
from retrieval.calibration import require_threshold
from retrieval.data import decode, read_image_bytes
from retrieval.embedders import Embedder, require_embedder
from retrieval.errors import ErrorKind, Failure, ImageError, RetrievalError, whole_number
from retrieval.rerank import NO_RERANK, Rerank, rerank

IDS_HINT = "the ids are in the id column of `retrieval search` (and its --json) and in the app's captions"
ANIMATED = "animated: searched with its first frame"


@dataclass(frozen=True)
class Query:
    """How one query is answered: k hits, at a search depth (nprobe or efSearch; None: the tuned one), of one label
    only (None: any), its shortlist re-ranked (retrieval.rerank; by default not), each hit marked a match when its
    score reaches threshold (retrieval.calibration; None: not marked)."""

    k: int = 10
    depth: int | None = None
    label: str | None = None
    rerank: Rerank = NO_RERANK
    threshold: float | None = None

    def __post_init__(self) -> None:
        """Refuses values of the wrong type where they would fail deep inside the search (k "5" or 2.5, label 5), and
        k below 1; whole numbers of other types (numpy's) are kept as int."""
        for name, value in (("k", self.k), ("depth", self.depth)):
            if value is not None and not whole_number(value):
                raise RetrievalError(f"Query {name}={value!r}: give a whole number")
            object.__setattr__(self, name, None if value is None else int(value))
        if self.label is not None and not isinstance(self.label, str):
            raise RetrievalError(f"Query label={self.label!r}: give the label as text, or None for any label")
        if self.k < 1:
            raise RetrievalError(f"k must be at least 1, got {self.k}")
        if not isinstance(self.rerank, Rerank):  # "qe" failed deep inside: 'str' object has no attribute 'active'
            raise RetrievalError(
                f"Query rerank={self.rerank!r}: give a Rerank, e.g. retrieval.rerank.parse_rerank({self.rerank!r})"
            )
        require_threshold(self.threshold)


@dataclass(frozen=True)
class ImageQuery:
    """An image to search with: a name for messages, its bytes, and their sha256 when already known."""

    name: str
    data: bytes
    sha256: str | None = None

    @property
    def digest(self) -> str:
        """The sha256 of the bytes (a gallery file with it is the query itself)."""
        return self.sha256 or hashlib.sha256(self.data).hexdigest()


@dataclass
class QueryResult:
    """The hits of one query, best first, or why it failed (error), with what else is worth saying (notes)."""

    hits: list[Hit] = field(default_factory=list)
    error: Failure | None = None
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0  # the whole batch's time, decoding and embedding included
    batch: int = 1  # queries answered together with this one (one embedding call)
    itself: Hit | None = None  # the gallery item with the query image's bytes, left out of the hits


Itself = Callable[[Hit], bool]  # whether a hit is the query itself (its id, or its image's sha256)
TIED = 1 - 1e-4  # a candidate scoring this may tie with the query's own item (its own picture scores about 1)
WIDEST = 1024  # the deepest a query searches for its own item hidden behind ties


def search_vectors(
    index: GalleryBackend,
    vectors: np.ndarray,
    queries: Query | Sequence[Query] = Query(),
    itself: Sequence[Itself | None] | None = None,
) -> list[list[Hit]]:
    """The hits of each row of vectors (one Query for all, or one per row), answered together for queries that share
    a depth, a label and a re-ranker.

    itself[i] tells query i's own gallery item, left out of its hits, and, when re-ranking, of its
    shortlist and of its candidates' augmentation, as evaluation leaves a query out.
    """
    vectors = np.atleast_2d(np.asarray(vectors, np.float32))
    return _search(index, vectors, _per_query(queries, len(vectors), "vectors"), itself)[0]


def _per_query(queries: Query | Sequence[Query], count: int, what: str) -> list[Query]:
    """A Query for each of count images or vectors: one Query given is each one's; a list must be as long (a shorter
    one would leave the rest unanswered without a word)."""
    if isinstance(queries, Query):
        return [queries] * count
    listed = isinstance(queries, Sequence) and not isinstance(queries, (str, bytes))
    wrong = next((query for query in queries if not isinstance(query, Query)), None) if listed else queries
    if not listed or wrong is not None:  # search_images(index, embedder, images, 5): "type 'int' has no len()"
        raise RetrievalError(
            f"queries: a {type(wrong).__name__} is not a Query; give one Query for all (e.g. Query(k=5)), or a list of "
            "one per item"
        )
    if len(queries) != count:
        raise RetrievalError(
            f"{count} {what} for {len(queries)} queries: give one Query for all of them, or a list of one per item"
        )
    return list(queries)


def _search(
    index: GalleryBackend, vectors: np.ndarray, queries: Sequence[Query], itself: Sequence[Itself | None] | None
) -> tuple[list[list[Hit]], list[Hit | None]]:
    """search_vectors's hits, and each query's own gallery item that was left out of them (None: not found)."""
    found: list[list[Hit]] = [[] for _ in queries]
    left_out: list[Hit | None] = [None] * len(queries)
    itself = list(itself) if itself is not None else [None] * len(queries)
    for (depth, label, reranker), rows in _groups(queries).items():
        k = max(queries[row].k for row in rows) + any(itself[row] is not None for row in rows)
        own = [itself[row] for row in rows]
        if reranker.active:
            hits_of, owns = _reranked(index, vectors[rows], own, max(k, reranker.shortlist + 1), depth, label, reranker)
        else:
            hits_of, owns = _candidates(index, vectors[rows], k, depth, label, own)
        for row, hits, mine in zip(rows, hits_of, owns):
            found[row], left_out[row] = _marked(hits[: queries[row].k], queries[row].threshold), mine
    return found, left_out


def _marked(hits: list[Hit], threshold: float | None) -> list[Hit]:
    """The hits, each marked whether it reaches the match threshold (unmarked without one)."""
    if threshold is None:
        return hits
    return [replace(hit, match=hit.score >= threshold) for hit in hits]


def _candidates(
    index: GalleryBackend,
    vectors: np.ndarray,
    k: int,
    depth: int | None,
    label: str | None,
    itself: Sequence[Itself | None],
) -> tuple[list[list[Hit]], list[Hit | None]]:
    """Each query's k candidates from the index other than the query itself, and its own item (None: not there).

    Where the own item is not among them but the last of them still scores about 1, copies of its picture under
    other bytes (or of its vector) tie with it and, listed first by id, hid it: the query searches deeper, up to
    WIDEST, for it, so that the note names it (its hits are the same)."""
    lists, owns = _split_off(index.search(vectors, k, depth, label=label), itself)
    deepest = min(WIDEST, len(index))
    for row, mine in enumerate(itself):
        width, hits = k, lists[row]
        while mine is not None and owns[row] is None and len(hits) == width < deepest and hits[-1].score >= TIED:
            width = min(width * 4, deepest)
            [hits], [owns[row]] = _split_off(index.search(vectors[row : row + 1], width, depth, label=label), [mine])
        if owns[row] is not None and hits is not lists[row]:  # found deeper: the hits before it, as without ties
            lists[row] = hits[: k - 1]
    return lists, owns


def _split_off(lists: Sequence[list[Hit]], itself: Sequence[Itself | None]) -> tuple[list[list[Hit]], list[Hit | None]]:
    """Each query's hits other than the query itself, and its own item among them (None: not there). Where its bytes
    are indexed twice, the first copy is its own and the others stay hits: leaving them all out returned fewer than k
    hits, and hid the copies."""
    kept: list[list[Hit]] = []
    own: list[Hit | None] = []
    for hits, mine in zip(lists, itself):
        found = next((hit for hit in hits if mine(hit)), None) if mine is not None else None
        own.append(found)
        kept.append([hit for hit in hits if hit is not found])
    return kept, own


def _reranked(
    index: GalleryBackend,
    vectors: np.ndarray,
    itself: Sequence[Itself | None],
    shortlist: int,
    depth: int | None,
    label: str | None,
    spec: Rerank,
) -> tuple[list[list[Hit]], list[Hit | None]]:
    """Each query's shortlist from the index, re-ranked by spec (database augmentation with the index's neighbours),
    and its own item left out of it."""
    lists, owns = _candidates(index, vectors, shortlist, depth, label, itself)
    own = [hit.id if hit is not None else -2 for hit in owns]  # -2: no own item (rerank's leave-out id)
    ids, scores = hit_arrays(lists, max((len(hits) for hits in lists), default=0))

    def neighbours(items: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
        return hit_arrays(search_items(index, items.tolist(), Query(n, depth)), n)

    def stored(items: np.ndarray) -> np.ndarray:
        return index.vectors_of(items.tolist())

    ids, scores = rerank(spec, vectors, ids, scores, stored, neighbours, np.asarray(own, np.int64))
    by_id = {hit.id: hit for hits in lists for hit in hits}
    reranked = [
        [replace(by_id[int(i)], score=float(s)) for i, s in zip(row_ids, row_scores) if i >= 0]
        for row_ids, row_scores in zip(ids, scores)
    ]
    return reranked, owns


def hit_arrays(
    lists: Sequence[Sequence[Hit]], width: int, row_of: dict[int, int] | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Hit lists as (ids [Q, width], scores), -1 and -inf where a list is shorter.

    row_of: report each hit as row_of[its id] instead (-1 for an id not in it), e.g. a row of an evaluated set.
    """
    ids = np.full((len(lists), width), -1, np.int64)
    scores = np.full((len(lists), width), -np.inf, np.float32)
    for row, hits in enumerate(lists):
        kept = hits[:width]
        ids[row, : len(kept)] = [hit.id if row_of is None else row_of.get(hit.id, -1) for hit in kept]
        scores[row, : len(kept)] = [hit.score for hit in kept]
    return ids, scores


def search_items(index: GalleryBackend, ids: Sequence[int], query: Query = Query()) -> list[list[Hit]]:
    """The hits of items already indexed, by their stored vectors, each item itself left out."""
    ids = item_ids(ids)
    itself = [_same_id(item) for item in ids]
    return search_vectors(index, index.vectors_of(ids), [query] * len(ids), itself)


def deployed_ranking(
    index: GalleryBackend, ids: Sequence[int], rerank: Rerank = NO_RERANK
) -> Callable[[np.ndarray, int], tuple[np.ndarray, np.ndarray]]:
    """The index's own search, as retrieval.metrics.score_queries takes it: the items `ids` (rows 0..) search the
    index at its tuned depth (each itself left out) for `count` hits; hits become rows, -1 for an item not in ids."""
    row_of = {int(item): row for row, item in enumerate(ids)}

    def search(rows: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray]:
        found = search_items(index, [int(ids[row]) for row in rows], Query(k=count, rerank=rerank))
        return hit_arrays(found, count, row_of)

    return search


def _same_id(item: int) -> Itself:
    return lambda hit: hit.id == item


def _same_bytes(digest: str) -> Itself:
    return lambda hit: hit.sha256 == digest


def unknown_id(index: GalleryBackend, item_id: int) -> Failure:
    """The failure of a query by an id the index does not hold."""
    return Failure(ErrorKind.UNKNOWN_ID, f"no item with id {item_id} in {index.directory}; {IDS_HINT}")


def search_item(index: GalleryBackend, item_id: int, query: Query = Query()) -> QueryResult:
    """The hits of one indexed item (itself left out), or an unknown-id failure when the index lacks it."""
    started = time.perf_counter()
    (item_id,) = item_ids([item_id])  # the text "3" was looked up as no item
    if item_id not in index.rows([item_id]):
        return QueryResult(error=unknown_id(index, item_id))
    result = QueryResult(search_items(index, [item_id], query)[0], seconds=time.perf_counter() - started)
    explain_empty(index, [result], [query])
    return result


def search_images(
    index: GalleryBackend,
    embedder: Embedder,
    images: Sequence[str | Path],
    queries: Query | Sequence[Query] = Query(),
) -> list[QueryResult]:
    """The hits of each image file (one Query for all, or one per image), embedded in one call; a gallery item with an
    image's exact bytes (the first, where there are copies) is left out."""
    if isinstance(images, (str, Path)):
        raise RetrievalError(f"images: a list of image files, not one file; write [{str(images)!r}]")
    wrong = next((image for image in images if not isinstance(image, (str, os.PathLike))), None)
    if wrong is not None:  # a PIL image failed in "expected str, bytes or os.PathLike object"
        raise RetrievalError(
            f"images: a {type(wrong).__name__} object is not an image file's path; give paths, or search an image in "
            "memory by its vector: search_vectors(index, embedder.embed([image]), query)"
        )
    queries = _per_query(queries, len(images), "images")
    read: list[ImageQuery | Failure] = []
    for path in images:
        try:
            file = read_image_bytes(Path(path))
            read.append(ImageQuery(str(path), file.data, file.sha256))
        except ImageError as error:
            read.append(Failure.of(error))
    return search_image_bytes(index, embedder, read, queries)


def search_image_bytes(
    index: GalleryBackend,
    embedder: Embedder,
    images: Sequence[ImageQuery | Failure],
    queries: Query | Sequence[Query] = Query(),
) -> list[QueryResult]:
    """The hits of each image (uploads, or files read; a Failure is that query's, as it came), embedded in one call;
    one Query for all, or one per image."""
    embedder, queries = require_embedder(embedder), _per_query(queries, len(images), "images")
    started = time.perf_counter()
    results = [QueryResult(error=image if isinstance(image, Failure) else None) for image in images]
    decoded, digests, good = [], [], []
    for position, image in enumerate(images):
        if isinstance(image, Failure):
            continue
        try:
            read = decode(image.data, image.name, embedder.input_size)
        except ImageError as error:
            results[position].error = Failure.of(error)
            continue
        if read.animated:
            results[position].notes.append(ANIMATED)
        decoded.append(read.image)
        digests.append(image.digest)
        good.append(position)
    if good:
        itself = [_same_bytes(digest) for digest in digests]
        found, owns = _search(index, embedder.embed(decoded), [queries[p] for p in good], itself)
        for position, hits, own in zip(good, found, owns):
            results[position].hits, results[position].itself = hits, own
            if own is not None:
                results[position].notes.append(
                    f"the query is gallery item {own.id}, {Path(own.path).name}, left out of its hits"
                )
    for result in results:
        result.seconds = time.perf_counter() - started
        result.batch = len(results)
    explain_empty(index, results, queries)
    return results


def explain_empty(index: GalleryBackend, results: Sequence[QueryResult], queries: Sequence[Query]) -> None:
    """Turns an empty result of a label filter into an unknown-label failure when no item has that label, naming the
    closest ones. Only empty results are looked at, so the index's labels are read only when a filter found nothing.
    """
    empty = [(result, query) for result, query in zip(results, queries) if not result.hits and result.error is None]
    if not any(query.label is not None for _, query in empty):
        return
    labels = sorted({row.label for row in index.rows().values()})
    for result, query in empty:
        if query.label is not None and query.label not in labels:
            closest = closest_labels(query.label, labels)
            message = f"no item of {index.directory} has the label {query.label!r}; the closest labels are {closest}"
            result.error = Failure(ErrorKind.UNKNOWN_LABEL, message)


def closest_labels(label: str, labels: Iterable[str]) -> str:
    """The three labels nearest to a label that none has (a typo's likely meaning), for a message."""
    return ", ".join(difflib.get_close_matches(label, sorted(labels), n=3, cutoff=0.0))


def _groups(queries: Sequence[Query]) -> dict[tuple[int | None, str | None, Rerank], list[int]]:
    """Query positions by (depth, label, re-ranker): each group is one search call."""
    groups: dict[tuple[int | None, str | None, Rerank], list[int]] = {}
    for position, query in enumerate(queries):
        groups.setdefault((query.depth, query.label, query.rerank), []).append(position)
    return groups
