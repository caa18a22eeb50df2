"""What an index holds and how well it searches: count, type, parameters, memory, measured recall@10."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from index.backends import open_index
from index.search import deployed_ranking
from index.tuning import leave_out, recall_at_10
from index.types import GalleryBackend, IndexFacts
from retrieval.copies import copy_figures
from retrieval.embedders import Embedder, require_embedder
from retrieval.errors import RetrievalError
from retrieval.evaluation import Evaluation, evaluate_embedded
from retrieval.knn import nearest_neighbours
from retrieval.metrics import uniformity
from retrieval.rerank import NO_RERANK, Rerank


@dataclass(frozen=True)
class IndexStats:
    """What `retrieval index-stats` reports: the backend's facts and the figures measured now (None where not
    measured): recall@10 of the index for recall_queries of its own vectors against exact search, the uniformity of
    its stored vectors, and for an index without labels, with its encoder, the figures of augmented copies."""

    facts: IndexFacts
    recall_now: float | None = None
    recall_queries: int = 0
    uniformity: float | None = None
    copy_recall_at_1: float | None = None
    copy_alignment: float | None = None

    def to_dict(self) -> dict:
        """As JSON values (the facts as an object of their own)."""
        return asdict(self)


def index_stats(
    directory: Path, sample: int = 1000, mmap: bool = False, seed: int = 0, embedder: Embedder | None = None
) -> IndexStats:
    """The backend's facts (the manifest's, the sizes on disk) and recall@10 against exact search.

    Two recalls: the one tuned at build time, for gallery vectors held out of the index, and one
    measured now: a seeded sample of the index's own vectors (those it stores, or for compressed
    types the exact ones kept for re-ranking) queries the index as searches do and, exactly, all of
    them, each left out of its own results (for a graph an upper bound: its own node leads to its
    neighbours). Compressed codes forced without the exact vectors have only the first. Also the
    uniformity of the stored vectors and, for an index without labels and with its encoder given,
    the figures of augmented copies of a sample of its images (retrieval.copies).
    """
    embedder = None if embedder is None else require_embedder(embedder)
    index = open_index(directory, mmap=mmap)
    measured: dict = {}
    stored = index.stored()
    if stored is not None:
        measured.update(_measured_recall(index, *stored, sample, seed))
        measured["uniformity"] = uniformity(stored[1], sample, seed)
    items = index.items()
    own = embedder is not None and embedder.fingerprint == index.encoder_sha256  # the encoder that built it
    if own and len({item.label for item in items.values() if item.label}) < 2:
        figures = copy_figures(embedder, list(items.values()), sample, seed, progress=False).metrics  # type: ignore[arg-type]
        measured.update(copy_recall_at_1=figures["copy recall@1"], copy_alignment=figures["alignment"])
    return IndexStats(index.facts(), **measured)


def _measured_recall(index: GalleryBackend, ids: np.ndarray, vectors: np.ndarray, sample: int, seed: int) -> dict:
    """recall@10 of the index for a seeded sample of its own vectors, against exact search over all of them, with the
    number of those queries (IndexStats' recall_now and recall_queries).

    Each sample vector's own row is left out of both lists: it would find itself, a tenth of recall@10 for free.
    """
    chosen = np.random.default_rng(seed).choice(len(ids), min(sample, len(ids)), replace=False)
    k, own = min(10, len(ids) - 1), ids[chosen]
    if k < 1:
        return {}
    exact = leave_out(ids[nearest_neighbours(vectors[chosen], vectors, k + 1)[0]], own, k)
    found = leave_out(index.search_arrays(vectors[chosen], k + 1).ids, own, k)
    return {"recall_now": recall_at_10(found, exact), "recall_queries": len(chosen)}


@dataclass(frozen=True)
class IndexEvaluation:
    """Leave-one-out metrics of an index's labeled items, ranked exactly and as the deployed index searches."""

    exact: Evaluation
    deployed: Evaluation


def exact_and_deployed(
    index: GalleryBackend, rerank: Rerank = NO_RERANK, ks: Sequence[int] = (1, 5, 10)
) -> IndexEvaluation:
    """Leave-one-out metrics over the index's labeled items, with exact search and with the index's own search.

    Both rank the same stored vectors (for compressed types, the exact ones kept for re-ranking): the
    first exactly, the second as the deployed index searches (its type, tuned depth and re-scoring of
    compressed codes, and the re-ranker), so that the gap is what the approximate index costs.
    """
    labeled = [(item_id, item) for item_id, item in sorted(index.items().items()) if item.label]
    if len({item.label for _, item in labeled}) < 2:
        raise RetrievalError(
            f"{index.directory}: evaluation needs labeled items of at least two labels; index a labeled folder or CSV"
        )
    ids = [item_id for item_id, _ in labeled]
    vectors, items = index.vectors_of(ids), [item for _, item in labeled]
    described = {
        "protocol": "leave-one-out over the index's labeled items",
        "images": str(index.directory),
        "encoder": index.encoder_sha256,
    }
    exact = evaluate_embedded(vectors, items, [], {**described, "search": "exact"}, ks, rerank)
    searched = index.manifest.describe_search()
    deployed = evaluate_embedded(
        vectors, items, [], {**described, "search": searched}, ks, rerank, search=deployed_ranking(index, ids, rerank)
    )
    return IndexEvaluation(exact, deployed)
