"""`retrieval evaluate`: retrieval metrics of the run's exported model on labeled images, with plots."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from retrieval.calibration import DEFAULT_TARGET, require_target
from retrieval.commands.output import (
    BenchmarkOption,
    IndexOption,
    ModelOption,
    RunArg,
    class_changes_table,
    confusion_table,
    console,
    metrics_table,
    option_named,
    parse_ks,
    report_skipped,
)
from retrieval.data import Collection
from retrieval.errors import RetrievalError
from retrieval.rerank import SPEC_HELP as RERANK_HELP
from retrieval.rerank import Rerank, parse_rerank
from retrieval.runs import RunDir, read_json, write_json

if TYPE_CHECKING:
    from retrieval.evaluation import Evaluation, TrainedOn

IMAGES_HELP = (
    "A labeled collection to score leave-one-out, or with --benchmark "
    "the extracted archive (omit it with --query/--gallery)."
)
SPLIT_HELP = "Score only a seeded, class-disjoint fraction of the classes of IMAGES (0: all)."
COMPARE_HELP = "A second run directory, scored on the same protocol and shown side by side."
LINEAR_HELP = (
    "Also the top-1 accuracy of a linear classifier on the frozen embeddings (SupCon's stage 2), trained on a seeded "
    "70 % of each class's images and tested on the rest."
)
CALIBRATE_HELP = (
    "Fit the match threshold on IMAGES (labeled images the run did not train on) and store it in the model card: "
    "search then marks each hit a match or not (docs/trust.md)."
)
JSON_HELP = (
    "Print the saved metric set as one JSON object (with the per-class table, the confused pairs, each query's first "
    "hit and, with --compare, the comparison) instead of tables."
)
TARGET_HELP = "The top-1 precision the match threshold is fitted for (--calibrate)."
DEPLOYED_HELP = (
    "Score the index as deployed (its type, tuned depth and re-scoring) beside exact search, leave-one-out over "
    "its labeled items; no IMAGES."
)


def evaluate(
    run: RunArg,
    images: Annotated[Path | None, typer.Argument(help=IMAGES_HELP, show_default=False)] = None,
    k: Annotated[
        str, typer.Option("-k", "--k", help="Comma-separated k values for recall@k and precision@k.")
    ] = "1,5,10",
    query: Annotated[
        Path | None, typer.Option("--query", help="Query images, scored against --gallery (the In-Shop protocol).")
    ] = None,
    gallery: Annotated[Path | None, typer.Option("--gallery", help="Gallery images for --query.")] = None,
    split_classes: Annotated[float, typer.Option(help=SPLIT_HELP)] = 0.0,
    seed: Annotated[int, typer.Option(help="Seed of --split-classes and --linear.", min=0)] = 0,
    benchmark: BenchmarkOption = None,
    compare: Annotated[Path | None, typer.Option("--compare", help=COMPARE_HELP, show_default=False)] = None,
    rerank: Annotated[str, typer.Option(help=RERANK_HELP)] = "none",
    model: ModelOption = "float32",
    deployed: Annotated[bool, typer.Option("--deployed", help=DEPLOYED_HELP)] = False,
    index_dir: IndexOption = None,
    linear: Annotated[bool, typer.Option("--linear", help=LINEAR_HELP)] = False,
    calibrate: Annotated[bool, typer.Option("--calibrate", help=CALIBRATE_HELP)] = False,
    target_precision: Annotated[float, typer.Option(help=TARGET_HELP)] = DEFAULT_TARGET,
    as_json: Annotated[bool, typer.Option("--json", help=JSON_HELP)] = False,
) -> None:
    """Score retrieval on images; writes RUN/metrics/<set>.json, RUN/metrics.json (the latest), RUN/plots/.

    Labeled images get the metrics of metric learning; images without labels get quality figures
    from augmented copies (each image, changed, must find itself: copy recall@1, alignment,
    uniformity). Each evaluated source and protocol keeps its own file, named after it (IMAGES'
    name, Q-vs-G, the benchmark's); the app shows them side by side. With --compare, also
    RUN/comparison.json. With --calibrate, the match threshold goes into RUN/model.json; a calibrated
    run's evaluation shows the precision and coverage of its threshold on the images evaluated.
    Below the metrics, the class pairs most often confused; --compare adds the classes that got
    better and worse; --json prints it all (the saved metric set) as one JSON object instead.
    """
    arguments = {name: value for name, value in locals().items() if name != "as_json"}
    with _quiet(as_json):
        _evaluate(**arguments)
    if as_json:  # what was saved: the latest metric set, and the comparison
        saved = read_json(RunDir(run).metrics)
        comparison = read_json(RunDir(run).root / "comparison.json") if compare is not None else None
        print(json.dumps({**saved, **({"comparison": comparison} if comparison else {})}, indent=2))


@contextmanager
def _quiet(quiet: bool) -> Iterator[None]:
    """Keeps the tables and notes off stdout while --json prints the result there."""
    console.quiet = quiet
    try:
        yield
    finally:
        console.quiet = False


def _evaluate(
    run: Path,
    images: Path | None,
    k: str,
    query: Path | None,
    gallery: Path | None,
    split_classes: float,
    seed: int,
    benchmark: str | None,
    compare: Path | None,
    rerank: str,
    model: str,
    deployed: bool,
    index_dir: Path | None,
    linear: bool,
    calibrate: bool,
    target_precision: float,
) -> None:
    """What `retrieval evaluate` does with its parsed options."""
    ks = parse_ks(k)
    reranker = parse_rerank(rerank)
    _refuse_early(run, compare, target_precision, calibrate, split_classes)
    if index_dir is not None and not deployed:  # it was ignored: the images were scored against each other
        raise RetrievalError(f"--index {index_dir} names the index --deployed scores: add --deployed")
    if seed and not (split_classes or linear):
        raise RetrievalError(f"--seed {seed} seeds --split-classes and --linear: add one, or leave --seed out")
    if deployed:
        if images is not None or query is not None or benchmark or compare is not None or calibrate:
            raise RetrievalError(
                "--deployed scores the run's index itself; give no IMAGES, --query, --compare or --calibrate"
            )
        _deployed(RunDir(run), index_dir, ks, reranker, model)
        return
    from retrieval.evaluation import TRAINED, refuse_trained, trained_share

    sources = _sources(images, query, gallery, split_classes, benchmark)
    collections = [source for source in sources if source is not None]
    if sources[0] is not None and not any(item.label for item in sources[0].items):
        if linear or compare is not None or calibrate:
            raise RetrievalError(f"{images}: has no labels; --linear, --compare and --calibrate need labeled images")
        _label_free(RunDir(run), sources[0], Path(str(images)), model)
        return
    trained = trained_share(RunDir(run), collections)  # listed once: for --calibrate's refusal and the note below
    if calibrate:
        refuse_trained(RunDir(run), collections, trained, "--calibrate")
    evaluation = _score(run, sources, ks, split_classes, seed, reranker, model)
    if benchmark:
        evaluation.metrics["benchmark"] = benchmark
    if linear:
        from retrieval.evaluation import linear_probe

        evaluation.metrics.update(linear_probe(evaluation.vectors, evaluation.labels, seed=seed))
    name = _set_name(images, query, gallery, split_classes, seed, benchmark)
    _match(RunDir(run), evaluation, name, reranker, target_precision if calibrate else None)
    name += (f"-{reranker.method}" if reranker.active else "") + ("-int8" if model == "int8" else "")
    compared = (lambda: _score(compare, sources, ks, split_classes, seed, reranker, model).metrics) if compare else None
    if trained is not None and sum(trained.counts):  # the app says so beside the figures, as the line below does
        evaluation.metrics[TRAINED] = sum(trained.counts)
    _report(RunDir(run), name, evaluation, compare, compared)
    _say_trained_on(RunDir(run), trained, collections)


def _refuse_early(run: Path, compare: Path | None, target_precision: float, calibrate: bool, split: float) -> None:
    """A --compare run that is this one or has no model, --calibrate's target out of range or without a model, a
    target given without --calibrate (it was ignored), and a --split-classes fraction out of range: said before this
    run's images are embedded."""
    if not 0.0 <= split < 1.0:
        raise RetrievalError(
            f"--split-classes {split:g}: give a fraction of the classes from 0 (all) to below 1, e.g. 0.5"
        )
    if compare is not None:
        if compare.resolve() == run.resolve():
            raise RetrievalError(f"--compare {compare}: the run being evaluated; give another run to compare it with")
        RunDir(compare).require_model()
    if not calibrate and target_precision != DEFAULT_TARGET:
        raise RetrievalError(f"--target-precision {target_precision:g} sets what --calibrate fits: add --calibrate")
    if calibrate:
        require_target(target_precision)
        RunDir(run).require_model()


def _report(
    run_dir: RunDir, name: str, evaluation: Evaluation, compare: Path | None, compared: Callable[[], dict] | None
) -> None:
    """Saves the metrics and plots of an evaluation, and prints them (beside a compared run's, with --compare), and
    the queries it could not score."""
    from retrieval.evaluation import SEEN, write_plots

    metrics = evaluation.metrics
    saved = run_dir.save_metrics(name, metrics)
    write_plots(evaluation, run_dir.plots)
    report_skipped(evaluation.skipped, None)
    columns, changes = {run_dir.root.name: metrics}, None
    if compare is not None and compared is not None:
        columns, changes = _compared(run_dir, compare, metrics, compared())
    console.print(metrics_table(columns))
    console.print(confusion_table(metrics["confusions"]))
    if changes is not None:
        console.print(class_changes_table(changes, list(columns)[1]))
    if SEEN in metrics:
        console.print(f"the model has seen the images of {metrics[SEEN]} in training, without their labels (--adapt)")
    also = " and comparison.json" if compare else ""
    console.print(f"wrote {saved} (also as {run_dir.metrics}){also} and the plots in {run_dir.plots}", soft_wrap=True)
    _say_unscored(evaluation)


def _say_unscored(evaluation: Evaluation) -> None:
    """One line where queries were not scored, naming their labels; labels written alike but for case (APPLE in the
    queries, apple in the gallery) are named, as the likely reason."""
    from retrieval.data import VARIANTS, describe_variants, label_variants

    unscored = evaluation.unscored()
    if not unscored:
        return
    loo = evaluation.scores.leave_one_out
    why = "no other image has their label" if loo else "the gallery has no image of their label"
    labels = ", ".join(f"{label!r}" for label, _ in unscored.most_common(3)) + (", ..." if len(unscored) > 3 else "")
    line = f"note: {unscored.total():,} of the {len(evaluation.queries):,} queries are not scored, {why} ({labels})"
    images = evaluation.queries + ([] if loo else evaluation.gallery)
    groups = [group for group in label_variants(images) if set(unscored) & set(group)]
    if groups:
        line += f"; {VARIANTS}: {describe_variants(groups)}"
    console.print(line, highlight=False, soft_wrap=True)


def _say_trained_on(run: RunDir, trained: TrainedOn | None, collections: list[Collection]) -> None:
    """One line where the images evaluated include the run's training images: figures there flatter the model."""
    from retrieval.evaluation import share_text

    if trained is None or not sum(trained.counts):
        return
    share = share_text(sum(trained.counts), sum(len(collection.items) for collection in collections))
    console.print(
        f"note: {share} images evaluated are images {run.root} trained on "
        f"({trained.data}): "
        "its figures there flatter it; evaluate images it did not train on (e.g. held-out classes) for what it "
        "does on new ones",
        highlight=False,
        soft_wrap=True,
    )


def _match(run: RunDir, evaluation: Evaluation, name: str, rerank: Rerank, target: float | None) -> None:
    """With a target, fits the match threshold and stores it in the model card; either way, adds to the metrics the
    precision and coverage of the run's threshold (when it has one fitted for this re-ranking) on these queries."""
    from retrieval.calibration import CARD_KEY, calibrate, match_figures, match_similarity, store_threshold

    if target is not None:  # its images were checked before they were embedded (calibrate_run's checks, made early)
        fitted = calibrate(evaluation.scores, evaluation.labels, target, name, rerank.describe())
        store_threshold(run.model_card, fitted)
        console.print(f"{fitted.describe()}; stored in {run.model_card}", highlight=False, soft_wrap=True)
        if caution := fitted.caution():
            console.print(f"[yellow]{caution}[/]", highlight=False, soft_wrap=True)
    card = read_json(run.model_card)
    similarity = match_similarity(card, rerank.describe())
    if similarity is not None:
        evaluation.metrics.update(match_figures(evaluation.scores, similarity))
        evaluation.metrics["match fitted on"] = card[CARD_KEY]["images"]


def _label_free(run: RunDir, collection: Collection, images: Path, model: str) -> None:
    """Quality figures of images without labels (retrieval.copies), printed and saved as their set."""
    from retrieval.copies import copy_figures
    from retrieval.embedders import OnnxEmbedder
    from retrieval.evaluation import SEEN, seen_without_labels

    embedder = OnnxEmbedder.from_run(run, model=model)
    evaluation = copy_figures(embedder, collection.items)
    figures, skipped = evaluation.metrics, evaluation.skipped
    figures.update({"images": str(collection.source), **seen_without_labels(embedder)})
    name = (images.stem if images.suffix else images.name) + ("-int8" if model == "int8" else "")
    saved = run.save_metrics(name, figures)
    report_skipped(collection.skipped + skipped, None)
    console.print(metrics_table({run.root.name: figures}))
    if SEEN in figures:
        console.print(f"the model has seen the images of {figures[SEEN]} in training, without their labels (--adapt)")
    console.print(f"{images} has no labels: figures of augmented copies; wrote {saved} (also as {run.metrics})")


def _deployed(run: RunDir, index_dir: Path | None, ks: list[int], rerank: Rerank, model: str) -> None:
    """The deployed index against exact search over the same stored vectors: both metric sets and their gap."""
    from index.backends import open_index
    from index.stats import exact_and_deployed
    from retrieval.embedders import OnnxEmbedder

    embedder = OnnxEmbedder.from_run(run, model=model)
    index = open_index(index_dir or run.index, embedder.fingerprint, embedder.dim)
    evaluated = exact_and_deployed(index, rerank, ks)
    exact, deployed = evaluated.exact, evaluated.deployed
    name = f"{Path(index.directory).name}-{'-'.join(filter(None, [rerank.method if rerank.active else '', model]))}"
    run.save_metrics(f"{name}-exact", exact.metrics)
    saved = run.save_metrics(f"{name}-deployed", deployed.metrics)
    numbers = [key for key, value in exact.metrics.items() if isinstance(value, float)]
    gap = {key: deployed.metrics[key] - exact.metrics[key] for key in numbers if key in deployed.metrics}
    columns = {"exact search": exact.metrics, f"deployed: {deployed.metrics['search']}": deployed.metrics}
    console.print(metrics_table({**columns, "deployed - exact": gap}))
    console.print(f"wrote {saved} and its exact counterpart beside it (also as {run.metrics})", soft_wrap=True)


def _set_name(
    images: Path | None,
    query: Path | None,
    gallery: Path | None,
    split_classes: float,
    seed: int,
    benchmark: str | None,
) -> str:
    """What the evaluated set is called in RUN/metrics/: its source, and the protocol when it is not the default."""
    if benchmark:
        return f"{benchmark}-test"
    if images is None:
        return f"{Path(str(query)).stem}-vs-{Path(str(gallery)).stem}"
    name = Path(images).stem if Path(images).suffix else Path(images).name
    return f"{name}-classes{split_classes:g}-seed{seed}" if split_classes else name


def _sources(
    images: Path | None, query: Path | None, gallery: Path | None, split_classes: float, benchmark: str | None
) -> tuple[Collection | None, Collection | None, Collection | None]:
    """(test, queries, gallery): a collection scored leave-one-out, or queries against a gallery."""
    from retrieval.data import load_collection

    if (query is None) != (gallery is None):
        raise RetrievalError("--query and --gallery go together: give both (or neither, with IMAGES)")
    if (images is None) == (query is None):
        raise RetrievalError("give either IMAGES (leave-one-out) or --query Q --gallery G, not both or neither")
    if split_classes and images is None:
        raise RetrievalError("--split-classes splits IMAGES; it does not apply to --query/--gallery")
    if benchmark and (images is None or split_classes):
        raise RetrievalError(
            "--benchmark reads IMAGES as the extracted archive and scores its own test protocol; "
            "give IMAGES, without --query/--gallery or --split-classes"
        )
    if benchmark:
        from retrieval.benchmarks import load_benchmark

        chosen = load_benchmark(benchmark, images)  # type: ignore[arg-type]
        return chosen.test, chosen.query, chosen.gallery
    if images is not None:
        return load_collection(images), None, None
    with option_named("--query"):
        queries = load_collection(query)  # type: ignore[arg-type]
    with option_named("--gallery"):
        return None, queries, load_collection(gallery)  # type: ignore[arg-type]


def _score(
    run: Path, sources: tuple, ks: list[int], split_classes: float, seed: int, rerank: Rerank, model: str
) -> Evaluation:
    """The evaluation of one run's exported model on the sources."""
    from retrieval.embedders import OnnxEmbedder
    from retrieval.evaluation import evaluate_collection, evaluate_query_gallery

    test, queries, pool = sources
    embedder = OnnxEmbedder.from_run(RunDir(run), model=model)
    if test is not None:
        return evaluate_collection(embedder, test, ks, split_classes=split_classes, seed=seed, rerank=rerank)
    return evaluate_query_gallery(embedder, queries, pool, ks, rerank=rerank)


def _compared(run_dir: RunDir, compare: Path, ours: dict, theirs: dict) -> tuple[dict[str, dict], dict]:
    """Both runs' metrics and their differences as table columns, and the classes that changed; writes
    comparison.json and the recall curves."""
    from retrieval.mistakes import compare_classes
    from retrieval.plots import plot_recall_curves

    names = (
        (run_dir.root.name, compare.name) if compare.name != run_dir.root.name else (str(run_dir.root), str(compare))
    )
    columns = {names[0]: ours, names[1]: theirs}
    runs = {str(run_dir.root): ours, str(compare): theirs}
    changes = compare_classes(ours["classes"], theirs["classes"])
    write_json(run_dir.root / "comparison.json", {"protocol": ours["protocol"], "runs": runs, "classes": changes})
    curves = {label: metrics["cmc"] for label, metrics in columns.items()}
    plot_recall_curves(curves, run_dir.plots / "compare_recall_at_k.png", f"recall@k ({ours['protocol']})")
    numbers = [key for key, value in ours.items() if isinstance(value, float) and isinstance(theirs.get(key), float)]
    columns[f"{names[1]} - {names[0]}"] = {key: theirs[key] - ours[key] for key in numbers}
    return columns, changes
