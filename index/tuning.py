"""Tuning a new index's search depth: the smallest nprobe/efSearch whose recall@10 reaches the target.

Recall is measured against exact search (retrieval.knn) for a seeded sample of the gallery's vectors,
held out of the index until its depth is tuned, with the exact neighbours kept up to date chunk by
chunk as the index is filled.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from index.choice import TARGET_RECALL
from index.faiss_ops import TRAIN_PER_LIST, faiss, search_ids, search_parameters
from index.types import Additions
from retrieval.knn import nearest_neighbours

RECALL_SAMPLE = 1000  # gallery vectors held out as queries to tune recall@10 against exact search (at most a tenth)
PLATEAU = 0.002  # recall@10 gained by one step of the search depth below which tuning stops
MARGIN = 0.01  # tuned above TARGET_RECALL by this: the held-out sample read 0.971 where new queries got 0.960
SAMPLE_LIMIT = TRAIN_PER_LIST * 16_384  # enough to train the lists of up to about 17 million vectors
MAX_EF_SEARCH = 1024


class RecallProbe:
    """Exact top-10 of a few sample queries over everything added, kept up to date chunk by chunk.

    The queries are gallery vectors held out of the index while its depth is tuned (the draft adds
    them afterwards): a query that is already in the index finds its own row, and in a graph its
    own node's links lead straight to its neighbours, so tuning on it overstates held-out recall.
    """

    def __init__(self, queries: np.ndarray, k: int = 10) -> None:
        self.queries, self.k = np.ascontiguousarray(queries, np.float32), k
        self.scores = np.full((len(queries), 0), -np.inf, np.float32)
        self.ids = np.zeros((len(queries), 0), np.int64)
        self.keys = {row.tobytes() for row in self.queries}

    def held(self, rows: np.ndarray) -> np.ndarray:
        """Which rows are (copies of) the probe's queries, to be added only after tuning."""
        held = np.zeros(len(rows), bool)
        # whole rows are compared only where the first value matches one of the queries'
        maybe = np.flatnonzero(np.isin(rows[:, 0], self.queries[:, 0]))
        held[maybe] = [rows[i].tobytes() in self.keys for i in maybe]
        return held

    def see(self, rows: np.ndarray, ids: np.ndarray) -> None:
        """Takes in a chunk of added rows with their ids."""
        if not len(rows):
            return
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


def leave_out(found: np.ndarray, own: np.ndarray, k: int) -> np.ndarray:
    """The first k ids of each row of found other than that row's own id (-1: none to leave out)."""
    mine = found == own[:, None]
    return np.take_along_axis(found, np.argsort(mine, axis=1, kind="stable"), axis=1)[:, :k]


def recall_at_10(found: Sequence[Sequence[int]] | np.ndarray, exact: np.ndarray) -> float:
    """Mean share of each row of exact ids (the true top-k) that the same row of found holds."""
    return float(np.mean([len(set(map(int, a)) & set(map(int, b))) / len(b) for a, b in zip(found, exact)]))


@dataclass(frozen=True)
class Tuned:
    """The search depth a new index was tuned to ({} for exact search, else {"nprobe"|"efSearch": n}) and the
    recall@10 measured with it."""

    search: dict[str, int]
    recall_at_10: float


def tune_depth(
    vectors: faiss.Index, kind: str, probe: RecallProbe | None, raw: np.ndarray | None = None, rerank: int = 0
) -> Tuned:
    """The smallest search depth reaching TARGET_RECALL + MARGIN on the probe, and its recall@10.

    Depths grow by steps of 1.5x and 1.33x in turn (1, 2, 3, 4, 6, 8, … for nprobe, up to the number of
    lists; 16, 24, 32, 48, … for efSearch); when a step stops paying (recall up by less than
    PLATEAU), as when compressed codes rather than the search cap the recall, the last depth that
    still helped is kept.
    """
    if probe is None:
        return Tuned({}, 1.0)
    if kind == "flat":
        return Tuned({}, probe.recall(vectors, None, raw, rerank))
    if kind == "ivf":
        name, depths = "nprobe", _depths(1, faiss.extract_index_ivf(vectors).nlist)
    else:
        name, depths = "efSearch", _depths(16, MAX_EF_SEARCH)
    chosen, recall = depths[0], probe.recall(vectors, search_parameters(kind, depths[0]), raw, rerank)
    for depth in depths[1:]:
        if recall >= TARGET_RECALL + MARGIN:
            break
        deeper = probe.recall(vectors, search_parameters(kind, depth), raw, rerank)
        if deeper < recall + PLATEAU:
            break
        chosen, recall = depth, deeper
    return Tuned({name: chosen}, recall)


def _depths(first: int, last: int) -> list[int]:
    """first, 1.5 first, 2 first, 3 first, 4 first, … up to last: powers of two and the halfway points between."""
    powers = [first * 2**i for i in range(int(np.log2(last / first)) + 1)]
    return sorted({depth for power in powers for depth in (power, power * 3 // 2) if depth <= last})


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
