"""`retrieval demo`: the main job on the embedded icons dataset (train on train/, export, index and evaluate test/,
serve).

test/ holds classes never seen in training, so the figures are the metric-learning protocol's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

from retrieval.commands.output import console, metrics_table
from retrieval.commands.serve import serve
from retrieval.data import Collection, load_collection, write_collection_csv
from retrieval.datasets import icons
from retrieval.embedders import OnnxEmbedder, PixelEmbedder
from retrieval.evaluation import evaluate_collection
from retrieval.extras import require
from retrieval.runs import RunDir, write_json


@dataclass
class DemoOutcome:
    """The trained model's metrics next to the raw-pixel baseline's, on the same test split."""

    model_metrics: dict
    baseline_metrics: dict
    train_seconds: float
    total_seconds: float


def demo(
    run: Annotated[Path, typer.Option("--run", help="Run directory for the demo.")] = Path("runs/demo"),
    serve_app: Annotated[bool, typer.Option("--serve/--no-serve", help="Serve the app at the end.")] = True,
    epochs: Annotated[int | None, typer.Option(help="Training epochs (default: those of `retrieval train`).")] = None,
    classes: Annotated[
        int | None, typer.Option(help="Use only the first N classes of each split (a quicker look).")
    ] = None,
    host: Annotated[str, typer.Option(help="Address to bind the app to.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port of the app.")] = 7860,
) -> None:
    """Train on the embedded icons dataset, export, index and evaluate its unseen test classes, then serve."""
    require("torch", "train")
    outcome = run_demo(RunDir(run), epochs=epochs, classes=classes)
    console.print(
        metrics_table({"trained model": outcome.model_metrics, "raw pixels 16x16 gray": outcome.baseline_metrics})
    )
    console.print(f"run directory: {run}  (train {outcome.train_seconds:.0f}s, total {outcome.total_seconds:.0f}s)")
    if serve_app:
        console.print(f"serving the search app at http://{host}:{port}  (Ctrl+C to stop)")
        serve(run, host, port)


def run_demo(run: RunDir, epochs: int | None = None, classes: int | None = None, progress: bool = True) -> DemoOutcome:
    """Runs train -> export -> index -> evaluate on the icons dataset and the raw-pixel baseline.

    Training uses the default recipe of `retrieval train`; epochs and classes shorten the demo.
    """
    from index.build import build_index
    from training.config import TrainConfig
    from training.exporting import export
    from training.loop import train

    started = time.perf_counter()
    dataset = icons()
    run.root.mkdir(parents=True, exist_ok=True)
    train_source = _split(dataset / "train", classes, run.root / "demo-train.csv")
    test_source = _split(dataset / "test", classes, run.root / "demo-test.csv")
    config = (
        TrainConfig(data=str(train_source)) if epochs is None else TrainConfig(data=str(train_source), epochs=epochs)
    )
    train(config, run, progress=progress)
    train_seconds = time.perf_counter() - started
    export(run)
    embedder = OnnxEmbedder.from_run(run)
    test = load_collection(test_source)
    build_index(embedder, test, run.index, rebuild=True, progress=progress)
    model = evaluate_collection(embedder, test, progress=progress).metrics
    write_json(run.metrics, model)
    baseline = evaluate_collection(PixelEmbedder(16), test, progress=progress).metrics
    write_json(run.root / "baseline_metrics.json", baseline)
    return DemoOutcome(model, baseline, train_seconds, time.perf_counter() - started)


def _split(folder: Path, classes: int | None, csv_path: Path) -> Path:
    """Returns the split folder, or a CSV listing only its first `classes` classes."""
    if classes is None:
        return folder
    collection: Collection = load_collection(folder)
    keep = set(sorted(collection.class_counts())[:classes])
    return write_collection_csv(csv_path, [item for item in collection.items if item.label in keep])
