"""Evaluation of an embedder on labeled collections, with the metrics of retrieval.metrics.

Protocols: leave-one-out within one collection (the default), leave-one-out on a class-disjoint
held-out part of it (split_classes), or a separate query set against a gallery (the In-Shop protocol).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from retrieval.calibration import DEFAULT_TARGET, MatchThreshold, calibrate, require_target, store_threshold
from retrieval.data import (
    VARIANTS,
    Collection,
    Item,
    Skipped,
    as_collection,
    describe_variants,
    first_skipped,
    label_variants,
    load_collection,
    none_readable,
    one_level_too_high,
    shared_paths,
    split_by_class,
)
from retrieval.embedders import Embedder, embed_items, require_embedder
from retrieval.errors import RetrievalError
from retrieval.metrics import (
    QueryScores,
    Ranking,
    clustering_metrics,
    embedding_diagnostics,
    require_ks,
    score_queries,
)
from retrieval.mistakes import mistakes
from retrieval.rerank import NO_RERANK, Rerank
from retrieval.runs import RunDir, read_json
from retrieval.wording import counted

WORST_CLASSES = 10  # classes listed in metrics.json, lowest recall@1 first


@dataclass(frozen=True)
class TrainedOn:
    """The training data a run's model card names, and how many images of each collection given are in it."""

    data: str
    counts: list[int]


def trained_share(run: RunDir, collections: list[Collection]) -> TrainedOn | None:
    """What of collections the run trained on; None where its card names no training data or the data is no longer
    where it was."""
    trained_on = read_json(run.model_card).get("trained_on") if run.model_card.is_file() else None
    if not trained_on or not Path(trained_on).exists():
        return None
    try:  # load_collection's paths are resolved: compared as they are, no system call per image
        seen = {item.path for item in load_collection(Path(trained_on)).items}
    except RetrievalError:  # moved or changed since: nothing to say about it
        return None
    return TrainedOn(trained_on, [sum(item.path in seen for item in c.items) for c in collections])


def share_text(count: int, total: int) -> str:
    """ "all 1,004" or "3 of the 8": how many of the images a note speaks of."""
    return f"all {total:,}" if count == total else f"{count:,} of the {total:,}"


def require_held_out(run: RunDir, collections: list[Collection], asked: str = "--calibrate") -> None:
    """Refuses to calibrate on images the run trained on (its hits there are over-confident), when its training data
    is still where it was (asked: what the line names, the option or the Python function)."""
    refuse_trained(run, collections, trained_share(run, collections), asked)


def refuse_trained(run: RunDir, collections: list[Collection], trained: TrainedOn | None, asked: str) -> None:
    """require_held_out with the run's share of collections already counted (trained_share), for a caller that
    reports it as well."""
    if trained is None:
        return
    for collection, shared in zip(collections, trained.counts, strict=True):
        if not shared:
            continue
        which = (
            f"{shared:,} of the {len(collection.items):,} images of {collection.source} are in {trained.data}, which"
        )
        if Path(trained.data).resolve() == collection.source:
            which = f"{collection.source} is what"
        raise RetrievalError(
            f"{asked}: {which} {run.root} trained on, where its hits are over-confident; give labeled images it "
            "did not train on"
        )


@dataclass
class Evaluation:
    """Metrics of one embedder on one protocol, the per-query scores and embeddings they came from, and the files
    left out."""

    metrics: dict
    skipped: list[Skipped]
    vectors: np.ndarray  # the query embeddings (leave-one-out: all of them)
    queries: list[Item]  # the embedded query items, in the order of vectors
    gallery: list[Item]  # the embedded gallery items (leave-one-out: the queries)
    scores: QueryScores

    @property
    def labels(self) -> list[str]:
        """The query labels, in the order of vectors."""
        return [item.label for item in self.queries]

    def unscored(self) -> Counter[str]:
        """The labels of the queries not scored (no other image of their label where they were searched), with how
        many queries each."""
        rows = np.setdiff1d(np.arange(len(self.queries)), self.scores.queries)
        return Counter(self.queries[row].label for row in rows)

    def class_recall(self) -> dict[str, tuple[float, int]]:
        """recall@1 of each query label, averaged over its scored queries, with their number."""
        return class_recall(self.scores, self.labels)

    def worst_queries(self, count: int) -> list[int]:
        """Positions (in scores) of the worst scored queries: lowest MAP@R, then the most confident top result."""
        order = np.lexsort((-self.scores.similarities[:, 0], self.scores.values["map@r"]))
        return order[:count].tolist()


