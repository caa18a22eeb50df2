"""The calibrated match threshold on held-out classes: is a marked match right as often as the target says, on
images the threshold was not fitted on, and do queries from another domain stay below it?

Two settings, each a run trained on some classes and calibrated on others it never saw:

- glyphs: characters rendered in this machine's fonts (bench/glyphs.py), a class per character; two runs
  train on the capitals and digits (3 epochs: recall@1 about 0.9 on held-out letters; the recipe's 50:
  about 0.99), the threshold is fitted on half of the lowercase letters (a, c, e, ...) and checked on
  the other half (b, d, f, ...);
- icons: the embedded icons, the run trained on four fifths of the training classes (bench/recipe.py's
  --split validation), fitted on the held-out fifth and checked on test/.

Fitting and checking go through the command line (`retrieval evaluate RUN FIT --calibrate
--target-precision T`, then `retrieval evaluate RUN CHECK`, which measures the stored threshold); the
out-of-domain queries go through the one search path (index.search) against an index of the check
images, and count how many have a best hit marked a match: seeded noise images, and the other
setting's images (icons against the glyphs, glyphs against the icons). Runs already in --work are reused.

    python bench/threshold.py [--work DIR] [--targets 0.9,0.7,0.5] [--out docs/threshold.json] [--plot docs/threshold.png]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from PIL import Image
from rich.console import Console
from rich.table import Table

BENCH = Path(__file__).resolve().parent
sys.path = [entry for entry in sys.path if Path(entry or ".").resolve() != BENCH]  # bench/index.py is not index/
from index.build import build_index  # noqa: E402
from index.search import Query, search_images  # noqa: E402

sys.path.append(str(BENCH))  # after the packages
from glyphs import DIGITS, LOWER, UPPER, folder_name, write_glyphs  # noqa: E402
from recipe import run_quietly, training_data  # noqa: E402
from retrieval.data import Item, load_collection, write_collection_csv  # noqa: E402
from retrieval.datasets import icons  # noqa: E402
from retrieval.embedders import OnnxEmbedder  # noqa: E402
from retrieval.evaluation import evaluate_collection  # noqa: E402
from retrieval.runs import RunDir  # noqa: E402

NOISE = 200  # noise queries: half pixel noise, half smooth blobs
OTHER = 500  # queries of the other setting's images (a seeded sample)
SHORT = 3  # epochs of the short glyph run: recall@1 about 0.9 on the held-out letters (at 50, 0.99: every hit right)


def glyph_sets(work: Path) -> tuple[Path, Path, Path]:
    """(train, fit, check) CSVs of the glyphs: capitals and digits; a, c, e, ...; b, d, f, ..."""
    root = write_glyphs(work / "glyphs", UPPER + LOWER + DIGITS)

    def listed(name: str, chars: str) -> Path:
        items = [Item(path, folder_name(char)) for char in chars for path in sorted((root / folder_name(char)).glob("*.png"))]
        return write_collection_csv(work / f"glyphs-{name}.csv", items)

    return listed("train", UPPER + DIGITS), listed("fit", LOWER[0::2]), listed("check", LOWER[1::2])


def noise_images(work: Path, count: int = NOISE) -> list[Path]:
    """Seeded noise queries: pixel noise and smooth random blobs, 64 px."""
    folder = work / "noise"
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    paths = []
    for number in range(count):
        pixels = rng.integers(0, 256, (64, 64, 3), dtype=np.uint8) if number % 2 == 0 else None
        image = Image.fromarray(pixels) if pixels is not None else Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).resize((64, 64), Image.BICUBIC)
        path = folder / f"noise-{number:03d}.png"
        image.save(path)
        paths.append(path)
    return paths


def trained(run: Path, data: Path, epochs: int | None = None) -> Path:
    """The run, trained with the default recipe (epochs: fewer) and exported unless --work already holds it."""
    if not (run / "model.onnx").is_file():
        run_quietly("train", str(data), "--run", str(run), "--overwrite", *(["--epochs", str(epochs)] if epochs else []))
        run_quietly("export", str(run))
    return run


def marked(run: Path, check: Path, queries: list[Path], work: Path) -> float:
    """The share of queries whose best hit in an index of the check images is marked a match."""
    embedder = OnnxEmbedder.from_run(RunDir(run))
    index = build_index(embedder, load_collection(check), work / "index", rebuild=True, progress=False).index
    found = search_images(index, embedder, queries, [Query(1, threshold=_stored(run))] * len(queries))
    return float(np.mean([bool(result.hits and result.hits[0].match) for result in found]))


def _stored(run: Path) -> float:
    return json.loads((run / "model.json").read_text())["match_threshold"]["similarity"]


def curve(run: Path, images: Path) -> tuple[list[float], list[float]]:
    """(coverage, precision) of every best-hit similarity taken as the threshold, highest first."""
    scores = evaluate_collection(OnnxEmbedder.from_run(RunDir(run)), load_collection(images), progress=False).scores
    order = np.argsort(-scores.similarities[:, 0], kind="stable")
    right = (scores.first_hit == 0)[order]
    count = np.arange(1, len(right) + 1)
    return (count / len(right)).tolist(), (np.cumsum(right) / count).tolist()


def setting(name: str, run: Path, fit: Path, check: Path, others: tuple[list[Path], str, list[Path]], target: float, work: Path) -> dict:
    """Fit at the target on fit, measure on check and against the out-of-domain queries."""
    run_quietly("evaluate", str(run), str(fit), "--calibrate", "--target-precision", str(target))
    card = json.loads((run / "model.json").read_text())["match_threshold"]
    fitted = json.loads((run / "metrics.json").read_text())
    run_quietly("evaluate", str(run), str(check))
    checked = json.loads((run / "metrics.json").read_text())
    noise, other_name, other = others
    return {
        "setting": name, "target": target, "threshold": card["similarity"], "fit recall@1": fitted["recall@1"],
        "fit precision": card["precision"], "fit coverage": card["coverage"], "held-out classes precision": card["held_out_precision"],
        "check recall@1": checked["recall@1"], "check precision": checked["match precision"], "check coverage": checked["match coverage"],
        "noise marked": marked(run, check, noise, work / name), "other domain": other_name, "other domain marked": marked(run, check, other, work / name),
    }


def plot(curves: dict[str, tuple[list[float], list[float]]], targets: list[float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4.5))
    for label, (coverage, precision) in curves.items():
        axis.plot(coverage, precision, label=label, linestyle="--" if "check" in label else "-")
    for target in targets:
        axis.axhline(target, color="grey", linewidth=0.6)
    axis.set_xlabel("coverage (queries whose best hit reaches the threshold)")
    axis.set_ylabel("top-1 precision of those queries")
    axis.set_ylim(0, 1.02)
    axis.set_title("precision against coverage as the threshold falls (held-out classes)")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("/tmp/threshold-bench"))
    parser.add_argument("--targets", default="0.9,0.7,0.5")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()
    targets = [float(value) for value in args.targets.split(",")]
    args.work.mkdir(parents=True, exist_ok=True)
    glyph_train, glyph_fit, glyph_check = glyph_sets(args.work)
    icon_fit, icon_validation = training_data("validation", args.work)
    runs = {
        f"glyphs, {SHORT} epochs": trained(args.work / f"glyph-run-{SHORT}", glyph_train, SHORT),
        "glyphs, 50 epochs": trained(args.work / "glyph-run", glyph_train),
        "icons": trained(args.work / "icon-run", icon_fit),
    }
    sets = {name: (glyph_fit, glyph_check) for name in runs if name.startswith("glyphs")}
    sets["icons"] = (icon_validation, icons() / "test")
    rng = np.random.default_rng(0)
    noise = noise_images(args.work)
    icon_images = [item.path for item in load_collection(icons() / "test").items]
    glyph_images = [item.path for item in load_collection(glyph_check).items + load_collection(glyph_fit).items]
    icon_queries = sorted(rng.choice(icon_images, min(OTHER, len(icon_images)), replace=False).tolist())
    others = {name: (noise, "icons", icon_queries) for name in runs if name.startswith("glyphs")}
    others["icons"] = (noise, "glyphs", sorted(rng.choice(glyph_images, min(OTHER, len(glyph_images)), replace=False).tolist()))
    rows = [setting(name, runs[name], *sets[name], others[name], target, args.work) for name in runs for target in targets]
    report(rows)
    if args.out:
        args.out.write_text(json.dumps({"targets": targets, "rows": rows}, indent=2) + "\n")
    if args.plot:
        curves = {f"{name} {part}": curve(runs[name], images) for name in runs for part, images in zip(("fit", "check"), sets[name])}
        plot(curves, targets, args.plot)


def report(rows: list[dict]) -> None:
    table = Table(title="match threshold: fitted on held-out classes, checked on others")
    for column in rows[0]:
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(*("" if value is None else f"{value:.3f}" if isinstance(value, float) else str(value) for value in row.values()))
    Console(width=250).print(table)


if __name__ == "__main__":
    main()
