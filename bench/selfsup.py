"""Learning without labels on the embedded icons: self-supervised methods, partly labeled training, adaptation to
the gallery, side by side with the supervised recipe, chosen on held-out training classes.

--split validation (the default, for choosing): a seeded fifth of the training classes is held out (as
bench/recipe.py does); each configuration trains on the other four fifths and is scored leave-one-out
on the held-out fifth (what a choice may look at) and on test/ (only reported). --split full trains on
all of train/ and scores test/. The images a configuration adapts to are those it is scored on: the
held-out fifth with --split validation, test/ with --split full (their labels never reach training).

A configuration is `retrieval train` options; in them {gallery} stands for those images, and a
configuration whose name starts with "25 %" trains on a copy of the training CSV in which a seeded
three quarters of the images lose their labels ("25 % labeled...": partly labeled) or are left out
("25 % only": the supervised loss on the labeled quarter alone). Every run goes through the command line in
its own process (`retrieval train`, `export`, `evaluate`), one after another, so that their times compare.

    python bench/selfsup.py [--split validation|full] [--seeds 0,1,2] [--only NAME,...] [--epochs N] [--out docs/selfsup.json] [--markdown table.md]
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).parent))
from recipe import run_quietly, scores, training_data, write_markdown  # noqa: E402

from retrieval.data import Item, load_collection, write_collection_csv  # noqa: E402
from retrieval.datasets import icons  # noqa: E402

CONFIGURATIONS = {
    "supervised (the recipe)": "",
    "simclr": "--self-supervised --loss simclr",
    "simclr t=0.2": "--self-supervised --loss simclr --temperature 0.2",
    "simclr t=0.5": "--self-supervised --loss simclr --temperature 0.5",
    "simclr mild crop": "--self-supervised --loss simclr --ssl-augment crop,jitter,grayscale,blur",
    "simclr 50 epochs": "--self-supervised --loss simclr --epochs 50",
    "moco": "--self-supervised --loss moco",
    "moco t=0.1": "--self-supervised --loss moco --temperature 0.1",
    "instdisc": "--self-supervised --loss instdisc",
    "instdisc nce 256": "--self-supervised --loss instdisc --nce-negatives 256",
    "instdisc proximal 30": "--self-supervised --loss instdisc --proximal 30",
    "hcl": "--self-supervised --loss hcl",
    "hcl t=0.2": "--self-supervised --loss hcl --temperature 0.2",
    "hard": "--self-supervised --loss hard",
    "hard t=0.1": "--self-supervised --loss hard --temperature 0.1",
    "adapted": "--adapt {gallery}",
    "adapted weight 0.5": "--adapt {gallery} --ssl-weight 0.5",
    "adapted weight 2": "--adapt {gallery} --ssl-weight 2",
    "adapted 32 gallery images a batch": "--adapt {gallery} --ssl-batch 32",
    "adapted 128 gallery images a batch": "--adapt {gallery} --ssl-batch 128",
    "adapted mild views": "--adapt {gallery} --ssl-augment crop,color,grayscale,blur",
    "adapted ssl t=0.2": "--adapt {gallery} --ssl-temperature 0.2",
    "adapted hcl": "--adapt {gallery} --ssl-loss hcl",
    "adapted joint": "--adapt {gallery} --ssl-loss joint",
    "adapted joint 128 gallery images a batch": "--adapt {gallery} --ssl-loss joint --ssl-batch 128",
    "adapted joint 32 gallery images a batch": "--adapt {gallery} --ssl-loss joint --ssl-batch 32",
    "25 % labeled": "",
    "25 % labeled joint": "--ssl-loss joint",
    "25 % only": "",
    "25 % labeled 150 epochs": "--epochs 150",
    "25 % only 150 epochs": "--epochs 150",
}
SHOWN = ("recall@1", "recall@5", "map@r")
LABELED_SHARE = 0.25


def partly_labeled(fit: Path, work: Path, keep_unlabeled: bool) -> Path:
    """A CSV of fit's images with a seeded quarter of them labeled; the rest unlabeled, or left out."""
    items = load_collection(fit).items
    labeled = set(np.random.default_rng(0).permutation(len(items))[: round(LABELED_SHARE * len(items))].tolist())
    kept = [item if n in labeled else Item(item.path, "") for n, item in enumerate(items) if keep_unlabeled or n in labeled]
    return write_collection_csv(work / ("partly.csv" if keep_unlabeled else "quarter.csv"), kept)