def calibrate_run(
    run: RunDir | str | Path, evaluation: Evaluation, target: float = DEFAULT_TARGET, images: str | None = None
) -> MatchThreshold:
    """`retrieval evaluate RUN IMAGES --calibrate` from Python: the match threshold fitted on an evaluation, by one of
    the run's models, of labeled images it did not train on, stored in its model card (images: the set's name there,
    by default its path). Search marks hits with it: Query(threshold=run_threshold(run))."""
    run = RunDir.of(run)
    run.require_model()
    require_target(target, "target")
    if not isinstance(evaluation, Evaluation):
        raise RetrievalError(
            f"evaluation: {type(evaluation).__name__} given; give what evaluate_collection (or evaluate_query_gallery) "
            "returns for the run's model"
        )
    encoder = str(evaluation.metrics.get("encoder"))
    if encoder not in run.fingerprints().values():
        raise RetrievalError(
            f"evaluation: scored by encoder {encoder[:12]}…, not by a model of {run.root}; evaluate with "
            f"OnnxEmbedder.from_run({str(run.root)!r})"
        )
    source = evaluation.metrics.get("images") or evaluation.metrics["queries"]
    sets = [Collection(Path(source), evaluation.queries)]
    if "gallery" in evaluation.metrics:
        sets.append(Collection(Path(evaluation.metrics["gallery"]), evaluation.gallery))
    require_held_out(run, sets, "calibrate_run")
    name = str(source) if images is None else images
    fitted = calibrate(evaluation.scores, evaluation.labels, target, name, str(evaluation.metrics["rerank"]))
    store_threshold(run.model_card, fitted)
    return fitted


def class_recall(scores: QueryScores, labels: Sequence[str]) -> dict[str, tuple[float, int]]:
    """recall@1 of each query label, averaged over its scored queries, with their number."""
    classes, codes = np.unique(np.asarray(labels)[scores.queries], return_inverse=True)
    counts = np.bincount(codes)
    means = np.bincount(codes, weights=scores.values["recall@1"]) / counts
    return {str(label): (float(mean), int(count)) for label, mean, count in zip(classes, means, counts)}


def _embed_labeled(
    embedder: Embedder, collection: Collection, progress: bool
) -> tuple[np.ndarray, list[Item], list[Skipped]]:
    """Embeds the labeled items of a collection; unlabeled and unreadable ones are returned as skipped."""
    labeled = [item for item in collection.items if item.label]
    skipped = collection.skipped + [Skipped(item.path, "no label") for item in collection.items if not item.label]
    if not labeled:
        raise RetrievalError(f"{collection.source}: no labeled image (ROOT/<label>/<image> or a CSV with labels)")
    embedded = embed_items(embedder, labeled, progress=progress)
    if not embedded.items:
        raise none_readable(collection.source, collection.skipped + embedded.skipped)
    return embedded.vectors, embedded.items, skipped + embedded.skipped


def evaluate_collection(
    embedder: Embedder,
    collection: Collection | str | Path,
    ks: Sequence[int] = (1, 5, 10),
    progress: bool = True,
    split_classes: float = 0.0,
    seed: int = 0,
    rerank: Rerank = NO_RERANK,
) -> Evaluation:
    """Scores leave-one-out retrieval over a labeled collection (or over a seeded held-out fraction of its
    classes), with NMI/AMI and the embedding diagnostics; the lists re-ranked by rerank (retrieval.rerank). A path
    given for the collection is read as load_collection reads it."""
    require_ks(ks)
    embedder, collection = require_embedder(embedder), as_collection(collection)
    protocol = "leave-one-out"
    if split_classes:
        labeled = [item for item in collection.items if item.label]
        _, held_out = split_by_class(labeled, split_classes, seed)
        protocol = f"leave-one-out on {split_classes:g} of the classes (seed {seed})"
        collection = replace(collection, items=held_out)
    labels = {item.label for item in collection.items if item.label}
    if len(labels) < 2:
        missing = collection.skipped  # the other classes' files may be the ones not found
        gone = (
            f" ({counted(len(missing), 'listed file')} skipped; the first, {first_skipped(missing)})" if missing else ""
        )
        raise RetrievalError(
            f"{collection.source}: evaluation needs at least two labeled classes (ROOT/<label>/<image> or a CSV with "
            f"labels){gone}{one_level_too_high(collection.source, labels)}"
        )
    vectors, items, skipped = _embed_labeled(embedder, collection, progress)
    described = {"protocol": protocol, "images": str(collection.source), "encoder": embedder.fingerprint}
    return evaluate_embedded(vectors, items, skipped, {**described, **seen_without_labels(embedder)}, ks, rerank)


