"""Plots written next to the numbers they show (PNG, no display needed)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: works on servers without a display
from matplotlib import pyplot as plt  # noqa: E402

from retrieval.runs import write_atomic  # noqa: E402


def plot_training_log(log: Path, target: Path) -> Path:
    """Draws the loss and learning rate of each epoch in train_log.jsonl into a PNG; returns its path."""
    entries = [json.loads(line) for line in log.read_text(encoding="utf-8").splitlines() if line.strip()]
    epochs = [entry["epoch"] for entry in entries]
    figure, loss_axis = plt.subplots(figsize=(6, 3.5), dpi=120)
    loss_axis.plot(epochs, [entry["loss"] for entry in entries], marker="o", markersize=3, color="tab:blue", label="loss")
    loss_axis.set_xlabel("epoch")
    loss_axis.set_ylabel("training loss", color="tab:blue")
    rate_axis = loss_axis.twinx()
    rate_axis.plot(epochs, [entry["lr"] for entry in entries], color="tab:orange", alpha=0.6, label="learning rate")
    rate_axis.set_ylabel("learning rate", color="tab:orange")
    loss_axis.set_title(f"training: {log.parent.name}")
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    plt.close(figure)
    write_atomic(target, buffer.getvalue())
    return target
