"""The match threshold: the similarity of a top-1 hit above which it is right with a target precision.

Fitted on held-out labeled images (`retrieval evaluate RUN IMAGES --calibrate`): every scored query's
best hit, leave-one-out or against a gallery, is right or wrong; the threshold is the lowest best-hit
similarity at which the hits at or above it are right at least `target` of the time, so that as
many queries as possible are answered at that precision (their share: the coverage), and at least
MIN_QUERIES hits reach it (4 right hits of 4 promised 0.9 and held 0.125 on new images). A seeded half
of the classes is fitted and the other half checked, both ways, so the model card also says how the
threshold holds on classes it was not fitted on. Search marks each hit a match when its score
reaches the threshold (index.search); the app says "no confident match" when the best hit does not.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from numbers import Real
from pathlib import Path

import numpy as np

from retrieval.errors import RetrievalError
from retrieval.metrics import QueryScores
from retrieval.rerank import NO_RERANK, Rerank
from retrieval.runs import RunDir, read_json, write_json

DEFAULT_TARGET = 0.9
CARD_KEY = "match_threshold"  # where the model card keeps it
MIN_QUERIES = 20  # fewer scored queries (or hits at or above a threshold) cannot measure a precision worth storing
HOLDS = 0.05  # a threshold whose held-out precision falls further below the target than this is said not to hold
# the threshold where no similarity reaches the target: only a hit of the query's own picture (cosine 1) is a match; one
# just above the fitted similarities marked new images' higher hits (icons: 10 of 494, none of them right)
UNREACHED = 1.0


@dataclass(frozen=True)
class MatchThreshold:
    """A fitted threshold with what it was measured at, as the model card keeps it.

    similarity: a hit scoring at least this is a match. precision and coverage: of the fitting
    queries whose best hit reaches it, the share that is right, and their share of all queries.
    held_out_precision: the precision on the classes left out of the fit, averaged over the two
    halves (None when the images had too few classes to split, or neither half gives MIN_QUERIES hits at the
    target).
    """

    similarity: float
    target: float
    precision: float | None  # None: no similarity reached the target; nothing is a match
    coverage: float
    held_out_precision: float | None
    queries: int
    images: str
    rerank: str = "none"

    def to_dict(self) -> dict:
        """The threshold as JSON values."""
        return asdict(self)

    def caution(self) -> str | None:
        """A line for people where the check on held-out classes says the threshold will not hold on new classes
        (the icons: 0.60 there at a 0.8 target, and 0.35 on the test classes); None where it holds or was not made."""
        held = self.held_out_precision
        if self.precision is None or held is None or held >= self.target - HOLDS:
            return None
        return (
            f"on the classes it was not fitted on, the threshold held {held:.2f}, below the target {self.target:.2f}: "
            "on new classes fewer of its matches will be right; calibrate on more classes, or lower --target-precision"
        )

    @classmethod
    def from_dict(cls, values: dict) -> MatchThreshold:
        """The threshold from a model card's JSON."""
        return cls(**values)

    def describe(self) -> str:
        """One line for people: the threshold and what it was measured at."""
        if self.precision is None:
            return (
                f"no similarity gives top-1 precision {self.target:.2f} to at least {MIN_QUERIES} of the "
                f"{self.queries} queries of {self.images}: only a copy of the query (similarity 1) will be marked a "
                "match; lower --target-precision, or calibrate on more images"
            )
        held = "" if self.held_out_precision is None else f", {self.held_out_precision:.2f} on held-out classes"
        return (
            f"match threshold {self.similarity:.4f}: top-1 precision {self.precision:.2f}{held} "
            f"(target {self.target:.2f}) at coverage {self.coverage:.2f} of {self.queries} queries of {self.images}"
        )


def require_threshold(threshold: float | None) -> None:
    """Refuses a match threshold that no cosine similarity can reach or fall below (5, nan, "0.5")."""
    if threshold is None:
        return
    if isinstance(threshold, bool) or not isinstance(threshold, Real) or not -1.0 <= threshold <= 1.0:
        raise RetrievalError(f"--threshold {threshold!r}: give a cosine similarity between -1 and 1")


def require_target(target: float, name: str = "--target-precision") -> None:
    """Refuses a target precision outside (0, 1), or not a number (name: the option or argument that gave it)."""
    if isinstance(target, bool) or not isinstance(target, Real) or not 0.0 < target < 1.0:
        raise RetrievalError(f"{name} {target!r}: give a precision between 0 and 1, e.g. 0.9")