def evaluate_embedded(
    vectors: np.ndarray,
    items: list[Item],
    skipped: list[Skipped],
    described: dict,
    ks: Sequence[int] = (1, 5, 10),
    rerank: Rerank = NO_RERANK,
    search: Ranking | None = None,
) -> Evaluation:
    """Scores leave-one-out retrieval over embeddings already made (of labeled items, in their order),
    e.g. the vectors an index stores; described (protocol, images, encoder) goes into the metrics.
    search: rank with it instead of exact search (a deployed index's own, index.search.deployed_ranking)."""
    labels = [item.label for item in items]
    if len(set(labels)) < 2:
        raise RetrievalError(
            f"{described.get('images', 'the collection')}: fewer than two classes have readable images"
        )
    scores = score_queries(vectors, labels, ks=ks, rerank=NO_RERANK if search else rerank, search=search)
    return _evaluation(scores, vectors, items, items, skipped, {**described, "rerank": rerank.describe()})


def evaluate_query_gallery(
    embedder: Embedder,
    queries: Collection | str | Path,
    gallery: Collection | str | Path,
    ks: Sequence[int] = (1, 5, 10),
    progress: bool = True,
    rerank: Rerank = NO_RERANK,
) -> Evaluation:
    """Scores each query against a separate gallery (neither contains the other's items: refused); a path is read as
    load_collection reads it."""
    require_ks(ks)
    embedder, queries, gallery = require_embedder(embedder), as_collection(queries), as_collection(gallery)
    _refuse_shared(queries, gallery)
    _refuse_disjoint(queries, gallery)
    query_vectors, query_items, skipped = _embed_labeled(embedder, queries, progress)
    gallery_vectors, gallery_items, gallery_skipped = _embed_labeled(embedder, gallery, progress)
    scores = score_queries(
        query_vectors,
        [item.label for item in query_items],
        gallery_vectors,
        [item.label for item in gallery_items],
        ks=ks,
        rerank=rerank,
    )
    described = {
        "queries": str(queries.source),
        "gallery": str(gallery.source),
        "encoder": embedder.fingerprint,
        "rerank": rerank.describe(),
        **seen_without_labels(embedder),
    }
    return _evaluation(scores, query_vectors, query_items, gallery_items, skipped + gallery_skipped, described)


def _refuse_disjoint(queries: Collection, gallery: Collection) -> None:
    """Raises RetrievalError before any embedding where no query's label is a gallery label (nothing to score),
    naming labels written alike but for case (APPLE against apple) as the likely reason."""
    asked, held = {item.label for item in queries.items if item.label}, {item.label for item in gallery.items}
    if not asked or asked & held:
        return  # (no label at all is said where the images are embedded)
    line = (
        f"no query label is a gallery label: the queries ({queries.source}) have {_some(asked)} and the gallery "
        f"({gallery.source}) {_some(held - {''})}"
    )
    groups = label_variants(queries.items + gallery.items)
    raise RetrievalError(line + (f"; {VARIANTS}: {describe_variants(groups)}" if groups else ""))


def _some(labels: set[str], shown: int = 3) -> str:
    """The first labels in order, quoted, with ... where there are more."""
    return ", ".join(map(repr, sorted(labels)[:shown])) + (", ..." if len(labels) > shown else "")


def _refuse_shared(queries: Collection, gallery: Collection) -> None:
    """Raises RetrievalError where query images are gallery images too (the same folder given as both): each would
    find itself at rank 1, and recall@1 read 1.000."""
    queried = [item for item in queries.items if item.label]  # the ones scored
    shared = shared_paths(queried, [item for item in gallery.items if item.label])
    if shared:
        raise RetrievalError(
            f"the queries ({queries.source}) and the gallery ({gallery.source}) share {len(shared)} of the "
            f"{len(queried)} query images (e.g. {shared[0]}): each would find itself first; give the images once, "
            "as IMAGES, for leave-one-out, or a gallery without the queries"
        )


