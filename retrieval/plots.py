"""Plots written next to the numbers they show (PNG, no display needed)."""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from pathlib import Path

import matplotlib
import numpy as np

matplotlib.use("Agg")  # files only: works on servers without a display
from matplotlib import pyplot as plt  # noqa: E402

from retrieval.runs import write_atomic  # noqa: E402


def plot_training_log(log: Path, target: Path) -> Path:
    """Draws each epoch's loss and learning rate (and validation scores, when logged) into a PNG; returns its path."""
    entries = [json.loads(line) for line in log.read_text(encoding="utf-8").splitlines() if line.strip()]
    epochs = [entry["epoch"] for entry in entries]
    validated = all("val_map@r" in entry for entry in entries)
    figure, axes = plt.subplots(1, 2 if validated else 1, figsize=(11 if validated else 6, 3.5), dpi=120, squeeze=False)
    loss_axis = axes[0][0]
    loss_axis.plot(epochs, [entry["loss"] for entry in entries], marker="o", markersize=3, color="tab:blue", label="loss")
    loss_axis.set_xlabel("epoch")
    loss_axis.set_ylabel("training loss", color="tab:blue")
    rate_axis = loss_axis.twinx()
    rate_axis.plot(epochs, [entry["lr"] for entry in entries], color="tab:orange", alpha=0.6, label="learning rate")
    rate_axis.set_ylabel("learning rate", color="tab:orange")
    loss_axis.set_title(f"training: {log.parent.name}")
    if validated:
        scores = axes[0][1]
        scores.plot(epochs, [entry["val_recall@1"] for entry in entries], marker="o", markersize=3, label="recall@1")
        scores.plot(epochs, [entry["val_map@r"] for entry in entries], marker="o", markersize=3, label="MAP@R")
        scores.set_xlabel("epoch")
        scores.set_title("validation (held-out classes)")
        scores.legend()
    return _save(figure, target)


def plot_temperature_sweep(rows: list[dict], target: Path) -> Path:
    """Draws uniformity, tolerance and recall@1 against temperature, one colour per loss, into a PNG.

    rows: dicts with loss, temperature, recall@1 and the diagnostics of the embeddings (uniformity,
    tolerance: dashed) and of the projections the loss sees (loss_uniformity, loss_tolerance: solid).
    """
    figure, axes = plt.subplots(1, 3, figsize=(15, 4), dpi=120)
    panels = [("uniformity", "uniformity (lower: more spread out)"), ("tolerance", "tolerance (higher: classes kept together)"), ("recall@1", "recall@1")]
    for colour, loss in zip(plt.rcParams["axes.prop_cycle"].by_key()["color"], dict.fromkeys(row["loss"] for row in rows)):
        mine = sorted((row for row in rows if row["loss"] == loss), key=lambda row: row["temperature"])
        temperatures = [row["temperature"] for row in mine]
        for axis, (key, _) in zip(axes, panels):
            if key == "recall@1":
                axis.plot(temperatures, [row[key] for row in mine], marker="o", markersize=4, color=colour, label=loss)
                continue
            axis.plot(temperatures, [row[f"loss_{key}"] for row in mine], marker="o", markersize=4, color=colour, label=f"{loss}: loss space")
            axis.plot(temperatures, [row[key] for row in mine], marker="s", markersize=3, linestyle="--", color=colour, alpha=0.7, label=f"{loss}: embedding")
    for axis, (_, title) in zip(axes, panels):
        axis.set_xscale("log")
        axis.set_xlabel("temperature")
        axis.set_title(title)
        axis.legend(fontsize=8)
    figure.suptitle("held-out classes: the uniformity-tolerance dilemma (Wang & Liu 2021) on this data")
    return _save(figure, target)


def plot_recall_curve(cmc: list[float], target: Path, title: str) -> Path:
    """Draws recall@k against k (the CMC curve) into a PNG."""
    figure, axis = plt.subplots(figsize=(6, 4), dpi=120)
    ks = list(range(1, len(cmc) + 1))
    axis.plot(ks, cmc, marker="o", markersize=3)
    axis.set_xlabel("k")
    axis.set_ylabel("recall@k")
    axis.set_ylim(0, 1)
    axis.grid(alpha=0.3)
    axis.set_title(title)
    return _save(figure, target)


def plot_similarity_histograms(vectors: np.ndarray, labels: Sequence[str], target: Path, max_points: int = 3000, seed: int = 0) -> Path:
    """Draws the histograms of same-label and different-label cosine similarities into a PNG.

    With more than max_points rows, a seeded random subset is used.
    """
    codes = np.unique(np.asarray(labels), return_inverse=True)[1]
    if len(vectors) > max_points:
        keep = np.random.default_rng(seed).choice(len(vectors), max_points, replace=False)
        vectors, codes = vectors[keep], codes[keep]
    similarity = vectors @ vectors.T
    upper = np.triu(np.ones_like(similarity, dtype=bool), k=1)
    same = (codes[:, None] == codes[None, :]) & upper
    figure, axis = plt.subplots(figsize=(6, 4), dpi=120)
    bins = np.linspace(-1, 1, 81)
    for pairs, name in ((upper & ~same, "different label"), (same, "same label")):
        if pairs.any():  # e.g. a query set with one image per label has no same-label pair
            axis.hist(similarity[pairs], bins=bins, density=True, alpha=0.6, label=f"{name} ({int(pairs.sum()):,} pairs)")
    axis.set_xlabel("cosine similarity")
    axis.set_ylabel("density")
    axis.legend()
    axis.set_title("similarities of pairs")
    return _save(figure, target)


def _save(figure: plt.Figure, target: Path) -> Path:
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    plt.close(figure)
    write_atomic(target, buffer.getvalue())
    return target
