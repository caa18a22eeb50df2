"""Plots written next to the numbers they show (PNG, no display needed)."""

from __future__ import annotations

import io
import json
import textwrap
from collections.abc import Sequence
from pathlib import Path

import matplotlib
import numpy as np

matplotlib.use("Agg")  # files only: works on servers without a display
from matplotlib import pyplot as plt  # noqa: E402

from retrieval.data import Item, load_image  # noqa: E402
from retrieval.errors import ImageError  # noqa: E402
from retrieval.runs import write_atomic  # noqa: E402


def plot_training_log(log: Path, target: Path) -> Path:
    """Draws each epoch's loss and learning rate (and validation scores, when logged) into a PNG; returns its path."""
    entries = [json.loads(line) for line in log.read_text(encoding="utf-8").splitlines() if line.strip()]
    epochs = [entry["epoch"] for entry in entries]
    validated = all("val_map@r" in entry for entry in entries)
    figure, axes = plt.subplots(1, 2 if validated else 1, figsize=(11 if validated else 6, 3.5), dpi=120, squeeze=False)
    loss_axis = axes[0][0]
    loss_axis.plot(
        epochs, [entry["loss"] for entry in entries], marker="o", markersize=3, color="tab:blue", label="loss"
    )
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
    panels = [
        ("uniformity", "uniformity (lower: more spread out)"),
        ("tolerance", "tolerance (higher: classes kept together)"),
        ("recall@1", "recall@1"),
    ]
    for colour, loss in zip(
        plt.rcParams["axes.prop_cycle"].by_key()["color"], dict.fromkeys(row["loss"] for row in rows)
    ):
        mine = sorted((row for row in rows if row["loss"] == loss), key=lambda row: row["temperature"])
        temperatures = [row["temperature"] for row in mine]
        for axis, (key, _) in zip(axes, panels):
            if key == "recall@1":
                axis.plot(temperatures, [row[key] for row in mine], marker="o", markersize=4, color=colour, label=loss)
                continue
            axis.plot(
                temperatures,
                [row[f"loss_{key}"] for row in mine],
                marker="o",
                markersize=4,
                color=colour,
                label=f"{loss}: loss space",
            )
            axis.plot(
                temperatures,
                [row[key] for row in mine],
                marker="s",
                markersize=3,
                linestyle="--",
                color=colour,
                alpha=0.7,
                label=f"{loss}: embedding",
            )
    for axis, (_, title) in zip(axes, panels):
        axis.set_xscale("log")
        axis.set_xlabel("temperature")
        axis.set_title(title)
        axis.legend(fontsize=8)
    figure.suptitle("held-out classes: the uniformity-tolerance dilemma (Wang & Liu 2021) on this data")
    return _save(figure, target)


def plot_recall_curves(curves: dict[str, list[float]], target: Path, title: str) -> Path:
    """Draws recall@k against k (CMC curves), one line per named run, to a PNG."""
    figure, axis = plt.subplots(figsize=(6, 4), dpi=120)
    for name, cmc in curves.items():
        axis.plot(range(1, len(cmc) + 1), cmc, marker="o", markersize=3, label=name or None)
    axis.set_xlabel("k")
    axis.set_ylabel("recall@k")
    axis.set_ylim(0, 1)
    axis.grid(alpha=0.3)
    if any(curves):
        axis.legend()
    axis.set_title(title)
    return _save(figure, target)


def plot_class_recall(class_recall: dict[str, tuple[float, int]], target: Path, listed: int = 15) -> Path:
    """Draws the distribution of per-class recall@1 and the classes with the lowest, into a PNG.

    class_recall: label -> (recall@1 of its queries, number of its queries).
    """
    values = np.array([value for value, _ in class_recall.values()])
    figure, (spread, worst) = plt.subplots(1, 2, figsize=(11, 4), dpi=120)
    spread.hist(values, bins=np.linspace(0, 1, 21), color="tab:blue", alpha=0.8)
    spread.axvline(values.mean(), color="tab:red", linestyle="--", label=f"mean over classes {values.mean():.3f}")
    spread.set_xlabel("recall@1 of the class")
    spread.set_ylabel("classes")
    spread.set_title(f"per-class recall@1 ({len(values):,} classes)")
    spread.legend()
    lowest = sorted(class_recall.items(), key=lambda entry: (entry[1][0], entry[0]))[:listed][::-1]
    bars = worst.barh([_shorten(label) for label, _ in lowest], [value for _, (value, _) in lowest], color="tab:orange")
    worst.bar_label(
        bars, labels=[f"{value:.2f} of {count} queries" for _, (value, count) in lowest], padding=3, fontsize=7
    )
    worst.set_xlim(0, 1.2)
    worst.set_xlabel("recall@1")
    worst.set_title(f"the {len(lowest)} lowest classes")
    worst.tick_params(axis="y", labelsize=7)
    return _save(figure, target)