SEEN = "seen without labels"  # the metrics' key naming the gallery an adapted model trained on
TRAINED = "images trained on"  # the metrics' key counting the images evaluated that the run trained on, where any


def seen_without_labels(embedder: Embedder) -> dict:
    """{SEEN: the gallery} when the embedder's model adapted to one in training (--adapt), else {}."""
    gallery = getattr(embedder, "card", {}).get("seen_without_labels")
    return {SEEN: gallery} if gallery else {}


def linear_probe(vectors: np.ndarray, labels: Sequence[str], share: float = 0.3, seed: int = 0) -> dict:
    """Top-1 accuracy of a linear classifier on frozen embeddings (SupCon's stage 2), trained on a seeded,
    class-stratified 1 - share of the images and tested on the rest (classes of one image: training only)."""
    from sklearn.linear_model import LogisticRegression

    labels = np.asarray(labels)
    rng = np.random.default_rng(seed)
    test = np.zeros(len(labels), bool)
    for label in np.unique(labels):
        rows = rng.permutation(np.flatnonzero(labels == label))
        if len(rows) >= 2:
            test[rows[: max(1, round(share * len(rows)))]] = True
    if len(np.unique(labels[~test])) < 2 or not test.any():
        raise RetrievalError("--linear needs at least two classes with two or more labeled images each")
    classifier = LogisticRegression(max_iter=2000, C=10.0).fit(vectors[~test], labels[~test])
    accuracy = float(np.mean(classifier.predict(vectors[test]) == labels[test]))
    return {"linear top-1": accuracy, "linear test images": int(test.sum()), "linear train images": int((~test).sum())}


def _evaluation(
    scores: QueryScores,
    vectors: np.ndarray,
    queries: list[Item],
    gallery: list[Item],
    skipped: list[Skipped],
    described: dict,
) -> Evaluation:
    """The metric set of one protocol: the scores' summary, NMI/AMI and the diagnostics of the queries
    (when they hold two classes or more), the classes with the lowest recall@1, and the description."""
    labels = [item.label for item in queries]
    metrics = scores.summary()
    if len(set(labels)) >= 2:
        metrics.update({**clustering_metrics(vectors, labels), **embedding_diagnostics(vectors, labels)})
    worst = sorted(class_recall(scores, labels).items(), key=lambda entry: (entry[1][0], entry[0]))[:WORST_CLASSES]
    metrics["worst_classes"] = [
        {"label": label, "recall@1": value, "queries": count} for label, (value, count) in worst
    ]
    metrics.update(mistakes(scores, queries, gallery))
    return Evaluation({**metrics, **described}, skipped, vectors, queries, gallery, scores)


def write_plots(evaluation: Evaluation, folder: Path, worst: int = 8, shown: int = 5) -> list[Path]:
    """Writes the recall@k curve, the similarity histograms, the per-class recall@1 distribution, the
    grid of the worst queries with their top results, the most confused class pairs with examples and
    (with two labels or more) the embedding diagnostics into folder; returns the files."""
    from retrieval.plots import (
        plot_class_recall,
        plot_confusions,
        plot_diagnostics,
        plot_recall_curves,
        plot_similarity_histograms,
        plot_worst_queries,
    )

    rows = []
    for position in evaluation.worst_queries(worst):
        results = [
            (evaluation.gallery[index], float(score))
            for index, score in zip(
                evaluation.scores.neighbours[position, :shown], evaluation.scores.similarities[position, :shown]
            )
        ]
        rows.append((evaluation.queries[evaluation.scores.queries[position]], results))
    return [
        plot_recall_curves(
            {"": evaluation.metrics["cmc"]}, folder / "recall_at_k.png", f"recall@k ({evaluation.metrics['protocol']})"
        ),
        plot_similarity_histograms(evaluation.vectors, evaluation.labels, folder / "similarities.png"),
        plot_class_recall(evaluation.class_recall(), folder / "class_recall.png"),
        plot_worst_queries(rows, folder / "worst_queries.png"),
        plot_confusions(evaluation.metrics["confusions"], folder / "confusions.png"),
        *(
            [plot_diagnostics(evaluation.metrics, folder / "diagnostics.png")]
            if "tolerance" in evaluation.metrics
            else []
        ),
    ]
