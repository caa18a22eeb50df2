"""Retrieval metrics of metric learning, as pure functions of embeddings and labels.

Definitions (Musgrave et al. 2020, "A Metric Learning Reality Check"): for a query with R relevant
gallery items (same label, itself excluded),

- recall@k = 1 if at least one relevant item is among the k nearest neighbours, else 0 (the values
  for k = 1, 2, ... form the CMC curve);
- precision@k = (relevant items among the k nearest) / k;
- R-precision = (relevant items among the R nearest) / R;
- MAP@R = (1/R) * sum_{i=1..R} P(i) * rel(i), where P(i) is the precision of the top i;
- mAP = (1/R) * sum over the R relevant items of the precision at their rank in the full ranking.

Each is averaged over the queries that have at least one relevant item; the others are counted in
`num_skipped_queries`. Neighbours come from FAISS (exact inner product, cosine for unit rows),
queries in blocks so that memory stays bounded (retrieval.knn); in leave-one-out, a query's own item
is removed by its index, not by its distance; ties are broken by the lower gallery index, however
many items share a score.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from retrieval.errors import RetrievalError, whole_number
from retrieval.extras import require
from retrieval.knn import QUERY_BLOCK, flat_index, search_flat
from retrieval.rerank import NO_RERANK, Rerank
from retrieval.rerank import rerank as rerank_shortlist

FULL_RANKING_LIMIT = 10_000  # gallery size up to which mAP over the full ranking is computed by default
# FAISS k-means: 20 iterations (as pytorch-metric-learning runs it), the best of 5 seeded starts (one
# start splits even four far-apart classes wrongly now and then), every point used
KMEANS_SETTINGS = {
    "niter": 20,
    "nredo": 5,
    "verbose": False,
    "min_points_per_centroid": 1,
    "max_points_per_centroid": 1 << 30,
}


def recall_at_k(hits: np.ndarray, k: int) -> np.ndarray:
    """Per query: 1.0 when a relevant item is in the top k (hits: bool [Q, K])."""
    return hits[:, :k].any(axis=1).astype(np.float64)


def precision_at_k(hits: np.ndarray, k: int) -> np.ndarray:
    """Per query: the fraction of the top k that is relevant (k larger than the ranking counts as misses)."""
    return hits[:, :k].sum(axis=1) / k


def r_precision(hits: np.ndarray, relevant: np.ndarray) -> np.ndarray:
    """Per query: the fraction of relevant items among the top R (R = relevant count)."""
    ranks = np.arange(1, hits.shape[1] + 1)
    within_r = ranks[None, :] <= relevant[:, None]
    return (hits & within_r).sum(axis=1) / relevant


def map_at_r(hits: np.ndarray, relevant: np.ndarray) -> np.ndarray:
    """Per query: (1/R) * sum_{i<=R} precision@i * rel(i)."""
    ranks = np.arange(1, hits.shape[1] + 1)
    within_r = ranks[None, :] <= relevant[:, None]
    precision = np.cumsum(hits, axis=1) / ranks[None, :]
    return (precision * (hits & within_r)).sum(axis=1) / relevant


def average_precision(similarities: np.ndarray, relevant_mask: np.ndarray) -> np.ndarray:
    """Per query: average precision over the full ranking of similarities [Q, N] (excluded items at -inf)."""
    order = np.argsort(-similarities, axis=1, kind="stable")  # ties: the lower index first
    hits = np.take_along_axis(relevant_mask, order, axis=1)
    ranks = np.arange(1, hits.shape[1] + 1)
    return (np.cumsum(hits, axis=1) / ranks * hits).sum(axis=1) / np.maximum(hits.sum(axis=1), 1)


@dataclass
class QueryScores:
    """Per-query results of a retrieval evaluation, from which every averaged metric is computed.

    Only queries with at least one relevant gallery item are scored; `queries` holds their row
    numbers and every per-query array follows that order.
    """

    queries: np.ndarray  # row numbers of the scored queries
    values: dict[str, np.ndarray]  # metric name -> one value per scored query
    first_hit: np.ndarray  # 0-based rank of the first relevant item; at least max_k when none was found
    neighbours: np.ndarray  # [scored, max k] gallery rows, nearest first
    similarities: np.ndarray  # [scored, max k] their similarities
    skipped: int  # queries without any relevant item
    max_k: int
    leave_one_out: bool

    def summary(self) -> dict:
        """The averaged metrics, the CMC curve (recall@k for k = 1..max k) and the query counts."""
        result: dict = {name: float(values.mean()) for name, values in self.values.items()}
        first = np.bincount(np.minimum(self.first_hit, self.max_k), minlength=self.max_k + 1)[: self.max_k]
        result["cmc"] = [float(value) for value in first.cumsum() / len(self.queries)]
        result["num_queries"] = int(len(self.queries))
        result["num_skipped_queries"] = self.skipped
        result["protocol"] = "leave-one-out" if self.leave_one_out else "query-gallery"
        return result


def retrieval_metrics(query_embeddings: np.ndarray, query_labels: Sequence[str], *rest: Any, **options: Any) -> dict:
    """Returns recall@k and precision@k for each k, R-precision, MAP@R, mAP, the CMC curve and query counts.

    The arguments are those of score_queries (gallery embeddings and labels, ks, ...); this is its summary.
    """
    return score_queries(query_embeddings, query_labels, *rest, **options).summary()


def score_queries(
    query_embeddings: np.ndarray,
    query_labels: Sequence[str],
    gallery_embeddings: np.ndarray | None = None,
    gallery_labels: Sequence[str] | None = None,
    ks: Sequence[int] = (1, 5, 10),
    full_ranking: bool | None = None,
    rerank: Rerank = NO_RERANK,
    search: Ranking | None = None,
) -> QueryScores:
    """Scores every query: recall@k and precision@k for each k, R-precision, MAP@R, mAP and its nearest items.

    Without a gallery, the protocol is leave-one-out: every item queries all the others. mAP over the
    full ranking sorts every query's similarities to the whole gallery (about 1 ms per query for
    10,000 items here); by default (full_ranking=None) it is computed for galleries up to
    FULL_RANKING_LIMIT items and left out above, unless full_ranking=True. With a re-ranker
    (retrieval.rerank), every metric is of the re-ranked lists, as search returns them, and mAP over
    the full ranking is left out (only the shortlist is re-ranked). search replaces exact search
    (leave-one-out only): search(query rows, count) -> (gallery rows [Q, count], scores), -1 where
    a hit is no labeled gallery row, e.g. the lists of a deployed approximate index; mAP is left out.
    """
    _refuse_shapes(query_embeddings, query_labels, gallery_embeddings, gallery_labels, ks)
    leave_one_out = gallery_embeddings is None
    task = _Task(
        np.ascontiguousarray(query_embeddings, np.float32),
        np.ascontiguousarray(query_embeddings if leave_one_out else gallery_embeddings, np.float32),
        *_encode_labels(query_labels, query_labels if gallery_labels is None else gallery_labels),
        sorted(set(ks) | {1}),  # recall@1 always: the per-class figures and the worst queries are of it
        leave_one_out,
    )
    if full_ranking is None:
        full_ranking = len(task.gallery) <= FULL_RANKING_LIMIT and not rerank.active and search is None
    if search is None:
        exact = _Ranking(flat_index(task.gallery), task.gallery, task.count, rerank, leave_one_out)

        def search(rows: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray]:
            return exact(task.queries[rows], rows)

    blocks = [task.score(chosen, search, full_ranking) for chosen in _blocks(task.chosen)]
    return QueryScores(
        queries=task.chosen,
        values={name: np.concatenate([block.values[name] for block in blocks]) for name in blocks[0].values},
        first_hit=np.concatenate([block.first_hit for block in blocks]),
        neighbours=np.concatenate([block.neighbours for block in blocks]),
        similarities=np.concatenate([block.similarities for block in blocks]),
        skipped=int(len(task.query_codes) - len(task.chosen)),
        max_k=task.ks[-1],
        leave_one_out=leave_one_out,
    )


def require_ks(ks: Sequence[int]) -> None:
    """Refuses k values no scoring can use, before any image is embedded: one k rather than a list, text ("1,5" failed
    deep inside the scoring with a TypeError), values that are not whole numbers, and k below 1."""
    if isinstance(ks, (int, np.integer)):
        raise RetrievalError(f"ks: a list of k values, not one k; write [{ks}]")
    if isinstance(ks, (str, bytes)) or not isinstance(ks, Iterable):
        raise RetrievalError(f"ks={ks!r}: give a list of whole numbers, e.g. [1, 5, 10]")
    if not all(whole_number(k) for k in ks):
        raise RetrievalError(f"ks={list(ks)!r}: give a list of whole numbers, e.g. [1, 5, 10]")
    if any(k < 1 for k in ks):
        raise RetrievalError(f"k must be at least 1, got {sorted(ks)}")


def _refuse_shapes(
    queries: np.ndarray,
    query_labels: Sequence[str],
    gallery: np.ndarray | None,
    gallery_labels: Sequence[str] | None,
    ks: Sequence[int],
) -> None:
    """One line for arguments no scoring can use: one k rather than a list, k below 1, and a label count that is not
    the embeddings' row count (it failed in numpy's indexing, or scored the wrong rows)."""
    require_ks(ks)
    if (gallery is None) != (gallery_labels is None):
        raise RetrievalError("give the gallery's embeddings and its labels together, or neither (leave-one-out)")
    for what, vectors, labels in (("query", queries, query_labels), ("gallery", gallery, gallery_labels)):
        if vectors is not None and labels is not None and len(vectors) != len(labels):
            raise RetrievalError(f"{len(vectors)} {what} embeddings for {len(labels)} labels: give one label per row")


# search(query rows, count) -> (gallery rows [Q, count], scores [Q, count]), best first, -1 for no labeled row
Ranking = Callable[[np.ndarray, int], tuple[np.ndarray, np.ndarray]]


def _blocks(rows: np.ndarray) -> list[np.ndarray]:
    """rows in blocks of QUERY_BLOCK, so that memory stays bounded."""
    return [rows[start : start + QUERY_BLOCK] for start in range(0, len(rows), QUERY_BLOCK)]


@dataclass
class _Block:
    """The per-query scores of one block of queries."""

    values: dict[str, np.ndarray]
    first_hit: np.ndarray
    neighbours: np.ndarray
    similarities: np.ndarray


@dataclass
class _Task:
    """One evaluation: the queries and gallery with their label codes, the ks, and how many neighbours are ranked."""

    queries: np.ndarray
    gallery: np.ndarray
    query_codes: np.ndarray
    gallery_codes: np.ndarray
    ks: list[int]
    leave_one_out: bool

    def __post_init__(self) -> None:
        self.relevant, self.chosen = _relevant_counts(self.query_codes, self.gallery_codes, self.leave_one_out)
        # every relevant item of the query with the most, and at least the largest k, as far as the gallery goes
        last = len(self.gallery) - (1 if self.leave_one_out else 0)
        self.count = min(int(max(self.ks[-1], self.relevant.max())), last)

    def score(self, block: np.ndarray, search: Ranking, full_ranking: bool) -> _Block:
        """The scores of the queries in rows block, ranked by search."""
        neighbours, scores = search(block, self.count)
        hits = (neighbours >= 0) & (self.gallery_codes[neighbours] == self.query_codes[block, None])
        values = _block_values(hits, self.relevant[block], self.ks)
        if full_ranking:
            codes = self.query_codes[block]
            values["map"] = _full_ranking_map(
                self.queries[block], self.gallery, codes, self.gallery_codes, block, self.leave_one_out
            )
        shown = min(self.ks[-1], self.count)
        first_hit = np.where(hits.any(axis=1), hits.argmax(axis=1), max(self.count, self.ks[-1]))
        return _Block(values, first_hit, neighbours[:, :shown], scores[:, :shown])


class _Ranking:
    """Each query's `count` nearest gallery rows by exact search, re-ranked over a shortlist when asked."""

    def __init__(self, index: object, gallery: np.ndarray, count: int, rerank: Rerank, leave_one_out: bool) -> None:
        self.index, self.gallery, self.count = index, gallery, count
        self.rerank, self.leave_one_out = rerank, leave_one_out
        total = len(gallery) - (1 if leave_one_out else 0)
        self.fetched = min(max(count, rerank.shortlist), total) if rerank.active else count

    def __call__(self, queries: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        own = rows if self.leave_one_out else None
        ids, scores = search_flat(self.index, queries, self.fetched, own)
        if not self.rerank.active:
            return ids, scores
        ids, scores = rerank_shortlist(self.rerank, queries, ids, scores, self.vectors, self.neighbours, own)
        return ids[:, : self.count], scores[:, : self.count]

    def vectors(self, ids: np.ndarray) -> np.ndarray:
        return self.gallery[ids]

    def neighbours(self, ids: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Each gallery row's n nearest other gallery rows (for database-side augmentation)."""
        return search_flat(self.index, self.gallery[ids], n, ids)


def _relevant_counts(
    query_codes: np.ndarray, gallery_codes: np.ndarray, leave_one_out: bool
) -> tuple[np.ndarray, np.ndarray]:
    """Each query's number of relevant gallery items, and the rows of the queries that have any."""
    counts = np.bincount(
        gallery_codes, minlength=int(max(query_codes.max(initial=0), gallery_codes.max(initial=0))) + 1
    )
    relevant = counts[query_codes] - (1 if leave_one_out else 0)
    chosen = np.flatnonzero(relevant > 0)
    if not len(chosen):
        raise RetrievalError(
            "no query has a relevant item in the gallery: every label needs "
            "at least two images (leave-one-out) or a match in the gallery"
        )
    return relevant, chosen


def _block_values(hits: np.ndarray, relevant: np.ndarray, ks: Sequence[int]) -> dict[str, np.ndarray]:
    """Per query of a block: recall@k and precision@k for each k, R-precision and MAP@R from its hit matrix."""
    values = {f"recall@{k}": recall_at_k(hits, k) for k in ks}
    values.update({f"precision@{k}": precision_at_k(hits, k) for k in ks})
    values["r_precision"] = r_precision(hits, relevant)
    values["map@r"] = map_at_r(hits, relevant)
    return values


def _full_ranking_map(
    queries: np.ndarray,
    gallery: np.ndarray,
    query_codes: np.ndarray,
    gallery_codes: np.ndarray,
    rows: np.ndarray,
    leave_one_out: bool,
) -> np.ndarray:
    """Per query: average precision over the whole gallery; in leave-one-out its own item (rows) last, not relevant."""
    similarities = queries @ gallery.T
    mask = gallery_codes[None, :] == query_codes[:, None]
    if leave_one_out:
        similarities[np.arange(len(rows)), rows] = -np.inf
        mask[np.arange(len(rows)), rows] = False
    return average_precision(similarities, mask)


def clustering_metrics(
    embeddings: np.ndarray, labels: Sequence[str], seed: int = 0, kmeans: object = None
) -> dict[str, float]:
    """NMI and AMI between the labels and a k-means clustering of the embeddings into as many clusters.

    k-means is FAISS's (KMEANS_SETTINGS: 20 iterations, best of 5 seeded starts); NMI is the
    arithmetic-mean normalisation, as in scikit-learn and pytorch-metric-learning.
    kmeans(embeddings, k) -> cluster ids may replace it.
    """
    # imported here: slow to import
    from sklearn.metrics import adjusted_mutual_info_score, normalized_mutual_info_score

    vectors = np.ascontiguousarray(embeddings, np.float32)
    codes = np.unique(np.asarray(labels), return_inverse=True)[1]
    clusters = int(codes.max()) + 1
    if clusters < 2 or len(vectors) < clusters:
        raise RetrievalError(
            "clustering metrics need at least two classes and as many "
            f"embeddings as classes, got {clusters} and {len(vectors)}"
        )
    assignment = faiss_kmeans(vectors, clusters, seed) if kmeans is None else kmeans(vectors, clusters)  # type: ignore[operator]
    return {
        "nmi": float(normalized_mutual_info_score(codes, assignment)),
        "ami": float(adjusted_mutual_info_score(codes, assignment)),
    }


def faiss_kmeans(vectors: np.ndarray, clusters: int, seed: int = 0) -> np.ndarray:
    """Cluster ids of FAISS k-means on the rows of vectors (KMEANS_SETTINGS, seeded)."""
    faiss = require("faiss", "cpu")
    vectors = np.ascontiguousarray(vectors, np.float32)
    kmeans = faiss.Kmeans(vectors.shape[1], clusters, **KMEANS_SETTINGS, seed=seed)
    kmeans.train(vectors)
    return kmeans.index.search(vectors, 1)[1][:, 0]


def _encode_labels(query_labels: Sequence[str], gallery_labels: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    vocabulary = {label: code for code, label in enumerate(sorted(set(query_labels) | set(gallery_labels)))}
    return (
        np.array([vocabulary[label] for label in query_labels], np.int64),
        np.array([vocabulary[label] for label in gallery_labels], np.int64),
    )


def embedding_diagnostics(
    embeddings: np.ndarray, labels: Sequence[str], max_points: int = 10_000, seed: int = 0, block: int = 1024
) -> dict[str, float]:
    """Returns alignment, uniformity (Wang & Isola 2020) and tolerance (Wang & Liu 2021) of unit embeddings.

    - alignment = mean over same-label pairs of ||x - y||^2 = 2 - 2 * tolerance (lower: positives closer);
    - uniformity = log mean over all distinct pairs of exp(-2 ||x - y||^2) (lower: more spread out);
    - tolerance = mean over same-label pairs of x.y (higher: classes kept together).

    Tolerance and alignment use every row: the sum of x.y over the same-label pairs of a class is
    ||sum of its rows||^2 minus the sum of the rows' squared norms. Uniformity needs every pair, so
    with more than max_points rows it uses a seeded random subset of max_points rows, in row blocks.
    """
    z = np.asarray(embeddings, np.float64)
    codes = np.unique(np.asarray(labels), return_inverse=True)[1]
    result = {"uniformity": uniformity(z, max_points, seed, block)}
    class_sizes = np.bincount(codes)
    pairs = float((class_sizes * (class_sizes - 1)).sum())  # ordered same-label pairs
    if pairs:
        class_sums = np.zeros((len(class_sizes), z.shape[1]))
        np.add.at(class_sums, codes, z)
        tolerance = (float((class_sums**2).sum()) - float((z**2).sum())) / pairs
        result["alignment"] = 2.0 - 2.0 * tolerance
        result["tolerance"] = tolerance
    return result


def uniformity(embeddings: np.ndarray, max_points: int = 10_000, seed: int = 0, block: int = 1024) -> float:
    """Uniformity (Wang & Isola 2020) of unit embeddings: log mean exp(-2 ||x - y||^2) over distinct pairs, of a
    seeded random subset of max_points rows when there are more."""
    z = np.asarray(embeddings, np.float64)
    if len(z) < 2:
        raise RetrievalError("embedding diagnostics need at least two embeddings")
    if len(z) > max_points:
        z = z[np.sort(np.random.default_rng(seed).choice(len(z), max_points, replace=False))]
    return _uniformity(z, block)


def _uniformity(z: np.ndarray, block: int) -> float:
    """log of the mean of exp(-2 ||x - y||^2) = exp(4 x.y - 4) over the distinct pairs of unit rows."""
    total = 0.0
    for start in range(0, len(z), block):
        rows = np.arange(start, min(start + block, len(z)))
        terms = np.exp(4.0 * np.minimum(z[rows] @ z.T, 1.0) - 4.0)
        terms[np.arange(len(rows)), rows] = 0.0  # a row and itself is not a pair
        total += float(terms.sum())
    return float(np.log(total / (len(z) * (len(z) - 1))))
