"""Tuning a new index's search depth: the smallest nprobe/efSearch whose recall@10 reaches the target.

Recall is measured against exact search (retrieval.knn) for a seeded sample of the gallery's vectors,
held out of the index until its depth is tuned, with the exact neighbours kept up to date chunk by
chunk as the index is filled. Held out, the sample's recall is that of fresh queries up to its
sampling error, so the target is asked with a margin of CONFIDENCE standard errors of the sample's
mean (about 0.004 for 2,000 queries near 0.95), and the depth is found to the unit by bisection
once a step of the coarse grid has crossed the target (a grid step alone overshoots: efSearch 96 →
128 moved recall from 0.95 to 0.976 on bench/index.py's sets).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from index.choice import TARGET_RECALL
from index.faiss_ops import TRAIN_PER_LIST, faiss, search_ids, search_parameters
from index.types import Additions
from retrieval.knn import nearest_neighbours

PLATEAU = 0.002  # recall@10 gained by one step of the search depth below which tuning stops
CONFIDENCE = 2.0  # the probe's recall must exceed TARGET_RECALL by this many standard errors of its mean
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
        return self.measure(vectors, params, raw, rerank).mean

    def measure(
        self, vectors: faiss.Index, params: object | None, raw: np.ndarray | None = None, rerank: int = 0
    ) -> Recall:
        """recall with the standard error of its mean over the probe's queries."""
        shares = query_recalls(search_ids(vectors, self.queries, self.k, params, raw, rerank)[1], self.ids)
        return Recall(
            float(shares.mean()), float(shares.std(ddof=1) / np.sqrt(len(shares))) if len(shares) > 1 else 1.0
        )


@dataclass(frozen=True)
class Recall:
    """A probe's mean recall@10 and the standard error of that mean."""

    mean: float
    error: float

    @property
    def enough(self) -> bool:
        """Whether the recall exceeds the target by CONFIDENCE standard errors."""
        return self.mean >= TARGET_RECALL + CONFIDENCE * self.error


def leave_out(found: np.ndarray, own: np.ndarray, k: int) -> np.ndarray:
    """The first k ids of each row of found other than that row's own id (-1: none to leave out)."""
    mine = found == own[:, None]
    return np.take_along_axis(found, np.argsort(mine, axis=1, kind="stable"), axis=1)[:, :k]


def query_recalls(found: Sequence[Sequence[int]] | np.ndarray, exact: np.ndarray) -> np.ndarray:
    """The share of each row of exact ids (the true top-k) that the same row of found holds."""
    return np.array([len(set(map(int, a)) & set(map(int, b))) / len(b) for a, b in zip(found, exact)])


def recall_at_10(found: Sequence[Sequence[int]] | np.ndarray, exact: np.ndarray) -> float:
    """Mean share of each row of exact ids (the true top-k) that the same row of found holds."""
    return float(query_recalls(found, exact).mean())


@dataclass(frozen=True)
class Tuned:
    """The search depth a new index was tuned to ({} for exact search, else {"nprobe"|"efSearch": n}) and the
    recall@10 measured with it."""

    search: dict[str, int]
    recall_at_10: float


def tune_depth(
    vectors: faiss.Index, kind: str, probe: RecallProbe | None, raw: np.ndarray | None = None, rerank: int = 0
) -> Tuned:
    """The smallest search depth whose probe recall is enough (Recall.enough), and its recall@10.

    Depths grow by steps of 1.5x and 1.33x in turn (1, 2, 3, 4, 6, 8, … for nprobe, up to the number of
    lists; 16, 24, 32, 48, … for efSearch); the step that crosses the target is then bisected to the
    unit. When a step stops paying (recall up by less than PLATEAU), as when compressed codes rather
    than the search cap the recall, the last depth that still helped is kept.
    """
    if probe is None:
        return Tuned({}, 1.0)
    if kind == "flat":
        return Tuned({}, probe.recall(vectors, None, raw, rerank))
    if kind == "ivf":
        name, depths = "nprobe", _depths(1, faiss.extract_index_ivf(vectors).nlist)
    else:
        name, depths = "efSearch", _depths(16, MAX_EF_SEARCH)

    def measure(depth: int) -> Recall:
        return probe.measure(vectors, search_parameters(kind, depth), raw, rerank)

    below, chosen, recall = None, depths[0], measure(depths[0])
    for depth in depths[1:]:
        if recall.enough:
            break
        deeper = measure(depth)
        if deeper.mean < recall.mean + PLATEAU:
            break
        below, chosen, recall = chosen, depth, deeper
    while recall.enough and below is not None and chosen - below > 1:  # bisect: below is not enough, chosen is
        middle = (below + chosen) // 2
        found = measure(middle)
        below, chosen, recall = (below, middle, found) if found.enough else (middle, chosen, recall)
    return Tuned({name: chosen}, recall.mean)


def _depths(first: int, last: int) -> list[int]:
    """first, 1.5 first, 2 first, 3 first, 4 first, … up to last: powers of two and the halfway points between."""
    powers = [first * 2**i for i in range(int(np.log2(last / first)) + 1)]
    return sorted({depth for power in powers for depth in (power, power * 3 // 2) if depth <= last})


def intrinsic_dimension(sample: np.ndarray, points: int = 2000) -> float:
    """TwoNN intrinsic dimension (Facco et al. 2017): n / Σ log(r2 / r1), each of `points` sample rows' distances to
    its first and second nearest other rows of the sample (identical rows left out). It tells how hard the
    gallery is for a graph: the higher, the more of it a search must visit (index.choice)."""
    points = min(points, len(sample) - 2)
    if points < 2:
        return 0.0
    nearest = nearest_neighbours(sample[:points], sample, 2, exclude_self=True)[1]
    distance = np.sqrt(np.maximum(2 - 2 * nearest.astype(np.float64), 0))
    kept = distance[:, 0] > 1e-3  # copies: float32 rounding leaves them about 3e-4 apart
    ratio = distance[kept, 1] / distance[kept, 0]
    return float(len(ratio) / max(np.log(ratio).sum(), 1e-12))


@dataclass(frozen=True)
class Sample:
    """How many rows a stream of additions held, and a seeded uniform sample of them."""

    count: int
    rows: np.ndarray


def sample_rows(additions: Iterable[Additions], dim: int, size: int | None = None, seed: int = 0) -> Sample:
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
    return Sample(count, cut()[0][0])
