"""Evaluation of an embedder on labeled collections, with the metrics of retrieval.metrics.

Protocols: leave-one-out within one collection (the default), leave-one-out on a class-disjoint
held-out part of it (split_classes), or a separate query set against a gallery (the In-Shop protocol).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from retrieval.data import Collection, Skipped, split_by_class
from retrieval.embedders import Embedder, embed_items
from retrieval.errors import RetrievalError
from retrieval.metrics import clustering_metrics, embedding_diagnostics, retrieval_metrics


@dataclass
class Evaluation:
    """Metrics of one embedder on one protocol, the embeddings they came from, and the files left out."""

    metrics: dict
    skipped: list[Skipped]
    vectors: np.ndarray  # the query embeddings (leave-one-out: all of them)
    labels: list[str]


def _embed_labeled(embedder: Embedder, collection: Collection, progress: bool) -> tuple[np.ndarray, list[str], list[Skipped]]:
    """Embeds the labeled items of a collection; unlabeled and unreadable ones are returned as skipped."""
    labeled = [item for item in collection.items if item.label]
    skipped = collection.skipped + [Skipped(item.path, "no label") for item in collection.items if not item.label]
    if not labeled:
        raise RetrievalError(f"{collection.source}: no labeled image (ROOT/<label>/<image> or a CSV with labels)")
    embedded = embed_items(embedder, labeled, progress=progress)
    return embedded.vectors, [item.label for item in embedded.items], skipped + embedded.skipped


def evaluate_collection(
    embedder: Embedder, collection: Collection, ks: Sequence[int] = (1, 5, 10), progress: bool = True, split_classes: float = 0.0, seed: int = 0
) -> Evaluation:
    """Scores leave-one-out retrieval over a labeled collection (or over a seeded held-out fraction of its
    classes), with NMI/AMI and the embedding diagnostics."""
    protocol = "leave-one-out"
    if split_classes:
        labeled = [item for item in collection.items if item.label]
        _, held_out = split_by_class(labeled, split_classes, seed)
        protocol = f"leave-one-out on {split_classes:g} of the classes (seed {seed})"
        collection = replace(collection, items=held_out)
    if len({item.label for item in collection.items if item.label}) < 2:
        raise RetrievalError(f"{collection.source}: evaluation needs at least two labeled classes (ROOT/<label>/<image> or a CSV with labels)")
    vectors, labels, skipped = _embed_labeled(embedder, collection, progress)
    if len(set(labels)) < 2:
        raise RetrievalError(f"{collection.source}: fewer than two classes have readable images")
    metrics = retrieval_metrics(vectors, labels, ks=ks)
    metrics.update(clustering_metrics(vectors, labels))
    metrics.update(embedding_diagnostics(vectors, labels))
    metrics.update({"protocol": protocol, "images": str(collection.source), "encoder": embedder.fingerprint})
    return Evaluation(metrics, skipped, vectors, labels)


def evaluate_query_gallery(embedder: Embedder, queries: Collection, gallery: Collection, ks: Sequence[int] = (1, 5, 10), progress: bool = True) -> Evaluation:
    """Scores each query against a separate gallery (neither contains the other's items)."""
    query_vectors, query_labels, skipped = _embed_labeled(embedder, queries, progress)
    gallery_vectors, gallery_labels, gallery_skipped = _embed_labeled(embedder, gallery, progress)
    metrics = retrieval_metrics(query_vectors, query_labels, gallery_vectors, gallery_labels, ks=ks)
    if len(set(query_labels)) >= 2:
        metrics.update(clustering_metrics(query_vectors, query_labels))
        metrics.update(embedding_diagnostics(query_vectors, query_labels))
    metrics.update({"queries": str(queries.source), "gallery": str(gallery.source), "encoder": embedder.fingerprint})
    return Evaluation(metrics, skipped + gallery_skipped, query_vectors, query_labels)
