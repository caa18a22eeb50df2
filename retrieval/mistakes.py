"""What a model gets wrong, from an evaluation's per-query scores: the class pairs most often confused, a per-class
table, each query's first hit, and the classes that got better or worse between two runs.

A query is confused with a class when its top-1 hit has that label instead of its own. Everything
here is JSON-ready (the metric set keeps it: `confusions`, `classes`, `first_hits`), so that
`retrieval evaluate` prints it, `--json` and the app read it, and `--compare` diffs two runs' tables.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from retrieval.data import Item
from retrieval.metrics import QueryScores

CONFUSIONS = 15  # class pairs kept, the most frequent first
EXAMPLES = 3  # example (query, hit) pairs kept per confused class pair
CHANGED = 10  # classes listed as better and as worse by a comparison


@dataclass(frozen=True)
class Confusion:
    """Queries of `label` whose top-1 hit is of `confused_with`: how many of its scored queries, with examples."""

    label: str
    confused_with: str
    count: int
    queries: int
    examples: tuple[tuple[str, str], ...]  # (query path, its top-1 hit's path)

    def to_dict(self) -> dict:
        """As the metric set keeps it."""
        examples = [{"query": query, "hit": hit} for query, hit in self.examples]
        return {
            "label": self.label,
            "confused_with": self.confused_with,
            "count": self.count,
            "queries": self.queries,
            "examples": examples,
        }


@dataclass(frozen=True)
class FirstHits:
    """Each scored query's item and its top-1 hit's item (None where the hit is no evaluated item)."""

    queries: list[Item]
    hits: list[Item | None]
    scores: np.ndarray

    @classmethod
    def of(cls, scores: QueryScores, queries: Sequence[Item], gallery: Sequence[Item]) -> FirstHits:
        """The first hits of an evaluation's scored queries."""
        first = scores.neighbours[:, 0] if scores.neighbours.size else np.full(len(scores.queries), -1)
        return cls(
            [queries[row] for row in scores.queries],
            [gallery[int(row)] if row >= 0 else None for row in first],
            scores.similarities[:, 0] if scores.similarities.size else np.zeros(len(scores.queries)),
        )

    def to_list(self) -> list[dict]:
        """One entry per scored query: its path and label, its first hit's path, label and similarity."""
        return [
            {
                "query": str(query.path),
                "label": query.label,
                "hit": str(hit.path) if hit else None,
                "hit_label": hit.label if hit else None,
                "score": float(score),
            }
            for query, hit, score in zip(self.queries, self.hits, self.scores)
        ]


def confusions(first: FirstHits, top: int = CONFUSIONS, examples: int = EXAMPLES) -> list[Confusion]:
    """The class pairs (query label -> top-1 label) most often confused, the most frequent first (ties: by name)."""
    pairs: dict[tuple[str, str], list[tuple[str, str]]] = {}
    counts: dict[str, int] = {}
    for query, hit in zip(first.queries, first.hits):
        counts[query.label] = counts.get(query.label, 0) + 1
        if hit is not None and hit.label != query.label:
            pairs.setdefault((query.label, hit.label), []).append((str(query.path), str(hit.path)))
    ranked = sorted(pairs.items(), key=lambda entry: (-len(entry[1]), entry[0]))[:top]
    return [
        Confusion(label, other, len(found), counts[label], tuple(found[:examples])) for (label, other), found in ranked
    ]


def class_table(scores: QueryScores, first: FirstHits) -> list[dict]:
    """Per class: its scored queries, their mean recall@1 and MAP@R, and the class its queries' wrong top-1 hits have
    most often (with how many), lowest recall@1 first (ties: by name). One pass over the queries, then per class."""
    classes, codes = np.unique(np.asarray([item.label for item in first.queries]), return_inverse=True)
    counts = np.bincount(codes, minlength=len(classes))
    recall = np.bincount(codes, weights=scores.values["recall@1"], minlength=len(classes)) / counts
    map_r = np.bincount(codes, weights=scores.values["map@r"], minlength=len(classes)) / counts
    wrong = Counter(
        (query.label, hit.label) for query, hit in zip(first.queries, first.hits) if hit and hit.label != query.label
    )
    common: dict[str, tuple[int, str]] = {}
    for (label, other), count in wrong.items():  # the most frequent wrong label (ties: by name); counts are >= 1
        common[label] = min(common.get(label, (0, "")), (-count, other))
    rows = [
        {
            "label": str(label),
            "queries": int(count),
            "recall@1": float(r),
            "map@r": float(m),
            "confused_with": common[label][1] if label in common else None,
            "confused": -common[label][0] if label in common else 0,
        }
        for label, count, r, m in zip(classes, counts, recall, map_r)
    ]
    return sorted(rows, key=lambda row: (row["recall@1"], row["label"]))


def mistakes(scores: QueryScores, queries: Sequence[Item], gallery: Sequence[Item]) -> dict:
    """The metric set's part on mistakes: confusions, classes and first_hits."""
    first = FirstHits.of(scores, queries, gallery)
    return {
        "confusions": [confusion.to_dict() for confusion in confusions(first)],
        "classes": class_table(scores, first),
        "first_hits": first.to_list(),
    }


def compare_classes(ours: Sequence[dict], theirs: Sequence[dict], top: int = CHANGED) -> dict:
    """The classes both tables have, by the change of recall@1 from ours to theirs: the most improved (`better`), the
    most worsened (`worse`), each with both values and the change, and how many did not change."""
    before = {row["label"]: row for row in ours}
    changes = [
        {
            "label": row["label"],
            "queries": row["queries"],
            "before": before[row["label"]]["recall@1"],
            "after": row["recall@1"],
            "change": row["recall@1"] - before[row["label"]]["recall@1"],
        }
        for row in theirs
        if row["label"] in before
    ]
    better = sorted((row for row in changes if row["change"] > 0), key=lambda row: (-row["change"], row["label"]))
    worse = sorted((row for row in changes if row["change"] < 0), key=lambda row: (row["change"], row["label"]))
    return {
        "better": better[:top],
        "worse": worse[:top],
        "unchanged": sum(row["change"] == 0 for row in changes),
        "classes": len(changes),
    }
