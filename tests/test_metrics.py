"""Retrieval metrics on hand-computed cases and against pytorch-metric-learning."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pytorch_metric_learning.utils.accuracy_calculator import AccuracyCalculator

from retrieval.errors import RetrievalError
from retrieval.metrics import nearest_neighbours, retrieval_metrics


def ranked_gallery(order: list[int]) -> np.ndarray:
    """Unit vectors whose similarity to [1, 0] falls with the position of each index in order."""
    angles = np.zeros(len(order))
    for rank, index in enumerate(order):
        angles[index] = 0.1 * rank
    return np.stack([np.cos(angles), np.sin(angles)], axis=1).astype(np.float32)


def test_query_gallery_case_by_hand() -> None:
    gallery = ranked_gallery([1, 0, 3, 2, 4])  # ranking by similarity: b a b a b
    metrics = retrieval_metrics(np.array([[1.0, 0.0]], np.float32), ["a"], gallery, ["a", "b", "a", "b", "b"], ks=(1, 2, 4))
    assert metrics["recall@1"] == 0.0
    assert metrics["recall@2"] == 1.0
    assert metrics["r_precision"] == 0.5  # R = 2: one of the top 2 is relevant
    assert metrics["map@r"] == pytest.approx(0.25)  # (1/2) * (P(2) = 1/2)
    assert metrics["protocol"] == "query-gallery"


def test_leave_one_out_excludes_the_query_and_counts_singletons() -> None:
    embeddings = np.array([[1, 0], [0.9, 0.1], [0, 1], [0.1, 0.9], [0.7, 0.7]], np.float32)
    embeddings /= np.linalg.norm(embeddings, axis=1, keepdims=True)
    metrics = retrieval_metrics(embeddings, ["a", "a", "b", "b", "lonely"], ks=(1,))
    assert metrics["num_queries"] == 4 and metrics["num_skipped_queries"] == 1
    assert metrics["recall@1"] == 1.0 and metrics["map@r"] == 1.0


def test_map_at_r_with_several_relevant_items() -> None:
    # query "a" has R = 3 relevant items; ranking: a x a x a -> hits at ranks 1 and 3 within R
    gallery = ranked_gallery([0, 1, 2, 3, 4])
    metrics = retrieval_metrics(np.array([[1.0, 0.0]], np.float32), ["a"], gallery, ["a", "x", "a", "x", "a"], ks=(1,))
    assert metrics["r_precision"] == pytest.approx(2 / 3)
    assert metrics["map@r"] == pytest.approx((1 / 3) * (1 / 1 + 2 / 3))


def test_ties_are_broken_by_the_lower_gallery_index() -> None:
    gallery = np.array([[0, 1], [1, 0], [1, 0], [1, 0]], np.float32)
    indices, scores = nearest_neighbours(np.array([[1, 0]], np.float32), gallery, 3)
    assert indices.tolist() == [[1, 2, 3]]
    assert scores.tolist() == [[1.0, 1.0, 1.0]]


def test_k_larger_than_the_gallery() -> None:
    gallery = ranked_gallery([1, 0, 2])
    metrics = retrieval_metrics(np.array([[1.0, 0.0]], np.float32), ["a"], gallery, ["a", "b", "b"], ks=(1, 10))
    assert metrics["recall@1"] == 0.0 and metrics["recall@10"] == 1.0


def test_nothing_to_retrieve_is_an_error() -> None:
    with pytest.raises(RetrievalError, match="no query has a relevant item"):
        retrieval_metrics(np.eye(3, dtype=np.float32), ["a", "b", "c"])


def clustered(seed: int, n: int = 300, classes: int = 12, dim: int = 16) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, classes, n)
    centres = rng.standard_normal((classes, dim))
    embeddings = centres[labels] + 0.9 * rng.standard_normal((n, dim))
    return (embeddings / np.linalg.norm(embeddings, axis=1, keepdims=True)).astype(np.float32), labels


@pytest.mark.parametrize("seed", [0, 1])
def test_agrees_with_pytorch_metric_learning_leave_one_out(seed: int) -> None:
    embeddings, labels = clustered(seed)
    ours = retrieval_metrics(embeddings, [str(label) for label in labels])
    calculator = AccuracyCalculator(include=("precision_at_1", "r_precision", "mean_average_precision_at_r"), device=torch.device("cpu"))
    theirs = calculator.get_accuracy(torch.from_numpy(embeddings), torch.from_numpy(labels))
    assert ours["recall@1"] == pytest.approx(theirs["precision_at_1"], abs=1e-6)
    assert ours["r_precision"] == pytest.approx(theirs["r_precision"], abs=1e-6)
    assert ours["map@r"] == pytest.approx(theirs["mean_average_precision_at_r"], abs=1e-6)


def test_agrees_with_pytorch_metric_learning_query_gallery() -> None:
    embeddings, labels = clustered(2)
    queries, gallery = embeddings[:100], embeddings[100:]
    ours = retrieval_metrics(queries, [str(x) for x in labels[:100]], gallery, [str(x) for x in labels[100:]])
    calculator = AccuracyCalculator(include=("precision_at_1", "r_precision", "mean_average_precision_at_r"), device=torch.device("cpu"))
    theirs = calculator.get_accuracy(torch.from_numpy(queries), torch.from_numpy(labels[:100]), torch.from_numpy(gallery), torch.from_numpy(labels[100:]))
    assert ours["recall@1"] == pytest.approx(theirs["precision_at_1"], abs=1e-6)
    assert ours["r_precision"] == pytest.approx(theirs["r_precision"], abs=1e-6)
    assert ours["map@r"] == pytest.approx(theirs["mean_average_precision_at_r"], abs=1e-6)


def test_embedding_diagnostics_by_hand() -> None:
    from retrieval.metrics import embedding_diagnostics

    z = np.array([[1, 0], [0, 1], [-1, 0], [0, -1]], np.float32)  # a square on the circle
    result = embedding_diagnostics(z, ["a", "a", "b", "b"])
    assert result["tolerance"] == pytest.approx(0.0)  # each same-label pair is orthogonal
    assert result["alignment"] == pytest.approx(2.0)  # ||x - y||^2 = 2 for orthogonal unit vectors
    # distinct pairs: 8 at squared distance 2, 4 at 4
    assert result["uniformity"] == pytest.approx(np.log((8 * np.exp(-4) + 4 * np.exp(-8)) / 12))
    collapsed = embedding_diagnostics(np.tile([[1.0, 0.0]], (4, 1)), ["a", "a", "b", "b"])
    assert collapsed["uniformity"] == pytest.approx(0.0) and collapsed["tolerance"] == pytest.approx(1.0)
    assert "alignment" not in embedding_diagnostics(z, ["a", "b", "c", "d"])  # no same-label pairs
