"""Query-time re-ranking of a shortlist: α-query expansion, database-side augmentation, k-reciprocal.

The first search returns a shortlist of candidates; a re-ranker scores them again and reorders
them. `qe` (α-query expansion, Radenović et al. 2018) searches with the query averaged with its
top n candidates, weighted by their similarity to the power α; `dba` (database-side augmentation,
Gordo et al. 2017) compares the query with each candidate averaged, the same way, with its own n
nearest gallery items; `kreciprocal` (Zhong et al. 2017) mixes the original distance with the
Jaccard distance of k-reciprocal neighbour sets, computed among the query and its shortlist. Every
caller (`retrieval search`, `evaluate`, the app and the API) goes through `rerank`, so that their
lists agree; ties keep the lower id first, as in retrieval.knn.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from retrieval.errors import RetrievalError, one_of

# vectors(ids [M]) -> the gallery rows [M, D]; neighbours(ids [M], n) -> (ids [M, n], scores [M, n]) of each
# gallery item's n nearest other gallery items, best first (-1 where there are fewer)
Vectors = Callable[[np.ndarray], np.ndarray]
Neighbours = Callable[[np.ndarray, int], tuple[np.ndarray, np.ndarray]]

METHODS = {
    "none": {},
    "qe": {"n": 1.0, "alpha": 3.0},
    "dba": {"n": 1.0, "alpha": 3.0},
    "kreciprocal": {"k1": 20.0, "k2": 6.0, "lambda": 0.3},
}
SHORTLIST = 100  # candidates re-ranked per query (at least k)
SPEC_HELP = (
    "Re-rank the shortlist: none, qe (α-query expansion), dba (database-side augmentation) or kreciprocal, "
    "with parameters after a colon, e.g. qe:n=2,alpha=3, dba:n=1, kreciprocal:k1=20,k2=6,lambda=0.3, shortlist=100."
)


@dataclass(frozen=True)
class Rerank:
    """A re-ranker and its parameters (METHODS gives each method's defaults), over `shortlist` candidates."""

    method: str = "none"
    parameters: dict[str, float] = field(default_factory=dict, hash=False, compare=True)
    shortlist: int = SHORTLIST

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise RetrievalError(f"unknown re-ranker {self.method!r}; {one_of(self.method, METHODS)}")
        unknown = set(self.parameters) - set(METHODS[self.method])
        if unknown:
            allowed = ", ".join(METHODS[self.method]) or "none"
            raise RetrievalError(f"{self.method} has no parameter {', '.join(sorted(unknown))}; it takes {allowed}")
        if not _whole(self.shortlist):
            raise RetrievalError(
                f"the re-ranking shortlist must be a whole number of at least 1, got {self.shortlist:g}"
            )
        object.__setattr__(self, "shortlist", int(self.shortlist))
        for name, value in self.parameters.items():
            if name in ("n", "k1", "k2") and not _whole(value):
                raise RetrievalError(f"{self.method}'s {name} must be a whole number of at least 1, got {value:g}")
            if name == "alpha" and not 0 <= value < np.inf:
                raise RetrievalError(
                    f"{self.method}'s alpha (the neighbours' weight: similarity^alpha) must be 0 or more, got {value:g}"
                )
            if name == "lambda" and not 0 <= value <= 1:
                raise RetrievalError(
                    f"kreciprocal's lambda (the original distance's share) must be between 0 and 1, got {value:g}"
                )

    def __hash__(self) -> int:
        return hash((self.method, tuple(sorted(self.parameters.items())), self.shortlist))

    def value(self, name: str) -> float:
        """A parameter as given, else the method's default."""
        return self.parameters.get(name, METHODS[self.method][name])

    @property
    def active(self) -> bool:
        return self.method != "none"

    def describe(self) -> str:
        """The spec string that parse_rerank reads back, with every parameter spelled out."""
        if not self.active:
            return "none"
        values = {name: self.value(name) for name in METHODS[self.method]}
        text = ",".join(f"{name}={value:g}" for name, value in values.items())
        return f"{self.method}:{text},shortlist={self.shortlist}"


def _whole(value: float) -> bool:
    """Whether a count given as a number is a whole number of at least 1 (not 2.5, inf or nan)."""
    return bool(np.isfinite(value)) and value >= 1 and value == int(value)


NO_RERANK = Rerank()


def parse_rerank(text: str) -> Rerank:
    """'dba:n=1,alpha=3' -> Rerank('dba', {'n': 1, 'alpha': 3}); refuses what it cannot read, naming it."""
    method, _, rest = text.strip().partition(":")
    parameters: dict[str, float] = {}
    shortlist: float = SHORTLIST
    for part in filter(None, (piece.strip() for piece in rest.split(","))):
        name, equals, value = part.partition("=")
        try:
            number = float(value)
        except ValueError:
            number = None
        if not equals or number is None:
            raise RetrievalError(f"re-ranking parameter {part!r} is not name=number, e.g. dba:n=1,alpha=3")
        if name.strip() == "shortlist":
            shortlist = number  # Rerank refuses one that is not a whole number of at least 1
        else:
            parameters[name.strip()] = number
    return Rerank(method.strip().lower() or "none", parameters, shortlist)


def rerank(
    spec: Rerank,
    queries: np.ndarray,
    ids: np.ndarray,
    scores: np.ndarray,
    vectors: Vectors,
    neighbours: Neighbours,
    own: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The shortlists (ids [Q, S], scores, best first, -1 padded) reordered by spec, with their new scores.

    own[i] is query i's own gallery id (leave-one-out), which no gallery item's augmentation may use.
    """
    if not spec.active or ids.size == 0:
        return ids, scores
    queries = np.asarray(queries, np.float32)
    valid = ids >= 0
    if spec.method == "dba":
        n, alpha = int(spec.value("n")), spec.value("alpha")
        new = _database_augmentation(queries, ids, vectors, neighbours, own, n, alpha)
    else:
        candidates = _gather(vectors, ids, queries.shape[1])
        if spec.method == "qe":
            new = _query_expansion(queries, candidates, scores, valid, int(spec.value("n")), spec.value("alpha"))
        else:
            k1, k2 = int(spec.value("k1")), int(spec.value("k2"))
            new = _k_reciprocal(queries, candidates, valid, k1, k2, spec.value("lambda"))
    new = np.where(valid, new, -np.inf).astype(np.float32)
    order = np.lexsort((np.where(valid, ids, np.iinfo(np.int64).max), -new), axis=-1)
    return np.take_along_axis(ids, order, axis=1), np.take_along_axis(new, order, axis=1)


def _gather(vectors: Vectors, ids: np.ndarray, dim: int) -> np.ndarray:
    """The gallery rows of ids [...], shaped [..., dim]; zeros where an id is -1 (a shorter list's padding)."""
    rows = np.zeros((ids.size, dim), np.float32)
    present = ids.ravel() >= 0
    if present.any():
        rows[present] = vectors(ids.ravel()[present])
    return rows.reshape(*ids.shape, dim)


def _normalise(rows: np.ndarray) -> np.ndarray:
    return rows / np.maximum(np.linalg.norm(rows, axis=-1, keepdims=True), 1e-12)


def _weights(similarities: np.ndarray, alpha: float) -> np.ndarray:
    return np.maximum(similarities, 0.0) ** alpha


def _query_expansion(
    queries: np.ndarray, candidates: np.ndarray, scores: np.ndarray, valid: np.ndarray, n: int, alpha: float
) -> np.ndarray:
    """Each candidate's similarity to the query averaged with its top n candidates (weights: similarity^α)."""
    top = slice(0, min(n, candidates.shape[1]))
    weights = np.where(valid[:, top], _weights(scores[:, top], alpha), 0.0)
    expanded = _normalise(queries + np.einsum("qn,qnd->qd", weights, candidates[:, top]))
    return np.einsum("qd,qsd->qs", expanded, candidates)


def _database_augmentation(
    queries: np.ndarray,
    ids: np.ndarray,
    vectors: Vectors,
    neighbours: Neighbours,
    own: np.ndarray | None,
    n: int,
    alpha: float,
) -> np.ndarray:
    """The query's similarity to each candidate averaged with its own n nearest gallery items (weights: sim^α).

    A candidate's neighbour that is the query itself (own, leave-one-out) is passed over for the next one.
    """
    unique, rows = np.unique(np.where(ids >= 0, ids, -1), return_inverse=True)
    rows = rows.reshape(ids.shape)
    found = np.full((len(unique), n + 1), -1, np.int64)
    found_scores = np.zeros((len(unique), n + 1), np.float32)
    present = unique >= 0
    if present.any():  # one more neighbour than n, in case one is the query
        found[present], found_scores[present] = neighbours(unique[present], n + 1)
    own_ids = own if own is not None else np.full(len(ids), -2)
    centre = _gather(vectors, unique, queries.shape[1])
    around = _gather(vectors, found, queries.shape[1])
    new = np.empty(ids.shape, np.float32)
    for q in range(len(ids)):
        mine = found[rows[q]]  # [S, n + 1]
        usable = (mine >= 0) & (mine != own_ids[q])
        usable &= np.cumsum(usable, axis=1) <= n
        weights = np.where(usable, _weights(found_scores[rows[q]], alpha), 0.0)
        augmented = centre[rows[q]] + np.einsum("sn,snd->sd", weights, around[rows[q]])
        new[q] = _normalise(augmented) @ queries[q]
    return new


def _k_reciprocal(
    queries: np.ndarray, candidates: np.ndarray, valid: np.ndarray, k1: int, k2: int, lam: float
) -> np.ndarray:
    """1 - ((1 - λ) Jaccard distance of k-reciprocal sets + λ original distance), among each query and its shortlist."""
    result = np.zeros(valid.shape, np.float32)
    for q in range(len(queries)):
        rows = np.concatenate([queries[q : q + 1], candidates[q][valid[q]]])
        result[q, : len(rows) - 1] = 1.0 - _k_reciprocal_distance(rows, k1, k2, lam)
    return result


def _k_reciprocal_distance(rows: np.ndarray, k1: int, k2: int, lam: float) -> np.ndarray:
    """Zhong et al.'s final distance from row 0 (the query) to rows 1.. (its shortlist), as their reference code."""
    count = len(rows)
    distance = np.maximum(2.0 - 2.0 * rows.astype(np.float64) @ rows.T.astype(np.float64), 0.0)
    original = distance / np.maximum(distance.max(axis=1, keepdims=True), 1e-12)
    rank = np.argsort(original, axis=1, kind="stable")
    half = int(np.around(k1 / 2.0))
    encoding = np.zeros((count, count), np.float64)
    for i in range(count):
        reciprocal = _reciprocal(rank, i, k1)
        expansion = reciprocal
        for candidate in reciprocal:
            theirs = _reciprocal(rank, int(candidate), half)
            if len(np.intersect1d(theirs, reciprocal)) > 2 / 3 * len(theirs):
                expansion = np.append(expansion, theirs)
        expansion = np.unique(expansion)
        weights = np.exp(-original[i, expansion])
        encoding[i, expansion] = weights / weights.sum()
    if k2 > 1:
        encoding = encoding[rank[:, :k2]].mean(axis=1)
    shared = np.minimum(encoding[0:1], encoding[1:]).sum(axis=1)
    jaccard = 1.0 - shared / (2.0 - shared)
    return (1 - lam) * jaccard + lam * original[0, 1:]


def _reciprocal(rank: np.ndarray, i: int, k: int) -> np.ndarray:
    """The k-reciprocal neighbours of row i: its k+1 nearest (itself included) that have i among theirs."""
    forward = rank[i, : k + 1]
    return forward[np.any(rank[forward, : k + 1] == i, axis=1)]
