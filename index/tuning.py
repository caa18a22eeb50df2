"""Tuning a new index's search depth: the smallest nprobe/efSearch whose recall@10 reaches the target.

Recall is measured against exact search (retrieval.knn) on a seeded sample of the gallery's own
vectors, kept up to date chunk by chunk as the index is filled.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from index.choice import TARGET_RECALL
from index.faiss_ops import TRAIN_PER_LIST, faiss, search_ids, search_parameters
from index.types import Additions
from retrieval.knn import nearest_neighbours

RECALL_SAMPLE = 1000  # own vectors used as queries to tune and measure recall@10 against exact search
PLATEAU = 0.002  # recall@10 gained by doubling the search depth below which tuning stops
SAMPLE_LIMIT = TRAIN_PER_LIST * 16_384  # enough to train the lists of up to about 17 million vectors
HNSW_DEPTHS = (16, 32, 64, 128, 256, 512, 1024)


class RecallProbe:
    """Exact top-10 of a few sample queries over everything added, kept up to date chunk by chunk."""

    def __init__(self, queries: np.ndarray, k: int = 10) -> None:
        self.queries, self.k = np.ascontiguousarray(queries, np.float32), k
        self.scores = np.full((len(queries), 0), -np.inf, np.float32)
        self.ids = np.zeros((len(queries), 0), np.int64)

    def see(self, rows: np.ndarray, ids: np.ndarray) -> None:
        """Takes in a chunk of added rows with their ids."""
        found, scores = nearest_neighbours(self.queries, rows, min(self.k, len(rows)))
        scores = np.concatenate([self.scores, scores], axis=1)
        candidates = np.concatenate([self.ids, ids[found]], axis=1)
        best = np.lexsort((candidates, -scores), axis=1)[:, : self.k]
        self.scores, self.ids = np.take_along_axis(scores, best, axis=1), np.take_along_axis(candidates, best, axis=1)

    def recall(
        self, vectors: faiss.Index, params: object | None, raw: np.ndarray | None = None, rerank: int = 0
    ) -> float:
        """Mean share of the exact top-10 that the index returns in its top-10 (re-ranked as search_ids does)."""
        return recall_at_10(search_ids(vectors, self.queries, self.k, params, raw, rerank)[1], self.ids)


def recall_at_10(found: Sequence[Sequence[int]] | np.ndarray, exact: np.ndarray) -> float:
    """Mean share of each row of exact ids (the true top-k) that the same row of found holds."""
    return float(np.mean([len(set(map(int, a)) & set(map(int, b))) / len(b) for a, b in zip(found, exact)]))


def tune_depth(
    vectors: faiss.Index, kind: str, probe: RecallProbe | None, raw: np.ndarray | None = None, rerank: int = 0
) -> dict:
    """The smallest search depth reaching TARGET_RECALL on the probe, and its recall@10.

    Depths double from 1 (nprobe) or 16 (efSearch); when doubling stops paying (recall up by less than
    PLATEAU), as when compressed codes rather than the search cap the recall, the last depth that
    still helped is kept.
    """
    if probe is None:
        return {"search": {}, "recall@10": 1.0}
    if kind == "flat":
        return {"search": {}, "recall@10": probe.recall(vectors, None, raw, rerank)}
    if kind == "ivf":
        name, depths = "nprobe", [2**i for i in range(int(np.log2(faiss.extract_index_ivf(vectors).nlist)) + 1)]
    else:
        name, depths = "efSearch", list(HNSW_DEPTHS)
    chosen, recall = depths[0], probe.recall(vectors, search_parameters(kind, depths[0]), raw, rerank)
    for depth in depths[1:]:
        if recall >= TARGET_RECALL:
            break
        deeper = probe.recall(vectors, search_parameters(kind, depth), raw, rerank)
        if deeper < recall + PLATEAU:
            break
        chosen, recall = depth, deeper
    return {"search": {name: chosen}, "recall@10": recall}


def sample_rows(
    additions: Iterable[Additions], dim: int, size: int | None = None, seed: int = 0
) -> tuple[int, np.ndarray]:
    """Counts the rows of additions and draws a seeded uniform sample of them.

    Every row gets a random key and the rows with the smallest keys form the sample; rows are kept
    until twice the sample size, then cut back, so the work stays linear in the number of rows.
    """
    rng = np.random.default_rng(seed)
    limit = size or SAMPLE_LIMIT
    count, held = 0, 0
    rows: list[np.ndarray] = [np.zeros((0, dim), np.float32)]
    keys: list[np.ndarray] = [np.zeros(0)]

    def cut() -> tuple[list[np.ndarray], list[np.ndarray]]:
        all_rows, all_keys = np.concatenate(rows), np.concatenate(keys)
        best = np.argsort(all_keys)[:limit]
        return [all_rows[best]], [all_keys[best]]

    for chunk in additions:
        rows.append(np.ascontiguousarray(chunk.vectors, dtype=np.float32))
        keys.append(rng.random(len(chunk.vectors)))
        count, held = count + len(chunk.vectors), held + len(chunk.vectors)
        if held > 2 * limit:
            rows, keys = cut()
            held = limit
    return count, cut()[0][0]
