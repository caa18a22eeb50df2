"""`retrieval demo`: the main job on the embedded icons: train on train/, export, index and evaluate test/, serve.

test/ holds classes never seen in training, so the figures are the metric-learning protocol's. A
finished demo run is reused (its figures kept in RUN/demo.json): `--retrain` starts it over. A demo stopped in
training goes on from its last finished epoch when run again with the same options.
"""

from __future__ import annotations

import os
import shlex
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, NoReturn

import typer

from retrieval.commands.output import console, metrics_table, stopped_by_ctrl_c
from retrieval.commands.serve import require_free_port, serve
from retrieval.data import Collection, load_collection, write_collection_csv
from retrieval.datasets import icons
from retrieval.embedders import OnnxEmbedder, PixelEmbedder
from retrieval.errors import RetrievalError
from retrieval.evaluation import evaluate_collection, write_plots
from retrieval.extras import require
from retrieval.runs import RunDir, read_json, writable_folder, write_json
from retrieval.wording import counted

if TYPE_CHECKING:
    from training.config import TrainConfig

STEPS = 5  # train, export, index, evaluate, self-supervised (serving is the sixth, when asked for)
SSL_EPOCHS = 10  # the self-supervised run's short schedule (the recipe's is 35: docs/recipe.md)


@dataclass
class DemoOutcome:
    """The trained model's metrics next to the raw-pixel baseline's, on the same test split."""

    model_metrics: dict
    baseline_metrics: dict
    train_seconds: float
    total_seconds: float
    self_supervised_metrics: dict | None = None  # the same test classes, trained without any label
    self_supervised_seconds: float = 0.0
    self_supervised_epochs: int = 0


def demo(
    run: Annotated[Path, typer.Option("--run", help="Run directory for the demo.")] = Path("runs/demo"),
    serve_app: Annotated[bool, typer.Option("--serve/--no-serve", help="Serve the app at the end.")] = True,
    epochs: Annotated[int | None, typer.Option(help="Training epochs (default: those of `retrieval train`).")] = None,
    classes: Annotated[
        int | None, typer.Option(help="Use only the first N classes of each split (a quicker look; 2 or more).", min=2)
    ] = None,
    retrain: Annotated[
        bool, typer.Option("--retrain", help="Train again even if RUN holds a finished demo (or another run).")
    ] = False,
    host: Annotated[str, typer.Option(help="Address to bind the app to.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port of the app.", min=1, max=65535)] = 7860,
) -> None:
    """Train on the embedded icons dataset, export, index and evaluate its unseen test classes, then serve."""
    if serve_app:
        make = "make demo PORT" if "MAKELEVEL" in os.environ else ""  # started by `make demo`, whose PORT sets --port
        require_free_port(host, port, make)  # before minutes of training, not after
    run_dir = RunDir(run)
    run_dir.refuse_foreign_folder()
    if not retrain:
        _refuse_another_run(run_dir)
    classes = _all_or(classes)
    outcome = None if retrain else finished_demo(run_dir, epochs, classes)
    if outcome is None:
        require("torch", "train")
        try:
            outcome = run_demo(run_dir, epochs=epochs, classes=classes, steps=STEPS + serve_app)
        except KeyboardInterrupt:
            _interrupted(run_dir)
    else:
        console.print(f"{run} holds a finished demo: reusing it (train it again with --retrain)", soft_wrap=True)
        outcome = _reindexed(run_dir, outcome, {"epochs": epochs, "classes": classes})
    columns = {"trained model": outcome.model_metrics}
    if outcome.self_supervised_metrics:
        columns[f"no labels, {outcome.self_supervised_epochs} epochs"] = outcome.self_supervised_metrics
    columns["raw pixels 16x16 gray"] = outcome.baseline_metrics
    console.print(metrics_table(columns))
    console.print(f"run directory: {run}  (train {outcome.train_seconds:.0f}s, total {outcome.total_seconds:.0f}s)")
    console.print(f"reopen the app later with: {reopen_command(run)}", highlight=False, soft_wrap=True)
    dataset = icons()
    query = min((dataset / "test").rglob("*.png"))
    console.print(
        f"the icons are in {dataset} (train/, test/: a folder per label); search with one of them: "
        f"{reopen_command(run).replace(' serve ', ' search ')} {shlex.quote(str(query))}",
        highlight=False,
        soft_wrap=True,
    )
    if serve_app:
        step("serve", STEPS + 1, STEPS + 1)
        serve(run, host, port)


