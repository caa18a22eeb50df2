"""Out-of-fold models for an audit of a run's own training images (`retrieval audit --folds K`).

A model has memorised the labels of the images it trained on, wrong ones included: its embedding puts
a mislabeled training image among its given label. As cleanlab recommends for predicted
probabilities, each image is judged by a model that did not see it: the images are split into K
folds (seeded, each label spread over all of them), and K short runs with the run's own recipe
each train on the other folds and are exported. Each embeds the whole collection, and the images of
its fold are scored there against all the others (retrieval.audit.suspects_in_folds).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from retrieval.audit import check_folds
from retrieval.data import Item, write_collection_csv
from retrieval.runs import RunDir, read_json
from retrieval.wording import counted
from training.config import TrainConfig
from training.exporting import export
from training.loop import train


def fold_of(items: Sequence[Item], folds: int, seed: int = 0) -> np.ndarray:
    """Each item's fold in 0..folds-1: every label's images dealt over the folds in a seeded order."""
    check_folds([item.label for item in items], folds)
    rng = np.random.default_rng(seed)
    fold = np.zeros(len(items), np.int64)
    labels = np.array([item.label for item in items])
    for label in np.unique(labels):
        rows = np.flatnonzero(labels == label)
        fold[rng.permutation(rows)] = (np.arange(len(rows)) + rng.integers(folds)) % folds
    return fold


def fold_models(
    run: RunDir,
    items: Sequence[Item],
    fold: np.ndarray,
    epochs: int,
    work: Path,
    said: Callable[[str], None] = lambda line: None,
) -> list[RunDir]:
    """One run per fold under work, trained on the other folds with RUN's recipe for `epochs` and exported."""
    recipe = TrainConfig.from_dict(read_json(run.config))
    models = []
    for number in range(int(fold.max()) + 1):
        kept = [item for item, where in zip(items, fold, strict=True) if where != number]
        data = write_collection_csv(work / f"fold-{number}.csv", kept)
        config = replace(recipe, data=str(data), epochs=epochs, val_classes=0.0, patience=0, adapt=None)
        config = replace(config, checkpoint_every=0, tensorboard=False)
        said(f"fold {number + 1}/{int(fold.max()) + 1}: training on {len(kept)} images for {counted(epochs, 'epoch')}")
        target = RunDir(work / f"fold-{number}")
        train(config, target, progress=False, overwrite=True)
        export(target)
        models.append(target)
    return models