def fit_similarity(
    similarities: np.ndarray, correct: np.ndarray, target: float, least: int = 1
) -> tuple[float, float, float]:
    """(threshold, precision, coverage): the lowest best-hit similarity at which the hits at or above it, at least
    least of them, are right at least target of the time. Where no similarity reaches the target, the threshold is
    UNREACHED (coverage 0, precision nan): a hit is a match only where it is the query's picture."""
    order = np.argsort(-similarities, kind="stable")
    ranked, hits = similarities[order], correct[order].astype(np.float64)
    precision = np.cumsum(hits) / np.arange(1, len(hits) + 1)
    last = len(ranked) - 1 - np.searchsorted(ranked[::-1], ranked, side="left")  # the last row tied with each row
    # a threshold keeps every hit tied with the lowest kept one: last + 1 of them
    good = np.flatnonzero((precision[last] >= target) & (last + 1 >= least))
    if not len(good):
        return UNREACHED, float("nan"), 0.0
    cut = int(last[good.max()])
    return float(ranked[cut]), float(precision[cut]), (cut + 1) / len(ranked)


def precision_at(similarities: np.ndarray, correct: np.ndarray, threshold: float) -> tuple[float, float]:
    """(precision, coverage) of the best hits scoring at least threshold (precision nan when none does)."""
    kept = similarities >= threshold
    return (float(correct[kept].mean()) if kept.any() else float("nan")), float(kept.mean())


def calibrate(
    scores: QueryScores, labels: list[str], target: float, images: str, rerank: str = "none", seed: int = 0
) -> MatchThreshold:
    """The threshold of an evaluation's scores (labels: of every query row), with the held-out check over two seeded
    halves of the classes."""
    require_target(target)
    if len(scores.queries) < MIN_QUERIES:
        raise RetrievalError(
            f"{images}: only {len(scores.queries)} queries have another image of their class; calibrating a threshold "
            f"needs at least {MIN_QUERIES} (give more labeled images)"
        )
    best = scores.similarities[:, 0].astype(np.float64)
    correct = scores.first_hit == 0
    similarity, precision, coverage = fit_similarity(best, correct, target, MIN_QUERIES)
    held_out = _held_out(best, correct, labels, scores, target, seed)
    reached = None if np.isnan(precision) else precision
    return MatchThreshold(similarity, target, reached, coverage, held_out, len(best), images, rerank)


def _held_out(
    best: np.ndarray, correct: np.ndarray, labels: list[str], scores: QueryScores, target: float, seed: int
) -> float | None:
    """The precision on one half of the classes of the threshold fitted on the other, averaged over both ways."""
    query_labels = np.asarray(labels)[scores.queries]
    classes = np.unique(query_labels)
    if len(classes) < 4:
        return None
    first = np.isin(query_labels, np.random.default_rng(seed).permutation(classes)[: len(classes) // 2])
    measured = []
    for fit, check in ((first, ~first), (~first, first)):
        threshold = fit_similarity(best[fit], correct[fit], target, MIN_QUERIES)[0]
        measured.append(precision_at(best[check], correct[check], threshold)[0])
    measured = [value for value in measured if not np.isnan(value)]
    return float(np.mean(measured)) if measured else None


def card_threshold(card: dict) -> MatchThreshold | None:
    """The model card's match threshold, if the run has been calibrated."""
    values = card.get(CARD_KEY)
    return MatchThreshold.from_dict(values) if values else None


def match_similarity(card: dict, rerank: str, override: float | None = None) -> float | None:
    """The similarity a hit must reach to be a match: override (--threshold) when given, else the card's when it was
    fitted on scores re-ranked as these are (rerank: Rerank.describe()); None: hits are not marked."""
    if override is not None:
        return float(override)
    fitted = card_threshold(card)
    return fitted.similarity if fitted is not None and fitted.rerank == rerank else None


def run_threshold(run: RunDir | str | Path, rerank: Rerank = NO_RERANK) -> float | None:
    """The similarity at which a hit of the run's model is a match, searched with rerank: Query(threshold=...) marks
    hits with it (None: the run was not calibrated for that re-ranking; its hits are not marked)."""
    run = RunDir.of(run)
    return match_similarity(read_json(run.model_card) if run.model_card.is_file() else {}, rerank.describe())


def store_threshold(card_path: Path, threshold: MatchThreshold) -> None:
    """Writes the threshold into the model card (sealed, atomically, the rest of the card kept)."""
    card = read_json(card_path)
    write_json(card_path, {**card, CARD_KEY: threshold.to_dict()}, sealed=True)


def match_figures(scores: QueryScores, threshold: float) -> dict:
    """What a threshold does on an evaluation's queries: its value, the top-1 precision and the coverage at it."""
    precision, coverage = precision_at(scores.similarities[:, 0], scores.first_hit == 0, threshold)
    shown = None if np.isnan(precision) else precision  # no query reaches it: no precision (JSON has no nan)
    return {"match threshold": threshold, "match precision": shown, "match coverage": coverage}