def _refuse_another_run(run: RunDir) -> None:
    """Refuses a --run that holds a run of `retrieval train` (no demo.json): the demo trained over it, its checkpoints
    and model replaced without a word, where `retrieval train` itself asks for --overwrite."""
    if (run.root / "demo.json").is_file() or not (run.last_checkpoint.is_file() or run.model.is_file()):
        return
    raise RetrievalError(
        f"--run {run.root} holds a run that is not a demo's; give the demo another --run (the default is runs/demo), "
        "or add --retrain to train the demo over it"
    )


def _interrupted(run: RunDir) -> NoReturn:
    """Ctrl+C before the demo finished: one line saying what is kept and that the same command goes on; exit 130."""
    done = _saved_epochs(run)
    if done:
        line = (
            f"interrupted: the demo in {run.root} has {counted(done, 'epoch')} trained and saved; the same command "
            "again goes on from there (--retrain starts over)"
        )
    else:
        line = f"interrupted before the demo's first epoch ended; the same command again starts it over in {run.root}"
    stopped_by_ctrl_c(line)


def reopen_command(run: Path) -> str:
    """The command that serves this run again, as this program was started (.venv/bin/retrieval by `make demo`)."""
    program = sys.argv[0] if Path(sys.argv[0]).name == "retrieval" else "retrieval"
    return f"{shlex.quote(program)} serve {shlex.quote(str(run))}"


def step(name: str, number: int, total: int = STEPS) -> None:
    """A heading for one step of the demo."""
    console.rule(f"[bold]{number}/{total} {name}", align="left")


def finished_demo(run: RunDir, epochs: int | None, classes: int | None) -> DemoOutcome | None:
    """The outcome of a demo finished in run with the same settings, if its model and index are still there."""
    record = run.root / "demo.json"
    if not (record.is_file() and run.model.is_file() and (run.index / "manifest.json").is_file()):
        return None
    saved = read_json(record)
    if saved.get("settings") != {"epochs": epochs, "classes": classes} or not saved.get("outcome"):
        return None
    return DemoOutcome(**saved["outcome"])


def _reindexed(run: RunDir, outcome: DemoOutcome, settings: dict) -> DemoOutcome:
    """A finished demo whose model was exported again since, with other options (its index was built with another
    model, which the app would refuse): the test images indexed and evaluated again with the model now there."""
    from index.build import build_index
    from index.disk import read_manifest

    embedder = OnnxEmbedder.from_run(run)
    if read_manifest(run.index).encoder_sha256 == embedder.fingerprint:
        return outcome
    console.print("its model was exported again since the index was built: indexing and evaluating with it anew")
    test_source = _split(icons() / "test", settings["classes"], run.root / "demo-test.csv")
    test = load_collection(test_source)
    build_index(embedder, test, run.index, rebuild=True)
    outcome = replace(outcome, model_metrics=_scored(run, embedder, test, test_source, progress=True))
    write_json(run.root / "demo.json", {"settings": settings, "outcome": asdict(outcome)})
    return outcome


def run_demo(
    run: RunDir, epochs: int | None = None, classes: int | None = None, progress: bool = True, steps: int = STEPS
) -> DemoOutcome:
    """Runs train -> export -> index -> evaluate on the icons dataset and the raw-pixel baseline.

    Training uses the default recipe of `retrieval train`; epochs and classes shorten the demo.
    """
    from index.build import build_index
    from training.config import TrainConfig
    from training.exporting import export

    started = time.perf_counter()
    dataset = icons()
    writable_folder(run.root, "--run")
    train_source = _split(dataset / "train", classes, run.root / "demo-train.csv")
    test_source = _split(dataset / "test", classes, run.root / "demo-test.csv")
    config = (
        TrainConfig(data=str(train_source)) if epochs is None else TrainConfig(data=str(train_source), epochs=epochs)
    )
    step(f"train: {config.backbone} at {config.image_size} px, {config.loss}, {config.epochs} epochs", 1, steps)
    _train_demo(config, run, {"epochs": epochs, "classes": classes}, progress)
    train_seconds = time.perf_counter() - started
    step("export to ONNX, checked against PyTorch", 2, steps)
    console.print(f"{run.model}: {export(run).describe()}", highlight=False, soft_wrap=True)
    embedder = OnnxEmbedder.from_run(run)
    test = load_collection(test_source)
    step(f"index the {len(test.items)} test images (classes never seen in training)", 3, steps)
    build_index(embedder, test, run.index, rebuild=True, progress=progress)
    step("evaluate leave-one-out on the test classes, and a raw-pixel baseline", 4, steps)
    metrics = _scored(run, embedder, test, test_source, progress)
    baseline = evaluate_collection(PixelEmbedder(16), test, progress=progress).metrics
    write_json(run.root / "baseline_metrics.json", baseline)
    step(f"self-supervised: {SSL_EPOCHS if epochs is None else epochs} epochs without labels, the same test", 5, steps)
    ssl_started = time.perf_counter()
    ssl = self_supervised(run, train_source, test, epochs, progress)
    outcome = DemoOutcome(metrics, baseline, train_seconds, time.perf_counter() - started)
    outcome.self_supervised_metrics, outcome.self_supervised_seconds = ssl, time.perf_counter() - ssl_started
    outcome.self_supervised_epochs = epochs or SSL_EPOCHS
    write_json(run.root / "demo.json", {"settings": {"epochs": epochs, "classes": classes}, "outcome": asdict(outcome)})
    return outcome


