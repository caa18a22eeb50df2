"""Retrieval metrics of metric learning, as pure functions of embeddings and labels.

Definitions (Musgrave et al. 2020, "A Metric Learning Reality Check"): for a query with R relevant
gallery items (same label, itself excluded),

- recall@k = 1 if at least one relevant item is among the k nearest neighbours, else 0;
- R-precision = (relevant items among the R nearest) / R;
- MAP@R = (1/R) * sum_{i=1..R} P(i) * rel(i), where P(i) is the precision of the top i.

Each is averaged over the queries that have at least one relevant item; the others are counted in
`num_skipped_queries`. Neighbours are ranked by inner product (cosine for unit rows), ties broken by
the lower gallery index.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from retrieval.errors import RetrievalError


def nearest_neighbours(queries: np.ndarray, gallery: np.ndarray, k: int, exclude_self: bool = False, block: int = 1024) -> tuple[np.ndarray, np.ndarray]:
    """Returns (indices [Q, k], similarities [Q, k]) of the k most similar gallery rows by inner product.

    With exclude_self, query i is gallery item i (leave-one-out) and is never its own neighbour.
    """
    queries = np.asarray(queries, np.float32)
    gallery = np.asarray(gallery, np.float32)
    k = min(k, len(gallery) - (1 if exclude_self else 0))
    indices = np.zeros((len(queries), k), np.int64)
    scores = np.zeros((len(queries), k), np.float32)
    for start in range(0, len(queries), block):
        sims = queries[start : start + block] @ gallery.T
        if exclude_self:
            rows = np.arange(len(sims))
            sims[rows, start + rows] = -np.inf
        order = np.argsort(-sims, axis=1, kind="stable")[:, :k]
        indices[start : start + block] = order
        scores[start : start + block] = np.take_along_axis(sims, order, axis=1)
    return indices, scores


def recall_at_k(hits: np.ndarray, k: int) -> float:
    """Fraction of queries with at least one relevant item in their top k (hits: bool [Q, K])."""
    return float(hits[:, :k].any(axis=1).mean())


def r_precision(hits: np.ndarray, relevant: np.ndarray) -> float:
    """Mean over queries of the fraction of relevant items among the top R (R = relevant count)."""
    ranks = np.arange(1, hits.shape[1] + 1)
    within_r = ranks[None, :] <= relevant[:, None]
    return float(((hits & within_r).sum(axis=1) / relevant).mean())


def map_at_r(hits: np.ndarray, relevant: np.ndarray) -> float:
    """Mean over queries of (1/R) * sum_{i<=R} precision@i * rel(i)."""
    ranks = np.arange(1, hits.shape[1] + 1)
    within_r = ranks[None, :] <= relevant[:, None]
    precision = np.cumsum(hits, axis=1) / ranks[None, :]
    return float(((precision * (hits & within_r)).sum(axis=1) / relevant).mean())


def retrieval_metrics(
    query_embeddings: np.ndarray,
    query_labels: Sequence[str],
    gallery_embeddings: np.ndarray | None = None,
    gallery_labels: Sequence[str] | None = None,
    ks: Sequence[int] = (1, 5, 10),
) -> dict[str, float | int | str]:
    """Returns recall@k for each k, R-precision, MAP@R and query counts.

    Without a gallery, the protocol is leave-one-out: every item queries all the others.
    """
    leave_one_out = gallery_embeddings is None
    if leave_one_out:
        gallery_embeddings, gallery_labels = query_embeddings, query_labels
    assert gallery_labels is not None
    if any(k < 1 for k in ks):
        raise RetrievalError(f"k must be at least 1, got {sorted(ks)}")
    query_codes, gallery_codes = _encode_labels(query_labels, gallery_labels)
    counts = np.bincount(gallery_codes, minlength=int(max(query_codes.max(initial=0), gallery_codes.max(initial=0))) + 1)
    relevant = counts[query_codes] - (1 if leave_one_out else 0)
    answerable = relevant > 0
    if not answerable.any():
        raise RetrievalError("no query has a relevant item in the gallery: every label needs at least two images (leave-one-out) or a match in the gallery")
    depth = int(max(max(ks), relevant.max()))
    chosen = np.flatnonzero(answerable)
    if leave_one_out:
        # leave-one-out needs the query's own row at its index: embed all, keep answerable queries
        neighbours, _ = nearest_neighbours(query_embeddings, gallery_embeddings, depth, exclude_self=True)
        neighbours = neighbours[chosen]
    else:
        neighbours, _ = nearest_neighbours(np.asarray(query_embeddings)[chosen], gallery_embeddings, depth)
    hits = gallery_codes[neighbours] == query_codes[chosen, None]
    relevant = relevant[chosen]
    result: dict[str, float | int | str] = {f"recall@{k}": recall_at_k(hits, k) for k in sorted(set(ks))}
    result["r_precision"] = r_precision(hits, relevant)
    result["map@r"] = map_at_r(hits, relevant)
    result["num_queries"] = int(len(chosen))
    result["num_skipped_queries"] = int(len(query_codes) - len(chosen))
    result["protocol"] = "leave-one-out" if leave_one_out else "query-gallery"
    return result


def _encode_labels(query_labels: Sequence[str], gallery_labels: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    vocabulary = {label: code for code, label in enumerate(sorted(set(query_labels) | set(gallery_labels)))}
    return (np.array([vocabulary[label] for label in query_labels], np.int64), np.array([vocabulary[label] for label in gallery_labels], np.int64))


def embedding_diagnostics(embeddings: np.ndarray, labels: Sequence[str], max_points: int = 10_000, seed: int = 0) -> dict[str, float]:
    """Returns alignment, uniformity (Wang & Isola 2020) and tolerance (Wang & Liu 2021) of unit embeddings.

    - alignment = mean over same-label pairs of ||x - y||^2 (lower: positives closer);
    - uniformity = log mean over all distinct pairs of exp(-2 ||x - y||^2) (lower: more spread out);
    - tolerance = mean over same-label pairs of x.y (higher: classes kept together).

    With more than max_points rows, a seeded random subset of max_points rows is used.
    """
    z = np.asarray(embeddings, np.float64)
    codes = np.unique(np.asarray(labels), return_inverse=True)[1]
    if len(z) > max_points:
        keep = np.sort(np.random.default_rng(seed).choice(len(z), max_points, replace=False))
        z, codes = z[keep], codes[keep]
    n = len(z)
    if n < 2:
        raise RetrievalError("embedding diagnostics need at least two embeddings")
    similarity = np.clip(z @ z.T, -1.0, 1.0)
    distinct = ~np.eye(n, dtype=bool)
    same = (codes[:, None] == codes[None, :]) & distinct
    squared = 2.0 - 2.0 * similarity[distinct]
    result = {"uniformity": float(np.log(np.mean(np.exp(-2.0 * squared))))}
    if same.any():
        result["alignment"] = float(np.mean(2.0 - 2.0 * similarity[same]))
        result["tolerance"] = float(np.mean(similarity[same]))
    return result