def plot_worst_queries(
    rows: Sequence[tuple[Item, Sequence[tuple[Item, float]]]], target: Path, thumbnail: int = 96
) -> Path:
    """Draws one row per query: its image, then its top results framed green (same label) or red, into a PNG."""
    columns = 1 + max((len(results) for _, results in rows), default=0)
    figure, axes = plt.subplots(
        max(len(rows), 1),
        columns,
        figsize=(1.6 * columns, 1.8 * max(len(rows), 1)),
        dpi=100,
        squeeze=False,
        layout="constrained",  # room for each two-line caption and the title, which tight_layout overlapped
    )
    for axis in axes.flat:
        axis.axis("off")
    for row, (query, results) in zip(axes, rows):
        _show(row[0], query, thumbnail, f"query\n{_shorten(query.label)}", "black")
        for axis, (item, similarity) in zip(row[1:], results):
            _show(
                axis,
                item,
                thumbnail,
                f"{similarity:.3f} {_shorten(item.label)}",
                "tab:green" if item.label == query.label else "tab:red",
            )
    _title(figure, "worst queries (lowest MAP@R) and their top results: green = same label, red = other label")
    return _save(figure, target)


def plot_confusions(pairs: Sequence[dict], target: Path, rows: int = 8, thumbnail: int = 96) -> Path:
    """Draws the most confused class pairs (retrieval.mistakes: label -> confused_with, count, examples), one row each:
    up to three examples, each a query framed black beside its top-1 hit framed red."""
    shown = list(pairs[:rows])
    columns = 2 * max((len(pair["examples"]) for pair in shown), default=1)
    figure, axes = plt.subplots(
        max(len(shown), 1),
        columns,
        figsize=(1.8 * columns, 2.0 * max(len(shown), 1)),
        dpi=100,
        squeeze=False,
        layout="constrained",
    )
    for axis in axes.flat:
        axis.axis("off")
    for row, pair in zip(axes, shown):
        title = f"{_shorten(pair['label'])}\n→ {_shorten(pair['confused_with'])}: {pair['count']} of {pair['queries']}"
        for number, example in enumerate(pair["examples"]):
            query, hit = Item(Path(example["query"]), pair["label"]), Item(Path(example["hit"]), pair["confused_with"])
            _show(row[2 * number], query, thumbnail, title if number == 0 else _shorten(pair["label"]), "black")
            _show(row[2 * number + 1], hit, thumbnail, f"top-1: {_shorten(pair['confused_with'])}", "tab:red")
    if not shown:
        figure.text(0.5, 0.45, "no query's top-1 hit\nhas another label", ha="center", va="center")
    _title(figure, "the class pairs most often confused: queries (black) and their top-1 hit of the other class (red)")
    return _save(figure, target)


def _show(axis: plt.Axes, item: Item, size: int, caption: str, colour: str) -> None:
    """Draws a thumbnail of item framed in colour; an image that can no longer be read is drawn grey."""
    try:
        image = load_image(item.path, size)  # a large JPEG decoded at a reduced scale: a thumbnail is drawn
        image.thumbnail((size, size))
        axis.imshow(np.asarray(image))
    except ImageError:
        axis.imshow(np.full((size, size, 3), 200, np.uint8))
        caption = f"unreadable\n{caption}"
    axis.axis("on")
    axis.set_xticks([])
    axis.set_yticks([])
    for spine in axis.spines.values():
        spine.set_edgecolor(colour)
        spine.set_linewidth(3)
    axis.set_title(caption, fontsize=7)


def _title(figure: plt.Figure, text: str, size: float = 11) -> None:
    """A figure's title wrapped to its width: a grid of few thumbnails is narrower than the title (it was cut off)."""
    characters = max(20, int(figure.get_figwidth() * 72 / (0.55 * size)))
    figure.suptitle(textwrap.fill(text, characters), fontsize=size)


