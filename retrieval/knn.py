"""The one exact k-NN: inner product over float32 rows, ties broken by the lower id for any size of tie group.

Metrics, the export's parity check, the index's depth tuning and `retrieval index-stats` all rank
with `nearest_neighbours`; the index's own searches order their candidates with `ranked`, the same
rule over whatever a FAISS index returns.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from retrieval.errors import RetrievalError
from retrieval.extras import require

QUERY_BLOCK = 2048  # queries searched at a time, so that memory stays bounded
TIE_MARGIN = 8  # extra candidates fetched so that most tie groups at the k-th place are seen whole at once

# search(queries, n) -> (scores [Q, n], ids [Q, n]), best first, id -1 where there are fewer than n
Search = Callable[[np.ndarray, int], tuple[np.ndarray, np.ndarray]]


def flat_index(vectors: np.ndarray) -> object:
    """An exact inner-product FAISS index holding vectors (row i has id i)."""
    faiss = require("faiss", "cpu")
    vectors = np.ascontiguousarray(vectors, np.float32)
    index = faiss.IndexFlatIP(vectors.shape[1])
    index.add(vectors)
    return index


def nearest_neighbours(
    queries: np.ndarray, gallery: np.ndarray, k: int, exclude_self: bool = False, block: int = QUERY_BLOCK
) -> tuple[np.ndarray, np.ndarray]:
    """Returns (indices [Q, k], similarities [Q, k]) of the k most similar gallery rows by inner product.

    With exclude_self, query i is gallery item i (leave-one-out) and is never its own neighbour.
    """
    queries = np.ascontiguousarray(queries, np.float32)
    require_searchable(queries, k)
    rows = np.asarray(gallery)
    if queries.ndim != 2 or rows.ndim != 2 or queries.shape[1] != rows.shape[1]:  # FAISS's bare AssertionError
        raise RetrievalError(
            f"queries of shape {queries.shape} against a gallery of shape {rows.shape}: give rows of one dimension"
        )
    require_searchable(rows, what="gallery")
    index = flat_index(gallery)
    k = min(k, index.ntotal - (1 if exclude_self else 0))  # type: ignore[attr-defined]
    if k < 1:  # a gallery of one item leaves none to a query that is that item
        return np.zeros((len(queries), 0), np.int64), np.zeros((len(queries), 0), np.float32)
    indices = np.zeros((len(queries), k), np.int64)
    scores = np.zeros((len(queries), k), np.float32)
    for start in range(0, len(queries), block):
        rows = np.arange(start, min(start + block, len(queries)))
        indices[rows], scores[rows] = search_flat(index, queries[rows], k, rows if exclude_self else None)
    return indices, scores


def require_searchable(rows: np.ndarray, k: int = 1, what: str = "query") -> None:
    """One line for what no search can answer (the core's k-NN and every index search ask it): k below 1, and rows
    with NaN or infinite values, which found no neighbour without a word."""
    if k < 1:
        raise RetrievalError(f"k must be at least 1, got {k}")
    finite = np.isfinite(rows.sum(axis=1))  # a row sum, not a mask the rows' size: NaN and inf carry into it
    if not finite.all():
        raise RetrievalError(f"{what} row {int(np.argmin(finite))} holds NaN or infinite values; give finite vectors")


@dataclass(frozen=True)
class Neighbours:
    """Each row's nearest other rows of one collection, best first (leave-one-out), searched once to the deepest
    depth that several users need: `first(k)` is what `nearest_neighbours(vectors, vectors, k, exclude_self=True)`
    gives (ties go to the lower id, so a shallower search is a prefix of a deeper one)."""

    ids: np.ndarray  # [N, depth]
    similarities: np.ndarray  # [N, depth]

    @classmethod
    def of(cls, vectors: np.ndarray, depth: int) -> Neighbours:
        """The neighbours of every row of vectors among the others, to depth (or all the others, if fewer)."""
        return cls(*nearest_neighbours(vectors, vectors, depth, exclude_self=True))

    def first(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids [N, k], similarities [N, k]): the k nearest (all of them where fewer were searched than k, as
        nearest_neighbours gives where the collection holds fewer)."""
        if k > self.ids.shape[1] and self.ids.shape[1] < len(self.ids) - 1:
            raise ValueError(f"searched to depth {self.ids.shape[1]}, asked for {k}")
        return self.ids[:, :k], self.similarities[:, :k]


def search_flat(
    index: object, queries: np.ndarray, k: int, own: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """The k nearest ids and scores of each query in a FAISS index, never a query's own id (own[i])."""

    def fetch(rows: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
        return index.search(rows, n)  # type: ignore[attr-defined]

    ids, scores = ranked(fetch, np.ascontiguousarray(queries, np.float32), k, index.ntotal, own)  # type: ignore[attr-defined]
    return ids, scores


def ranked(
    search: Search, queries: np.ndarray, k: int, total: int, own: np.ndarray | None = None, margin: int = TIE_MARGIN
) -> tuple[np.ndarray, np.ndarray]:
    """(ids [Q, k], scores [Q, k]) of each query's k best items by score, then by the lower id.

    search returns candidates best first out of `total` items; a query's own id (own[i]) is left out.
    The first search fetches margin (at least 1) candidates more than it keeps. When the last candidate
    fetched ties the k-th score, the tie group may go on beyond it, so that query is searched again with
    twice as many candidates, until the group is seen whole. Missing places (fewer than k items) have id
    -1 and score -inf.
    """
    ids = np.full((len(queries), k), -1, np.int64)
    scores = np.full((len(queries), k), -np.inf, np.float32)
    pending = np.arange(len(queries))
    wanted = min(total, k + (own is not None) + max(1, margin))
    while len(pending) and wanted > 0:
        found_scores, found = search(np.ascontiguousarray(queries[pending]), wanted)
        last = found_scores[:, -1].copy()
        found_scores = np.where(found < 0, -np.inf, found_scores)
        if own is not None:
            found_scores = np.where(found == own[pending, None], -np.inf, found_scores)
        order = np.lexsort((found, found < 0, -found_scores), axis=1)[:, :k]
        ids[pending, : order.shape[1]] = np.take_along_axis(found, order, axis=1)
        scores[pending, : order.shape[1]] = np.take_along_axis(found_scores, order, axis=1)
        kth = scores[pending, -1]
        open_group = (found[:, -1] >= 0) & (last >= kth) & (kth > -np.inf)
        if wanted >= total:
            break
        pending, wanted = pending[open_group], min(total, 2 * wanted)
    ids[scores == -np.inf] = -1
    return ids, scores
