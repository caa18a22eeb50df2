"""The tie rule (ties broken by the lower gallery index) holds for tie groups larger than any margin."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from index.store import GalleryIndex
from index.types import Additions
from retrieval.data import Item
from retrieval.knn import nearest_neighbours
from retrieval.metrics import retrieval_metrics


def tied_gallery(seed: int = 0) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """A query, and a gallery of 30 identical rows (the query's direction) among 70 random unit rows."""
    rng = np.random.default_rng(seed)
    query = np.zeros((1, 16), np.float32)
    query[0, 0] = 1.0
    others = rng.normal(size=(70, 16)).astype(np.float32)
    others[:, 0] = np.minimum(others[:, 0], 0.0)  # all less similar to the query than the twins
    others /= np.linalg.norm(others, axis=1, keepdims=True)
    twins = set(rng.choice(100, 30, replace=False).tolist())
    pending = iter(others)
    gallery = np.stack([query[0] if position in twins else next(pending) for position in range(100)]).astype(np.float32)
    labels = ["twin" if position in twins else f"other{position % 7}" for position in range(100)]
    return query, gallery, labels


def reference(query: np.ndarray, gallery: np.ndarray, k: int, exclude: int | None = None) -> np.ndarray:
    """The ranking by the documented rule: score descending, then the lower index, with the same float32 scores."""
    scores = (gallery @ query[0]).astype(np.float32)
    order = [i for i in np.lexsort((np.arange(len(gallery)), -scores)) if i != exclude]
    return np.array(order[:k])


def test_neighbours_follow_the_lower_index_through_a_tie_group_of_30() -> None:
    query, gallery, _ = tied_gallery()
    for k in (1, 5, 12, 29, 30, 31, 40):
        indices, _ = nearest_neighbours(query, gallery, k)
        np.testing.assert_array_equal(indices[0], reference(query, gallery, k))


def test_leave_one_out_inside_a_tie_group_of_30() -> None:
    _, gallery, labels = tied_gallery(1)
    twins = [i for i, label in enumerate(labels) if label == "twin"]
    indices, _ = nearest_neighbours(gallery, gallery, 35, exclude_self=True)
    for row in twins:
        np.testing.assert_array_equal(indices[row], reference(gallery[row : row + 1], gallery, 35, exclude=row))


def test_map_at_r_of_a_tie_group_is_the_reference_ranking() -> None:
    _, gallery, labels = tied_gallery(2)
    scores = retrieval_metrics(gallery, labels, ks=(1,))
    assert scores["map@r"] > 0  # every twin's R = 29 nearest are the other twins, in any tie order
    twins = [i for i, label in enumerate(labels) if label == "twin"]
    indices, _ = nearest_neighbours(gallery, gallery, 29, exclude_self=True)
    assert all(set(indices[row]) == set(twins) - {row} for row in twins)


def test_the_index_search_follows_the_same_rule(tmp_path: Path) -> None:
    query, gallery, labels = tied_gallery(3)
    items = [Item(Path(f"{i}.png"), label) for i, label in enumerate(labels)]
    index = GalleryIndex.build(tmp_path / "index", gallery, items, [f"{i:064x}" for i in range(100)], "enc")
    for k in (3, 30, 35):
        found = [hit.id - 1 for hit in index.search(query, k)[0]]  # ids are 1..N in row order
        assert found == reference(query, gallery, k).tolist()
    twin_ids = [i + 1 for i, label in enumerate(labels) if label == "twin"]
    only = [hit.id for hit in index.search(query, 40, label="twin")[0]]
    assert only == twin_ids  # a label filter: all 30 tied items, by id


def test_a_graph_searched_at_the_depth_of_k_follows_the_same_rule(tmp_path: Path) -> None:
    """A graph fetches no more candidates than its depth leaves beyond k (FAISS's HNSW keeps max(efSearch, k): more
    searched deeper than tuned); a tie group beyond them is still searched again until it is seen whole."""
    query, gallery, labels = tied_gallery(4)
    items = [Item(Path(f"{i}.png"), label) for i, label in enumerate(labels)]
    additions = [Additions(gallery, items, [f"{i:064x}" for i in range(100)])]
    index = GalleryIndex.create(tmp_path / "index", additions, "enc", 16, "HNSW16")
    for k, depth in ((3, 3), (10, 12), (30, 30), (35, 40)):
        found = [hit.id - 1 for hit in index.search(query, k, depth=depth)[0]]
        assert found == reference(query, gallery, k).tolist(), (k, depth)