def one_run(name: str, seed: int, epochs: int | None, split: str, fit: Path, held: Path, work: Path) -> dict:
    """Trains a configuration (unless --work holds the run), exports it and scores it on the held-out classes and
    (with --split validation) test/."""
    data = partly_labeled(fit, work, name.startswith("25 % labeled")) if name.startswith("25 %") else fit
    options = CONFIGURATIONS[name].replace("{gallery}", str(held))
    run = work / split / f"{''.join(c if c.isalnum() else '_' for c in name)}-seed{seed}{'' if epochs is None else f'-{epochs}ep'}"
    timing = run / "train_seconds.json"
    if not timing.is_file():
        started = time.perf_counter()
        extra = ["--epochs", str(epochs)] if epochs else []
        run_quietly("train", str(data), "--run", str(run), "--seed", str(seed), "--overwrite", *shlex.split(options), *extra)
        timing.write_text(json.dumps(time.perf_counter() - started))
    run_quietly("export", str(run))
    figures = {"name": name, "options": options.replace(str(held), "{gallery}"), "seed": seed, "epochs": epochs, "split": split}
    figures["train_seconds"] = json.loads(timing.read_text())
    held_out = scores(run, held)
    figures.update({f"held {key}": held_out[key] for key in SHOWN})
    if split == "validation":
        test = scores(run, icons() / "test")
        figures.update({f"test {key}": test[key] for key in SHOWN})
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--split", choices=("validation", "full"), default="validation")
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--epochs", type=int, default=None, help="shorten every run to this many epochs")
    parser.add_argument("--only", default=None, help="configuration names separated by commas")
    parser.add_argument("--out", type=Path, default=Path("selfsup.json"))
    parser.add_argument("--work", type=Path, default=Path("/tmp/selfsup"))
    parser.add_argument("--markdown", type=Path, default=None, help="also write the table here as Markdown")
    args = parser.parse_args()
    console = Console(width=180)
    names = args.only.split(",") if args.only else list(CONFIGURATIONS)
    unknown = [name for name in names if name not in CONFIGURATIONS]
    if unknown:
        parser.error(f"unknown configuration(s) {unknown}; choose from {list(CONFIGURATIONS)}")
    seeds = [int(seed) for seed in args.seeds.split(",")]
    rows = json.loads(args.out.read_text()) if args.out.is_file() else []  # later runs add to earlier ones
    fit, validation = training_data(args.split, args.work)
    held = validation if validation is not None else icons() / "test"
    for name in names:
        for seed in seeds:
            if any(row["name"] == name and row["seed"] == seed and row["epochs"] == args.epochs and row["split"] == args.split for row in rows):
                continue
            rows.append(one_run(name, seed, args.epochs, args.split, fit, held, args.work))
            console.print(f"{name} seed {seed}: held-out recall@1 {rows[-1]['held recall@1']:.3f}, MAP@R {rows[-1]['held map@r']:.3f}, {rows[-1]['train_seconds']:.0f} s")
            args.out.write_text(json.dumps(rows, indent=1) + "\n")
    shown = [f"held {key}" for key in SHOWN] + ([f"test {key}" for key in SHOWN] if args.split == "validation" else [])
    header = ("configuration", "options", "seeds", *shown, "train s", "time / supervised")
    lines = summary(rows, args.epochs, args.split, shown)
    held_name = "the held-out fifth of the training classes (test/ reported)" if args.split == "validation" else "test/"
    table = Table(title=f"icons, leave-one-out on {held_name}; mean ± half-range over the seeds")
    for column in header:
        table.add_column(column)
    for line in lines:
        table.add_row(*line)
    console.print(table)
    if args.markdown:
        write_markdown(args.markdown, header, lines)


def summary(rows: list[dict], epochs: int | None, split: str, shown: list[str]) -> list[tuple[str, ...]]:
    """One line per configuration run in this setting: options, seeds, mean ± half-range, time and its ratio to the
    supervised recipe's (same seeds' mean)."""
    chosen = [row for row in rows if row["epochs"] == epochs and row["split"] == split]
    supervised = [row["train_seconds"] for row in chosen if row["name"] == "supervised (the recipe)"]
    lines = []
    for name in [name for name in CONFIGURATIONS if any(row["name"] == name for row in chosen)]:
        runs = [row for row in chosen if row["name"] == name]

        def cell(key: str, runs: list[dict] = runs) -> str:
            values = np.array([row[key] for row in runs])
            return f"{values.mean():.3f}" + (f" ± {(values.max() - values.min()) / 2:.3f}" if len(values) > 1 else "")

        seconds = float(np.mean([row["train_seconds"] for row in runs]))
        ratio = f"{seconds / np.mean(supervised):.2f}" if supervised else ""
        lines.append((name, f"`{runs[0]['options']}`" if runs[0]["options"] else "(defaults)", str(len(runs)), *(cell(key) for key in shown), f"{seconds:.0f}", ratio))
    return lines


if __name__ == "__main__":
    main()
