"""Retrieval metrics on hand-computed cases and against pytorch-metric-learning."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pytorch_metric_learning.utils.accuracy_calculator import AccuracyCalculator

from retrieval.errors import RetrievalError
from retrieval.knn import nearest_neighbours
from retrieval.metrics import retrieval_metrics


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


def test_precision_map_and_cmc_by_hand() -> None:
    gallery = ranked_gallery([1, 0, 3, 2, 4])  # ranking: b a b a b; the query's R = 2 relevant at ranks 2 and 4
    metrics = retrieval_metrics(np.array([[1.0, 0.0]], np.float32), ["a"], gallery, ["a", "b", "a", "b", "b"], ks=(1, 2, 4, 8))
    assert (metrics["precision@1"], metrics["precision@2"], metrics["precision@4"]) == (0.0, 0.5, 0.5)
    assert metrics["precision@8"] == pytest.approx(2 / 8)  # k beyond the gallery counts as misses
    assert metrics["map"] == pytest.approx((1 / 2 + 2 / 4) / 2)
    assert metrics["cmc"] == [0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]


def test_self_match_is_removed_by_identity_not_by_distance() -> None:
    twins = np.array([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.0, 1.0]], np.float32)  # items 0 and 1 are identical
    indices, _ = nearest_neighbours(twins, twins, 2, exclude_self=True)
    assert indices[:, 0].tolist() == [1, 0, 3, 2]
    metrics = retrieval_metrics(twins, ["a", "b", "a", "b"], ks=(1,))
    assert metrics["recall@1"] == 0.0  # each item's twin has the other label


def test_query_blocks_do_not_change_the_result(monkeypatch: pytest.MonkeyPatch) -> None:
    import retrieval.metrics as metrics_module

    embeddings, labels = clustered(4)
    whole = retrieval_metrics(embeddings, [str(x) for x in labels])
    monkeypatch.setattr(metrics_module, "QUERY_BLOCK", 7)
    blocked = retrieval_metrics(embeddings, [str(x) for x in labels])
    assert blocked.keys() == whole.keys() and blocked["cmc"] == pytest.approx(whole["cmc"])
    assert all(blocked[name] == pytest.approx(whole[name]) for name in whole if name not in ("cmc", "protocol"))


def test_full_ranking_map_matches_a_brute_force_sort() -> None:
    embeddings, labels = clustered(5, n=120)
    ours = retrieval_metrics(embeddings, [str(x) for x in labels])["map"]
    precisions = []
    for i in range(len(embeddings)):
        others = [j for j in range(len(embeddings)) if j != i]
        ranked = sorted(others, key=lambda j: (-float(embeddings[i] @ embeddings[j]), j))
        hits = [labels[j] == labels[i] for j in ranked]
        if any(hits):
            found = np.cumsum(hits)
            precisions.append(np.mean([found[r] / (r + 1) for r, hit in enumerate(hits) if hit]))
    assert ours == pytest.approx(np.mean(precisions), abs=1e-9)


@pytest.mark.parametrize("setting", ["leave-one-out", "query-gallery"])
def test_nmi_ami_and_precision_agree_with_the_accuracy_calculator(setting: str) -> None:
    from pytorch_metric_learning.utils.inference import FaissKMeans

    from retrieval.metrics import KMEANS_SETTINGS, clustering_metrics

    embeddings, labels = clustered(6, n=400)
    calculator = AccuracyCalculator(
        include=("precision_at_1", "r_precision", "mean_average_precision_at_r", "NMI", "AMI"),
        device=torch.device("cpu"),
        kmeans_func=FaissKMeans(**KMEANS_SETTINGS, seed=0),  # their k-means, given our settings
    )
    if setting == "leave-one-out":
        ours = retrieval_metrics(embeddings, [str(x) for x in labels])
        theirs = calculator.get_accuracy(torch.from_numpy(embeddings), torch.from_numpy(labels))
        clustered_on, clustered_labels = embeddings, labels
    else:
        ours = retrieval_metrics(embeddings[:150], [str(x) for x in labels[:150]], embeddings[150:], [str(x) for x in labels[150:]])
        theirs = calculator.get_accuracy(torch.from_numpy(embeddings[:150]), torch.from_numpy(labels[:150]), torch.from_numpy(embeddings[150:]), torch.from_numpy(labels[150:]))
        clustered_on, clustered_labels = embeddings[:150], labels[:150]  # PML clusters the queries
    ours.update(clustering_metrics(clustered_on, [str(x) for x in clustered_labels]))
    for mine, pml in (("precision@1", "precision_at_1"), ("r_precision", "r_precision"), ("map@r", "mean_average_precision_at_r"), ("nmi", "NMI"), ("ami", "AMI")):
        assert ours[mine] == pytest.approx(theirs[pml], abs=1e-6), mine


def test_clustering_metrics_by_hand() -> None:
    from retrieval.metrics import clustering_metrics

    separated = np.repeat(np.eye(4, dtype=np.float32), 5, axis=0)  # four tight, far-apart classes
    labels = [str(i) for i in np.repeat(np.arange(4), 5)]
    assert clustering_metrics(separated, labels) == pytest.approx({"nmi": 1.0, "ami": 1.0})
    opposite = clustering_metrics(separated, labels, kmeans=lambda x, k: np.arange(len(x)) % k)  # clusters across the classes
    assert opposite["ami"] < 0.05
    with pytest.raises(RetrievalError, match="at least two classes"):
        clustering_metrics(separated, ["a"] * 20)


def test_full_ranking_map_is_left_out_above_the_limit_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    import retrieval.metrics as metrics_module

    embeddings, labels = clustered(7, n=60)
    names = [str(x) for x in labels]
    monkeypatch.setattr(metrics_module, "FULL_RANKING_LIMIT", 50)
    assert "map" not in retrieval_metrics(embeddings, names)
    assert "map" in retrieval_metrics(embeddings, names, full_ranking=True)


def test_diagnostics_match_every_pair_by_brute_force() -> None:
    from retrieval.metrics import embedding_diagnostics

    rng = np.random.default_rng(4)
    z = rng.standard_normal((300, 16))
    z /= np.linalg.norm(z, axis=1, keepdims=True)
    labels = [str(x) for x in rng.integers(0, 12, 300)]
    similarity = z @ z.T
    distinct = ~np.eye(300, dtype=bool)
    same = (np.array(labels)[:, None] == np.array(labels)[None, :]) & distinct
    expected = {
        "uniformity": np.log(np.mean(np.exp(-2 * (2 - 2 * similarity[distinct])))),
        "alignment": np.mean(np.sum((z[:, None, :] - z[None, :, :]) ** 2, axis=-1)[same]),
        "tolerance": np.mean(similarity[same]),
    }
    assert embedding_diagnostics(z, labels, block=64) == pytest.approx(expected, rel=1e-9)
    subset = embedding_diagnostics(z, labels, max_points=100)  # uniformity on 100 rows, the rest on all
    assert subset["tolerance"] == pytest.approx(expected["tolerance"], rel=1e-9)
    assert subset["uniformity"] != pytest.approx(expected["uniformity"], rel=1e-9)


def test_per_query_scores() -> None:
    from retrieval.metrics import score_queries

    gallery = ranked_gallery([3, 0, 2, 1, 4])  # nearest first: 3, 0, 2, 1, 4
    scores = score_queries(np.array([[1.0, 0.0], [1.0, 0.0]], np.float32), ["a", "z"], gallery, ["b", "a", "b", "b", "a"], ks=(1, 2, 10))
    assert scores.queries.tolist() == [0] and scores.skipped == 1  # "z" has nothing to find
    assert scores.neighbours.tolist() == [[3, 0, 2, 1, 4]]  # k = 10 is cut to the gallery
    assert scores.similarities[0].tolist() == sorted(scores.similarities[0].tolist(), reverse=True)
    assert scores.first_hit.tolist() == [3]  # "a" first appears at the fourth place
    assert scores.values["recall@2"].tolist() == [0.0] and scores.values["recall@10"].tolist() == [1.0]
    assert scores.summary()["cmc"] == [0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]


def test_arguments_no_scoring_or_search_can_use_are_refused() -> None:
    """retrieval_metrics with a label short failed in numpy's indexing, ks=5 with "'int' object is not iterable";
    nearest_neighbours of another dimension raised FAISS's bare AssertionError, k=0 an IndexError, a NaN row found
    no neighbour without a word, and a one-item gallery left out of itself an IndexError."""
    vectors = np.eye(3, dtype=np.float32)
    with pytest.raises(RetrievalError, match="^3 query embeddings for 2 labels: give one label per row$"):
        retrieval_metrics(vectors, ["a", "a"])
    with pytest.raises(RetrievalError, match="^3 gallery embeddings for 1 labels"):
        retrieval_metrics(vectors, ["a", "a", "b"], vectors, ["a"])
    with pytest.raises(RetrievalError, match="together, or neither"):
        retrieval_metrics(vectors, ["a", "a", "b"], vectors)
    with pytest.raises(RetrievalError, match=r"^ks: a list of k values, not one k; write \[5\]$"):
        retrieval_metrics(vectors, ["a", "a", "b"], ks=5)
    for ks, said in (("1,5", "ks='1,5'"), ([1, 2.5], "ks=[1, 2.5]"), ([True], "ks=[True]")):  # "1,5": a TypeError inside
        with pytest.raises(RetrievalError) as refused:
            retrieval_metrics(vectors, ["a", "a", "b"], ks=ks)  # type: ignore[arg-type]
        assert str(refused.value) == f"{said}: give a list of whole numbers, e.g. [1, 5, 10]"
    with pytest.raises(RetrievalError, match="^k must be at least 1, got 0$"):
        nearest_neighbours(vectors, vectors, 0)
    with pytest.raises(RetrievalError, match=r"^queries of shape \(3, 3\) against a gallery of shape \(3, 4\)"):
        nearest_neighbours(vectors, np.eye(3, 4, dtype=np.float32), 1)
    broken = vectors.copy()
    broken[2, 0] = np.nan
    with pytest.raises(RetrievalError, match="^query row 2 holds NaN or infinite values"):
        nearest_neighbours(broken, vectors, 1)
    with pytest.raises(RetrievalError, match="^gallery row 2 holds NaN or infinite values"):
        nearest_neighbours(vectors, broken, 1)
    ids, scores = nearest_neighbours(vectors[:1], vectors[:1], 1, exclude_self=True)
    assert ids.shape == scores.shape == (1, 0)