def _shorten(label: str, width: int = 18) -> str:
    return label if len(label) <= width else label[: width - 1] + "…"


def plot_similarity_histograms(
    vectors: np.ndarray, labels: Sequence[str], target: Path, max_points: int = 3000, seed: int = 0
) -> Path:
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
            axis.hist(
                similarity[pairs], bins=bins, density=True, alpha=0.6, label=f"{name} ({int(pairs.sum()):,} pairs)"
            )
    axis.set_xlabel("cosine similarity")
    axis.set_ylabel("density")
    axis.legend()
    axis.set_title("similarities of pairs")
    return _save(figure, target)


DIAGNOSTICS = (  # metric, axis range, which way is better
    ("alignment", (0.0, 2.0), "lower: same-label pairs closer"),
    ("uniformity", (-4.0, 0.0), "lower: spread more evenly on the sphere"),
    ("tolerance", (0.0, 1.0), "higher: each class kept together"),
)


def plot_diagnostics(metrics: dict, target: Path) -> Path:
    """Alignment, uniformity and tolerance of the embeddings, each on its own scale with the better direction named."""
    figure, axes = plt.subplots(len(DIAGNOSTICS), 1, figsize=(6, 3.2))
    for axis, (name, limits, better) in zip(axes, DIAGNOSTICS):
        value = float(metrics.get(name, float("nan")))
        axis.barh([0], [value - limits[0]], left=limits[0], color="tab:blue", height=0.5)
        axis.set_xlim(*limits)
        axis.set_yticks([])
        axis.set_title(f"{name} {value:.3f}  ({better})", fontsize=9, loc="left")
    figure.suptitle("embedding diagnostics", fontsize=10)
    return _save(figure, target)


def plot_embedding_map(
    points: np.ndarray,
    labels: Sequence[str],
    target: Path,
    title: str,
    legend_limit: int = 20,
    highlight: str | None = None,
) -> np.ndarray:
    """Draws 2-D points coloured by label with a legend (up to legend_limit labels; above, in one colour, the title
    saying so) and returns each point's
    position in the PNG's pixels (x right, y down), so that a click on the image can be mapped to a point.

    highlight: one label drawn large in red over the others in grey (the way to find a label among many).
    Uses a Figure of its own rather than pyplot, so that server threads can draw at the same time.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(8, 6), dpi=100)
    canvas = FigureCanvasAgg(figure)
    axis = figure.add_subplot()
    names, codes = np.unique(np.asarray(labels, dtype=str), return_inverse=True)
    coloured = highlight is None and len(names) <= legend_limit  # more labels than colours a legend can name: one
    if coloured:
        axis.scatter(points[:, 0], points[:, 1], c=matplotlib.colormaps["tab20"](codes % 20), s=14, linewidths=0)
    elif highlight is None:
        axis.scatter(points[:, 0], points[:, 1], color="#4c72b0", s=12, linewidths=0)
    else:
        chosen = np.asarray(labels, dtype=str) == highlight
        axis.scatter(points[~chosen, 0], points[~chosen, 1], color="#c8c8c8", s=10, linewidths=0, label="other labels")
        axis.scatter(
            points[chosen, 0], points[chosen, 1], color="#d62728", s=40, linewidths=0, label=_shorten(highlight)
        )
    if highlight is not None or len(names) <= legend_limit:
        if highlight is None:
            for code, name in enumerate(names):
                colour = matplotlib.colormaps["tab20"](code % 20)
                axis.scatter([], [], color=colour, label=_shorten(name or "(unlabeled)"), s=14)
        axis.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    many = "" if coloured or highlight is not None else " (too many to colour apart: highlight one)"
    axis.set_title(f"{title} · {len(names)} labels{many} · click a point to search with it", fontsize=9)
    axis.set_xticks([])
    axis.set_yticks([])
    figure.tight_layout()
    canvas.draw()
    pixels = axis.transData.transform(np.asarray(points, dtype=np.float64)) if len(points) else np.zeros((0, 2))
    pixels[:, 1] = canvas.get_width_height()[1] - pixels[:, 1]
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    write_atomic(target, buffer.getvalue())
    return pixels


def _save(figure: plt.Figure, target: Path) -> Path:
    if figure.get_layout_engine() is None:
        figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    plt.close(figure)
    write_atomic(target, buffer.getvalue())
    return target
