"""Evaluation of an embedder on a labeled collection, with the metrics of retrieval.metrics."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from retrieval.data import Collection, Skipped
from retrieval.embedders import Embedder, embed_items
from retrieval.errors import RetrievalError
from retrieval.metrics import clustering_metrics, embedding_diagnostics, retrieval_metrics


@dataclass
class Evaluation:
    """Metrics of one embedder on one collection, and the files left out."""

    metrics: dict
    skipped: list[Skipped]


def evaluate_collection(embedder: Embedder, collection: Collection, ks: Sequence[int] = (1, 5, 10), progress: bool = True) -> Evaluation:
    """Embeds a labeled collection and scores leave-one-out retrieval over it, with NMI/AMI and the embedding diagnostics."""
    labeled = [item for item in collection.items if item.label]
    unlabeled = [Skipped(item.path, "no label") for item in collection.items if not item.label]
    if len({item.label for item in labeled}) < 2:
        raise RetrievalError(f"{collection.source}: evaluation needs at least two labeled classes (ROOT/<label>/<image> or a CSV with labels)")
    embedded = embed_items(embedder, labeled, progress=progress)
    if len({item.label for item in embedded.items}) < 2:
        raise RetrievalError(f"{collection.source}: fewer than two classes have readable images")
    labels = [item.label for item in embedded.items]
    metrics = retrieval_metrics(embedded.vectors, labels, ks=ks)
    metrics.update(clustering_metrics(embedded.vectors, labels))
    metrics.update(embedding_diagnostics(embedded.vectors, labels))
    metrics["images"] = str(collection.source)
    metrics["encoder"] = embedder.fingerprint
    return Evaluation(metrics, collection.skipped + unlabeled + embedded.skipped)
