"""The training recipe's ablation on the embedded icons dataset, chosen on held-out training classes.

--split validation (the default, for choosing): a seeded fifth of the *training* classes is held
out as a validation set (retrieval.data.split_by_class, seed 0); each configuration is trained on
the other four fifths, exported, and scored leave-one-out on the validation classes, which is what
a choice may look at, and on test/ (classes never seen in training), which is only reported.
--split full trains on all of train/ and scores test/, as `retrieval demo` does (the shipped
recipe's headline figures).

A configuration is a name and the `retrieval train` options it adds to the shipped defaults (the
empty string is the shipped recipe). Every run goes through the command line in its own process
(`retrieval train`, `export`, `evaluate`), so the figures are what a user gets. The table gives,
per configuration, the mean and the spread (half the range) over the seeds of the validation
recall@1 and MAP@R, the test recall@1, recall@5, MAP@R, uniformity and tolerance, and the training time.

    python bench/recipe.py [--split validation|full] [--seeds 0,1,2] [--epochs N] [--only NAME,...] [--variants NAME,...] [--out docs/recipe.json] [--markdown table.md]

--epochs shortens every run (the table says so); --only runs some of the configurations; --variants
scores each trained run again with other export or evaluate options (VARIANTS: whitening, re-ranking),
as rows named "configuration + variant" with the run's training time; a run already trained in
--work is scored without training it again.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from retrieval.data import load_collection, split_by_class, write_collection_csv
from retrieval.datasets import icons

RETRIEVAL = str(Path(sys.executable).with_name("retrieval"))
CONFIGURATIONS = {
    "shipped": "",
    "supcon t=0.1": "--temperature 0.1",
    "supcon t=0.2": "--temperature 0.2",
    "supcon t=0.5": "--temperature 0.5",
    "infonce t=0.07": "--loss infonce --temperature 0.07",
    "infonce t=0.2": "--loss infonce --temperature 0.2",
    "infonce t=0.5": "--loss infonce --temperature 0.5",
    "npair": "--loss npair",
    "hcl t=0.1": "--loss hcl --temperature 0.1",
    "hcl t=0.2": "--loss hcl --temperature 0.2",
    "hcl t=0.5": "--loss hcl --temperature 0.5",
    "hard t=0.05": "--loss hard --temperature 0.05",
    "hard t=0.1": "--loss hard --temperature 0.1",
    "hard t=0.2": "--loss hard --temperature 0.2",
    "with a queue of 1024": "--queue-size 1024",
    "no augmentation": "--augment none",
    "no crop": "--augment color",
    "no colour jitter": "--augment crop",
    "with hue": "--augment crop,color,hue",
    "with grayscale": "--augment crop,color,grayscale",
    "with inversion": "--augment crop,color,invert",
    "with blur": "--augment crop,color,blur",
    "with affine": "--augment crop,color,affine",
    "with erasing": "--augment crop,color,erase",
    "small stem": "--stem small",
    "small stem at equal time": "--stem small --epochs 12",  # 12 small-stem epochs take about as long as the shipped 50
    "mobilenet_v3_small": "--backbone mobilenet_v3_small",
    "2 images per class": "--images-per-class 2",
    "8 images per class": "--images-per-class 8",
    "embedding 128": "--embedding-dim 128",
    "learning rate 3e-3": "--learning-rate 3e-3",
    "learning rate 3e-4": "--learning-rate 3e-4",
    "no warm-up": "--warmup 0",
    "weight decay 5e-4": "--weight-decay 5e-4",
    "image size 96": "--image-size 96",
    "validation 15 % with patience 10": "--val-classes 0.15 --patience 10",
    "gem": "--pooling gem",
    "stages 3 and 4": "--layers 3,4",
    "gem and stages 3 and 4": "--pooling gem --layers 3,4",
    "ema 0.99": "--ema 0.99",
    "ema 0.995": "--ema 0.995",
    "bf16": "--precision bf16",
    "bf16 for 80 epochs": "--precision bf16 --epochs 80",
}
# Variants scored on the same trained run: options of `retrieval export` and of `retrieval evaluate`.
VARIANTS = {
    "": ("", ""),
    "no whitening": ("--whiten none", ""),
    "whitened 0.1": ("--whiten 0.1", ""),
    "whitened 0.3": ("--whiten 0.3", ""),
    "whitened 0.6": ("--whiten 0.6", ""),
    "whitened 0.8": ("--whiten 0.8", ""),
    "qe n=1": ("--whiten none", "--rerank qe:n=1"),
    "qe n=2": ("--whiten none", "--rerank qe:n=2"),
    "dba n=1": ("--whiten none", "--rerank dba:n=1"),
    "dba n=2": ("--whiten none", "--rerank dba:n=2"),
    "k-reciprocal k1=20": ("--whiten none", "--rerank kreciprocal:k1=20,k2=6,lambda=0.3"),
    "k-reciprocal k1=6": ("--whiten none", "--rerank kreciprocal:k1=6,k2=3,lambda=0.3"),
    "whitened 0.8 with qe n=1": ("--whiten 0.8", "--rerank qe:n=1"),
    "whitened 0.8 with qe n=2": ("--whiten 0.8", "--rerank qe:n=2"),
    "whitened 0.8 with dba n=1": ("--whiten 0.8", "--rerank dba:n=1"),
    "whitened 0.8 with dba n=2": ("--whiten 0.8", "--rerank dba:n=2"),
    "whitened 0.8 with k-reciprocal k1=6": ("--whiten 0.8", "--rerank kreciprocal:k1=6,k2=3,lambda=0.3"),
    "whitened 0.8 with k-reciprocal k1=20": ("--whiten 0.8", "--rerank kreciprocal:k1=20,k2=6,lambda=0.3"),
}
SHOWN = ("recall@1", "recall@5", "map@r", "uniformity", "tolerance")
VALIDATION_SHOWN = ("val recall@1", "val map@r")
VALIDATION_SHARE = 0.2  # of the training classes, held out with --split validation


def training_data(split: str, work: Path) -> tuple[Path, Path | None]:
    """What to train on and the held-out classes to choose on: the whole train/ and None, or with
    --split validation CSVs of four fifths of its classes and the seeded other fifth (seed 0)."""
    if split == "full":
        return icons() / "train", None
    fit, validation = split_by_class(load_collection(icons() / "train").items, VALIDATION_SHARE, seed=0)
    return write_collection_csv(work / "fit.csv", fit), write_collection_csv(work / "validation.csv", validation)


def run_quietly(*arguments: str) -> None:
    """Runs a `retrieval` command, its output discarded; fails loudly."""
    subprocess.run([RETRIEVAL, *arguments], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def scores(run: Path, images: Path, options: str = "") -> dict:
    """`retrieval evaluate RUN IMAGES [options]` (leave-one-out), and the metrics.json it writes."""
    run_quietly("evaluate", str(run), str(images), *shlex.split(options))
    return json.loads((run / "metrics.json").read_text())


def trained(name: str, options: str, seed: int, epochs: int | None, split: str, fit: Path, work: Path) -> tuple[Path, float]:
    """The run of a configuration, trained unless --work already holds it finished; and its training time."""
    run = work / split / f"{name.replace(' ', '_').replace('=', '').replace(',', '')}-seed{seed}{'' if epochs is None else f'-{epochs}ep'}"
    timing = run / "train_seconds.json"
    if timing.is_file():
        return run, json.loads(timing.read_text())
    extra = shlex.split(options) + (["--epochs", str(epochs)] if epochs else [])
    started = time.perf_counter()
    run_quietly("train", str(fit), "--run", str(run), "--seed", str(seed), "--overwrite", *extra)
    seconds = time.perf_counter() - started
    timing.write_text(json.dumps(seconds))
    return run, seconds


def one_run(name: str, variant: str, seed: int, epochs: int | None, split: str, data: tuple[Path, Path | None], work: Path) -> dict:
    """Trains on data's first part (once per configuration), exports and scores the variant on data's held-out
    classes (if any) and test/; returns the figures."""
    fit, validation = data
    run, seconds = trained(name, CONFIGURATIONS[name], seed, epochs, split, fit, work)
    export_options, evaluate_options = VARIANTS[variant]
    run_quietly("export", str(run), *shlex.split(export_options))
    figures = {}
    if validation is not None:
        held_out = scores(run, validation, evaluate_options)
        figures = {"val recall@1": held_out["recall@1"], "val map@r": held_out["map@r"]}
    test = scores(run, icons() / "test", evaluate_options)
    options = " ".join(part for part in (CONFIGURATIONS[name], export_options, evaluate_options) if part)
    return {"name": name + (f" + {variant}" if variant else ""), "options": options, "seed": seed, "epochs": epochs, "split": split, "train_seconds": seconds, **figures, **{key: test[key] for key in SHOWN}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--split", choices=("validation", "full"), default="validation", help="validation: fit on 4/5 of the training classes, choose on the rest; full: train on all")
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--epochs", type=int, default=None, help="shorten every run to this many epochs")
    parser.add_argument("--only", default=None, help="configuration names separated by commas")
    parser.add_argument("--variants", default="", help="VARIANTS names separated by commas, scored on each run ('' is the plain export)")
    parser.add_argument("--out", type=Path, default=Path("recipe.json"))
    parser.add_argument("--work", type=Path, default=Path("/tmp/recipe"))
    parser.add_argument("--markdown", type=Path, default=None, help="also write the table here as Markdown")
    args = parser.parse_args()
    console = Console(width=160)
    names = args.only.split(",") if args.only else list(CONFIGURATIONS)
    seeds = [int(seed) for seed in args.seeds.split(",")]
    rows = json.loads(args.out.read_text()) if args.out.is_file() else []  # later runs add to earlier ones
    data = training_data(args.split, args.work)
    variants = args.variants.split(",")
    for name, seed, variant in ((name, seed, variant) for name in names for seed in seeds for variant in variants):
        shown_name = name + (f" + {variant}" if variant else "")
        if any(same_setting(row, args.epochs, args.split) and row["name"] == shown_name and row["seed"] == seed for row in rows):
            continue
        rows.append(one_run(name, variant, seed, args.epochs, args.split, data, args.work))
        chosen_on = f"validation recall@1 {rows[-1]['val recall@1']:.3f}, MAP@R {rows[-1]['val map@r']:.3f}; " if args.split == "validation" else ""
        console.print(f"{shown_name} seed {seed}: {chosen_on}test recall@1 {rows[-1]['recall@1']:.3f}, MAP@R {rows[-1]['map@r']:.3f}, {rows[-1]['train_seconds']:.0f} s")
        args.out.write_text(json.dumps(rows, indent=1) + "\n")
    epochs = "the shipped number of epochs" if args.epochs is None else f"{args.epochs} epochs"
    shown = (*VALIDATION_SHOWN, *SHOWN) if args.split == "validation" else SHOWN
    header = ("configuration", "options", "seeds", *shown, "train s")
    lines = summary(rows, args.epochs, args.split, shown)
    trained_on = "trained on 4/5 of the training classes, chosen on the other 1/5 (val), test classes reported" if args.split == "validation" else "trained on all training classes"
    table = Table(title=f"icons, leave-one-out; {trained_on}; {epochs}; mean ± half-range over the seeds run")
    for column in header:
        table.add_column(column)
    for line in lines:
        table.add_row(*line)
    console.print(table)
    if args.markdown:
        write_markdown(args.markdown, header, lines)


def write_markdown(path: Path, header: tuple[str, ...], lines: list[tuple[str, ...]]) -> None:
    """Writes a table as Markdown (for docs/ and the README)."""
    text = "\n".join("| " + " | ".join(cells) + " |" for cells in [header, ("---",) * len(header), *lines])
    path.write_text(text + "\n")


def same_setting(row: dict, epochs: int | None, split: str) -> bool:
    """Whether a stored row was run with these epochs on this split (rows from before --split trained on all of train/)."""
    return row["epochs"] == epochs and row.get("split", "full") == split


def summary(rows: list[dict], epochs: int | None, split: str, shown: tuple[str, ...]) -> list[tuple[str, ...]]:
    """One line per configuration run in this setting, in the order of CONFIGURATIONS: its options, seeds, mean ± half-range of each figure, training time."""
    lines = []
    order = list(CONFIGURATIONS)

    def place(name: str) -> int:
        base = name.split(" + ")[0]
        return order.index(base) if base in order else len(order)

    for name in sorted(dict.fromkeys(row["name"] for row in rows), key=place):
        runs = [row for row in rows if row["name"] == name and same_setting(row, epochs, split)]
        if not runs:
            continue

        def cell(key: str, runs: list[dict] = runs) -> str:
            values = np.array([row[key] for row in runs])
            return f"{values.mean():.3f}" + (f" ± {(values.max() - values.min()) / 2:.3f}" if len(values) > 1 else "")

        options = f"`{runs[0]['options']}`" if runs[0]["options"] else "(defaults)"
        lines.append((name, options, str(len(runs)), *(cell(key) for key in shown), f"{np.mean([row['train_seconds'] for row in runs]):.0f}"))
    return lines


if __name__ == "__main__":
    main()