def _scored(run: RunDir, embedder: OnnxEmbedder, test: Collection, source: Path, progress: bool) -> dict:
    """The metrics of the test images, leave-one-out, saved as the run's metric set with their plots."""
    evaluation = evaluate_collection(embedder, test, progress=progress)
    run.save_metrics(f"icons-{Path(source).stem}", evaluation.metrics)
    write_plots(evaluation, run.plots)
    return evaluation.metrics


def _train_demo(config: TrainConfig, run: RunDir, settings: dict, progress: bool) -> None:
    """Trains the demo's model, going on from where a demo of the same settings was stopped (Ctrl+C, a crash): its
    trainer state is kept after every epoch, and RUN/demo.json without an outcome marks a demo under way."""
    from training.loop import train

    record = read_json(run.root / "demo.json") if (run.root / "demo.json").is_file() else {}
    done = _saved_epochs(run) if record == {"settings": settings, "outcome": None} else None
    write_json(run.root / "demo.json", {"settings": settings, "outcome": None})
    if done is not None and done >= config.epochs:
        console.print(f"the model of an earlier, stopped demo is trained ({done} epochs): going on from it")
        return
    train(config, run, progress=progress, resume=bool(done), overwrite=True)  # resuming says so, with the epoch


def _saved_epochs(run: RunDir) -> int | None:
    """The epochs finished in run's trainer state (None where there is none to go on from)."""
    from training.checkpoints import saved_record

    try:
        record = saved_record(run.trainer_state)
    except RetrievalError:  # damaged: the demo trains anew
        return None
    return None if record is None or not run.config.is_file() else record.epoch


def self_supervised(run: RunDir, train_source: Path, test: Collection, epochs: int | None, progress: bool) -> dict:
    """The recipe's self-supervised method on the training images without their labels, a short schedule, in
    RUN/self-supervised, scored on the same test classes."""
    from training.config import TrainConfig
    from training.exporting import export
    from training.loop import train

    ssl_run = RunDir(run.root / "self-supervised")
    config = TrainConfig(data=str(train_source), self_supervised=True, epochs=epochs or SSL_EPOCHS)
    train(config, ssl_run, progress=progress, overwrite=True)
    export(ssl_run)
    metrics = evaluate_collection(OnnxEmbedder.from_run(ssl_run), test, progress=progress).metrics
    ssl_run.save_metrics(f"icons-{test.source.stem}", metrics)
    return metrics


def _all_or(classes: int | None) -> int | None:
    """--classes as the demo takes it: None (all of them) where it is at least the number of training classes, said
    in one line (the whole demo runs, and a finished one is reused, as without the option)."""
    if classes is None:
        return None
    available = sum(1 for path in (icons() / "train").iterdir() if path.is_dir())
    if classes < available:
        return classes
    console.print(f"--classes {classes}: the icons have {available} training classes; all are used", highlight=False)
    return None


def _split(folder: Path, classes: int | None, csv_path: Path) -> Path:
    """Returns the split folder, or a CSV listing only its first `classes` classes."""
    if classes is None:
        return folder
    collection: Collection = load_collection(folder)
    keep = set(sorted(collection.class_counts())[:classes])
    return write_collection_csv(csv_path, [item for item in collection.items if item.label in keep])
