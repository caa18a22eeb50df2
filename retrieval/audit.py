"""An audit of a collection from its embeddings: suspected wrong labels, copies, leaks into another collection, and
outliers (far from every other image, or unreadable).

Wrong labels: for each image (itself left out) the mean similarity of the CLOSEST images of each label
is found (fewer where a label has fewer); its `score` is how much the best other label's exceeds its
own label's, and that label is `suggested`. Suspects are the images with score > 0, the most suspect
first. Taking the few closest images, not a vote of k neighbours, serves classes of 2-5 images (a
vote is outnumbered by the big classes nearby) and classes spread in several clusters (a class mean
is not). Measured in bench/audit.py (docs/trust.md). Images alone in their label are not scored.

Outliers: images whose closest images (any label) are much farther than is usual in the collection:
the mean similarity of the CLOSEST is below the median by more than OUTLIER_SPREAD robust deviations
(chosen in bench/audit.py). A group of strangers close to each other is not found this way.
All of it is a few matrix products and one FAISS k-NN search: no Python loop per image.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

import numpy as np

from retrieval.data import LABELED_COLLECTION_HINT, Collection, Item, Skipped, as_collection, none_readable, same_images
from retrieval.duplicates import CANDIDATES, THUMBNAIL, CopyKind, CopyPair, copy_groups, find_copies
from retrieval.embedders import Embedder, embed_items
from retrieval.errors import RetrievalError
from retrieval.knn import Neighbours
from retrieval.runs import write_atomic

CLOSEST = 3  # the closest images of a label whose mean similarity is compared (chosen on held-out classes)
DEPTH = 50  # neighbours searched per image for the other labels' closest
OUTLIER_SPREAD = 4.0  # robust deviations (1.4826 x MAD) below the median closeness that make an outlier
LABELED_HINT = f"labels come from {LABELED_COLLECTION_HINT}"  # said where no image has a label to judge
WEAK_AGREEMENT = 0.7  # below this leave-one-out recall@1, many suspects are the model's mistakes (docs/trust.md)


class OutlierKind(Enum):
    """Why an image is listed among the outliers."""

    FAR = "far from every other image"
    UNREADABLE = "unreadable"


@dataclass(frozen=True)
class Suspect:
    """An image whose closest images agree on another label than its own."""

    path: Path
    label: str
    suggested: str
    score: float  # the suggested label's closeness minus its own label's (> 0)
    neighbours: tuple[Path, ...]  # the closest images of the suggested label, closest first

    def to_dict(self) -> dict:
        return {"path": str(self.path), "label": self.label, "suggested": self.suggested, "score": self.score}


@dataclass(frozen=True)
class Duplicate:
    """Two or more images of one collection that hold the same picture."""

    paths: tuple[Path, ...]
    kind: CopyKind  # identical bytes when every pair is, else near copy
    score: float  # 1 - the largest share of differing pixels among its pairs (1.0: identical)

    def to_dict(self) -> dict:
        return {"paths": [str(path) for path in self.paths], "score": self.score, "kind": self.kind.value}


@dataclass(frozen=True)
class Leak:
    """An image of the audited collection that is a copy of one in the other (--against)."""

    path: Path
    other: Path
    kind: CopyKind
    score: float

    def to_dict(self) -> dict:
        return {"path": str(self.path), "other": str(self.other), "score": self.score, "kind": self.kind.value}


@dataclass(frozen=True)
class Outlier:
    """An image far from every other one (score: its closeness), or a file that cannot be read (reason)."""

    path: Path
    kind: OutlierKind
    score: float | None = None
    reason: str = ""

    def to_dict(self) -> dict:
        return {"path": str(self.path), "kind": self.kind.value, "score": self.score, "reason": self.reason}


@dataclass
class Audit:
    """What an audit found; `to_dict` is what `retrieval audit --json` prints."""

    labels: list[Suspect] = field(default_factory=list)
    duplicates: list[Duplicate] = field(default_factory=list)
    leaks: list[Leak] = field(default_factory=list)
    outliers: list[Outlier] = field(default_factory=list)
    images: int = 0
    labeled: int = 0  # images with a label: the ones whose label is judged
    agreement: float | None = None  # see agreement(); None where nothing could be scored, or with --folds

    def to_dict(self) -> dict:
        return {
            "images": self.images,
            "labeled": self.labeled,
            "agreement": self.agreement,
            "labels": [suspect.to_dict() for suspect in self.labels],
            "duplicates": [duplicate.to_dict() for duplicate in self.duplicates],
            "leaks": [leak.to_dict() for leak in self.leaks],
            "outliers": [outlier.to_dict() for outlier in self.outliers],
        }


@dataclass(frozen=True)
class LabelScores:
    """Per image: how much the best other label's closest images beat its own label's, that label, and the rows of
    its closest images (score nan where the image's label has no other image)."""

    score: np.ndarray
    suggested: np.ndarray  # index into classes
    classes: list[str]
    closest: np.ndarray  # [M, 2] (row, one of the suggested label's closest images to it), closest first per row


def _own_closeness(vectors: np.ndarray, codes: np.ndarray, closest: int) -> np.ndarray:
    """Per image, the mean similarity of the `closest` most similar other images of its own label (nan if none)."""
    own = np.full(len(vectors), np.nan)
    for code in np.unique(codes):  # one small product per label
        rows = np.flatnonzero(codes == code)
        if len(rows) < 2:
            continue
        similar = vectors[rows] @ vectors[rows].T
        np.fill_diagonal(similar, -np.inf)
        top = -np.sort(-similar, axis=1)[:, : min(closest, len(rows) - 1)]
        own[rows] = top.mean(axis=1)
    return own


def label_scores(
    vectors: np.ndarray,
    labels: Sequence[str],
    closest: int = CLOSEST,
    depth: int = DEPTH,
    neighbours: Neighbours | None = None,
) -> LabelScores:
    """Each image's suspicion (see the module's text), from one k-NN search (or the neighbours of vectors already
    searched) and one product per label."""
    classes, codes = np.unique(np.asarray(labels), return_inverse=True)
    found = neighbours or Neighbours.of(vectors, depth)
    ids, similarities = found.first(depth)
    other = classes.size * np.arange(len(vectors))[:, None] + codes[ids]  # a (row, neighbour's label) key
    keep = codes[ids] != codes[:, None]
    keys, sims, rows = other[keep], similarities[keep], ids[keep]  # row-major: each row's neighbours closest first
    order = np.argsort(keys, kind="stable")
    keys, sims, rows = keys[order], sims[order], rows[order]
    starts = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]])
    rank = np.arange(len(keys)) - np.repeat(starts, np.diff(np.r_[starts, len(keys)]))
    top = rank < closest
    group = np.repeat(np.arange(len(starts)), np.diff(np.r_[starts, len(keys)]))[top]
    owner, label = keys[starts] // classes.size, keys[starts] % classes.size
    needed = np.minimum(closest, np.bincount(codes, minlength=classes.size)[label])
    found = np.bincount(group, minlength=len(starts))
    floor = similarities[owner, -1]  # what an image beyond the search can be at most
    means = (np.bincount(group, sims[top], minlength=len(starts)) + (needed - found) * floor) / needed
    ranked = np.lexsort((means, owner))  # by row, then closeness: each row's best label last
    last = ranked[np.r_[owner[ranked][1:] != owner[ranked][:-1], True]]
    best = np.full(len(vectors), -np.inf)
    suggested = np.zeros(len(vectors), np.int64)
    best[owner[last]], suggested[owner[last]] = means[last], label[last]
    alone = ~np.isfinite(best)  # every neighbour searched has the image's label: any other is farther than the last
    best[alone], suggested[alone] = similarities[alone, -1], codes[alone]
    chosen = label[group] == suggested[owner[group]]
    pairs = np.stack([keys[top][chosen] // classes.size, rows[top][chosen]], axis=1)
    return LabelScores(best - _own_closeness(vectors, codes, closest), suggested, classes.tolist(), pairs)


def suspects(
    items: Sequence[Item],
    vectors: np.ndarray,
    folds: Sequence[tuple[np.ndarray, np.ndarray]] = (),
    neighbours: Neighbours | None = None,
) -> list[Suspect]:
    """The labeled images whose closest images agree on another label, the most suspect first.

    folds: (vectors of every item by one fold's model, the rows that model did not train on) for each fold
    (--folds): each image is then scored in the space of the model that did not see it; vectors is unused.
    neighbours: those of vectors, already searched (used where every item is labeled and there are no folds).
    """
    labeled = np.flatnonzero([bool(item.label) for item in items])
    labels = [items[row].label for row in labeled]
    if len(set(labels)) < 2:
        return []
    spaces = folds or [(vectors, np.arange(len(items)))]
    score = np.full(len(labeled), -np.inf)
    suggested = np.zeros(len(labeled), np.int64)
    closest: list[np.ndarray] = []
    position = np.full(len(items), -1)
    position[labeled] = np.arange(len(labeled))
    shared = neighbours if not folds and len(labeled) == len(items) else None
    for space, rows in spaces:
        scores = label_scores(space[labeled], labels, neighbours=shared)
        mine = position[rows][position[rows] >= 0]
        score[mine], suggested[mine] = np.nan_to_num(scores.score[mine], nan=-np.inf), scores.suggested[mine]
        closest.append(scores.closest[np.isin(scores.closest[:, 0], mine)])
    flagged = np.flatnonzero(score > 0)
    flagged = flagged[np.argsort(-score[flagged], kind="stable")]
    return _suspects(
        items, labeled, flagged, score, [scores.classes[code] for code in suggested], np.concatenate(closest)
    )


def _suspects(
    items: Sequence[Item],
    labeled: np.ndarray,
    flagged: np.ndarray,
    score: np.ndarray,
    suggested: list[str],
    closest: np.ndarray,
) -> list[Suspect]:
    neighbours: dict[int, list[Path]] = {}
    for row, neighbour in closest[np.isin(closest[:, 0], flagged)].tolist():
        neighbours.setdefault(row, []).append(items[labeled[neighbour]].path)
    return [
        Suspect(
            items[labeled[row]].path,
            items[labeled[row]].label,
            suggested[row],
            round(float(score[row]), 4),
            tuple(neighbours.get(int(row), [])),
        )
        for row in flagged
    ]


def agreement(items: Sequence[Item], vectors: np.ndarray, neighbours: Neighbours | None = None) -> float | None:
    """The share of labeled images (of labels with two or more) whose closest other labeled image has their label:
    leave-one-out recall@1, how far the model's neighbours can judge the labels (None: no such image)."""
    labels = np.asarray([item.label for item in items])
    classes, counts = np.unique(labels[labels != ""], return_counts=True)
    rows = np.flatnonzero(np.isin(labels, classes[counts > 1]))
    if not len(rows):
        return None
    ids = (neighbours or Neighbours.of(vectors, DEPTH)).ids[rows]
    labeled = labels[ids] != ""
    first = ids[np.arange(len(rows)), np.argmax(labeled, axis=1)]  # a row without one: no labeled image close
    return float(np.mean(labeled.any(axis=1) & (labels[first] == labels[rows])))


def describe_agreement(share: float | None) -> str:
    """The agreement in words, with a caution where it is weak (empty where there is none)."""
    if share is None:
        return ""
    line = f"the closest image has the same label for {share:.0%} of the labeled images (leave-one-out recall@1)"
    if share < WEAK_AGREEMENT:
        line += ": at this level many suspects are the model's mistakes rather than the labels' (docs/trust.md)"
    return line


def check_folds(labels: Sequence[str], folds: int) -> None:
    """Refuses a fold count that leaves a fold without some label (or fewer than two folds), in one line."""
    smallest = int(min(np.unique(np.asarray(labels), return_counts=True)[1], default=0))
    if 2 <= folds <= smallest:
        return
    if smallest < 2:
        raise RetrievalError(
            f"--folds {folds}: a label has a single image, which no fold can both leave out and learn; "
            "audit without --folds, or give each label two images or more"
        )
    raise RetrievalError(
        f"--folds {folds}: every fold must hold an image of every label, and the smallest label has {smallest}; "
        f"give --folds between 2 and {smallest}"
    )


def closeness(vectors: np.ndarray, neighbours: Neighbours | None = None) -> np.ndarray:
    """How close each image is to the rest of the collection: the mean similarity of its CLOSEST other images
    (neighbours: those of vectors, already searched)."""
    _, similarities = (neighbours or Neighbours.of(vectors, CLOSEST)).first(CLOSEST)
    return similarities.mean(axis=1)


def outliers(
    items: Sequence[Item], vectors: np.ndarray, skipped: Sequence[Skipped] = (), neighbours: Neighbours | None = None
) -> list[Outlier]:
    """Images far from every other image: their closeness far below the collection's usual, the farthest first;
    then the files that could not be read (neighbours: those of vectors, already searched)."""
    found: list[Outlier] = []
    if len(vectors) > CLOSEST + 1:
        close = closeness(vectors, neighbours)
        median = float(np.median(close))
        spread = 1.4826 * float(np.median(np.abs(close - median))) or 1e-6
        far = np.flatnonzero(close < median - OUTLIER_SPREAD * spread)
        found = [
            Outlier(items[row].path, OutlierKind.FAR, round(float(close[row]), 4))
            for row in far[np.argsort(close[far], kind="stable")]
        ]
    return found + [Outlier(entry.path, OutlierKind.UNREADABLE, reason=entry.reason) for entry in skipped]


@dataclass(frozen=True)
class AuditedCollection:
    """A collection as the audit sees it: the readable items with their vectors, file digests and thumbnails, and
    the files that could not be read."""

    items: list[Item]
    vectors: np.ndarray
    digests: list[str]
    thumbnails: np.ndarray
    skipped: list[Skipped] = field(default_factory=list)


def embed_collection(
    embedder: Embedder, collection: Collection | str | Path, progress: bool = True
) -> AuditedCollection:
    """A collection (or its path, read as load_collection reads it) as the audit sees it: embedded with its
    thumbnails kept, on which the copies are checked; what cannot be read is kept as skipped."""
    collection = as_collection(collection)
    done = embed_items(embedder, collection.items, progress=progress, thumbnail=THUMBNAIL)
    skipped = collection.skipped + done.skipped
    if not done.items:
        raise none_readable(collection.source, skipped)
    return AuditedCollection(done.items, done.vectors, done.hashes, done.thumbnails, skipped)  # type: ignore[arg-type]


def duplicates(
    collection: AuditedCollection, shown: bool = False, neighbours: Neighbours | None = None
) -> list[Duplicate]:
    """The groups of images of a collection that hold the same picture, largest first (shown: progress bars;
    neighbours: those of its vectors, already searched)."""
    pairs = find_copies(
        collection.vectors, collection.digests, collection.thumbnails, shown=shown, neighbours=neighbours
    )
    groups = copy_groups(pairs, len(collection.items))
    group_of = {row: number for number, rows in enumerate(groups) for row in rows}
    pairs_of: list[list[CopyPair]] = [[] for _ in groups]
    for pair in pairs:
        pairs_of[group_of[pair.a]].append(pair)
    found = []
    for rows, inside in zip(groups, pairs_of, strict=True):
        kind = CopyKind.IDENTICAL if all(pair.kind is CopyKind.IDENTICAL for pair in inside) else CopyKind.NEAR
        score = round(1 - max(pair.difference for pair in inside), 4)
        found.append(Duplicate(tuple(collection.items[row].path for row in rows), kind, score))
    return found


def leaks(collection: AuditedCollection, other: AuditedCollection, shown: bool = False) -> list[Leak]:
    """The images of collection that are copies of one in other, each with its closest copy there (shown: progress
    bars)."""
    gallery = (other.vectors, other.digests, other.thumbnails)
    pairs = find_copies(collection.vectors, collection.digests, collection.thumbnails, gallery, shown=shown)
    first: dict[int, CopyPair] = {}
    for pair in pairs:  # identical bytes first, then the most alike
        first.setdefault(pair.a, pair)
    return [
        Leak(collection.items[pair.a].path, other.items[pair.b].path, pair.kind, round(1 - pair.difference, 4))
        for pair in first.values()
    ]


def audit(
    collection: AuditedCollection,
    other: AuditedCollection | None = None,
    folds: Sequence[tuple[np.ndarray, np.ndarray]] = (),
    shown: bool = False,
) -> Audit:
    """Every finding of an audit of collection (and its leaks into other; folds: see suspects; shown: progress bars of
    the copy checks, the audit's long part). The collection's neighbours are searched once, for all three parts
    that need them."""
    _require_parts(collection, other, folds)
    if other is not None and same_images(collection.items, other.items):
        raise RetrievalError(
            "other: the same images as the collection audited, each of which would be listed as a leak of itself; "
            "give another collection, e.g. the training images when the collection is a test split"
        )
    several = len(collection.vectors) > 1  # one image has no neighbour to search for
    shared = Neighbours.of(collection.vectors, max(DEPTH, CANDIDATES, CLOSEST)) if several else None
    return Audit(
        labels=suspects(collection.items, collection.vectors, folds, shared),
        duplicates=duplicates(collection, shown, shared),
        leaks=leaks(collection, other, shown) if other is not None else [],
        outliers=outliers(collection.items, collection.vectors, collection.skipped, shared),
        images=len(collection.items) + len(collection.skipped),
        labeled=sum(bool(item.label) for item in collection.items),
        agreement=agreement(collection.items, collection.vectors, shared) if several and not folds else None,
    )


def _require_parts(collection: object, other: object, folds: object) -> None:
    """Refuses, in one line each, what audit cannot take: a path or None for a collection (an AttributeError deep in
    it), a number of folds where each fold's vectors go ("'int' object is not iterable")."""
    for part in [collection] if other is None else [collection, other]:
        if not isinstance(part, AuditedCollection):
            raise RetrievalError(
                f"audit takes collections as retrieval.audit.embed_collection(embedder, 'photos') gives them (vectors, "
                f"digests and thumbnails), not {type(part).__module__}.{type(part).__name__}"
            )
    if not isinstance(folds, Sequence) or not all(isinstance(fold, tuple) and len(fold) == 2 for fold in folds):
        raise RetrievalError(
            f"folds={folds!r}: give (vectors of every image by one fold's model, the rows it did not train on) for "
            "each fold; `retrieval audit --folds K` trains the K models (training.folds.fold_models)"
        )


CSV_COLUMNS = {  # the files write_csvs writes, and their columns
    "labels.csv": ["path", "label", "suggested", "score"],
    "duplicates.csv": ["paths", "score", "kind"],
    "leaks.csv": ["path", "other", "score", "kind"],
    "outliers.csv": ["path", "kind", "score", "reason"],
}


def require_csv_folder(folder: Path, option: str = "--csv") -> None:
    """Refuses a folder where write_csvs would replace a file an audit did not write (its first line is not that
    file's header): a collection's own labels.csv, or the decisions the app keeps in a run's labels.csv."""
    taken = []
    for name, columns in CSV_COLUMNS.items():
        path = folder / name
        if path.exists():
            try:
                with path.open(encoding="utf-8-sig") as handle:
                    first = handle.readline().strip()
            except (OSError, UnicodeDecodeError):
                first = ""
            if first != ",".join(columns):
                taken.append(name)
    if taken:
        raise RetrievalError(
            f"{option} {folder}: {', '.join(taken)} there is not an audit's, and writing would replace it; give "
            f"another folder, e.g. {folder / 'audit'}"
        )


def write_csvs(found: Audit, folder: Path) -> list[Path]:
    """labels.csv, duplicates.csv, leaks.csv and outliers.csv in folder (one row per finding, the JSON's fields); a
    folder holding such a file that an audit did not write is refused (require_csv_folder)."""
    require_csv_folder(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rows_of = {
        "labels.csv": [s.to_dict() for s in found.labels],
        "duplicates.csv": [{**d.to_dict(), "paths": "|".join(map(str, d.paths))} for d in found.duplicates],
        "leaks.csv": [leak.to_dict() for leak in found.leaks],
        "outliers.csv": [o.to_dict() for o in found.outliers],
    }
    written = []
    for name, columns in CSV_COLUMNS.items():
        rows = rows_of[name]
        text = io.StringIO()
        writer = csv.DictWriter(text, columns, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        write_atomic(folder / name, text.getvalue().encode("utf-8"))
        written.append(folder / name)
    return written
