"""The main job on the embedded icons dataset: train on train/, export, index and evaluate test/.

Like the command line, this module composes every stage (it is imported only by `retrieval demo`).
test/ holds classes never seen in training, so the figures are the metric-learning protocol's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from index.build import build_index
from retrieval.data import Collection, load_collection, write_collection_csv
from retrieval.datasets import icons
from retrieval.embedders import OnnxEmbedder, PixelEmbedder
from retrieval.evaluation import evaluate_collection
from retrieval.runs import RunDir, write_json
from training.config import TrainConfig
from training.export import export
from training.train import train


@dataclass
class DemoOutcome:
    """The trained model's metrics next to the raw-pixel baseline's, on the same test split."""

    model_metrics: dict
    baseline_metrics: dict
    train_seconds: float
    total_seconds: float


def run_demo(run: RunDir, epochs: int | None = None, classes: int | None = None, progress: bool = True) -> DemoOutcome:
    """Runs train -> export -> index -> evaluate on the icons dataset and the raw-pixel baseline.

    Training uses the default recipe of `retrieval train`; epochs and classes shorten the demo.
    """
    started = time.perf_counter()
    dataset = icons()
    run.root.mkdir(parents=True, exist_ok=True)
    train_source = _split(dataset / "train", classes, run.root / "demo-train.csv")
    test_source = _split(dataset / "test", classes, run.root / "demo-test.csv")

    config = TrainConfig(data=str(train_source)) if epochs is None else TrainConfig(data=str(train_source), epochs=epochs)
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
