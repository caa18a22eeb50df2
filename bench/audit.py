"""`retrieval audit` measured: wrong labels found, copies found, outliers found, and its time on 10,000 images.

- wrong labels: 5 % of a collection's labels moved to another class (seeded; seeds 0-4), audited by a
  run that did not train on the collection (`retrieval audit RUN MOVED.csv --json`): precision@N of the
  top N suspects (N = the number moved) and the share of the moved ones in the top 2N, beside a plain
  similarity-weighted vote of 10 neighbours. Glyphs (bench/glyphs.py; the 3-epoch run of
  bench/threshold.py, trained on capitals and digits): a, c, e, ... to choose on, b, d, f, ... to report;
  icons: the run trained on four fifths of the training classes, its held-out fifth to choose on,
  test/ to report. Own training images: a run trained on icons train/ with 5 % of its labels moved,
  audited on those images plainly and with --folds.
- copies: 100 copies planted into a collection (seeded: JPEG q=60, resized 0.5-2x, a 10 % crop, grey,
  in turn), every candidate pair's difference kept (the threshold set to 1): recall and false pairs at
  each threshold (the precision-recall curve), on the icons' held-out training fifth (to choose) and on
  test/ (to report). Pairs of the original images count as false unless their pixels are identical.
- outliers: 20 noise images and 20 glyphs planted into the icons' test/: how many are listed, and how
  many of the icons are.
- time: an audit of 10,000 images beside the embedding pass alone: augmented copies of the icons (many near
  copies: the copy check's worst case) and mosaics of four icons each (distinct pictures).

    python bench/audit.py [--work DIR] [--out docs/audit.json] [--plot docs/audit-copies.png]
"""

from __future__ import annotations

import argparse
import io
import json
from collections import Counter
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

BENCH = Path(__file__).resolve().parent
sys.path = [entry for entry in sys.path if Path(entry or ".").resolve() != BENCH]  # bench/index.py is not index/
import retrieval.audit as audit_module  # noqa: E402
from retrieval.audit import outliers  # noqa: E402
from retrieval.copies import augmented_copy  # noqa: E402
from retrieval.data import Item, load_collection, load_image, write_collection_csv  # noqa: E402
from retrieval.datasets import icons  # noqa: E402
from retrieval.duplicates import THUMBNAIL, find_copies  # noqa: E402
from retrieval.embedders import OnnxEmbedder, embed_items  # noqa: E402
from retrieval.knn import nearest_neighbours  # noqa: E402
from retrieval.runs import RunDir  # noqa: E402

sys.path.append(str(BENCH))  # after the packages
from recipe import RETRIEVAL, run_quietly, training_data  # noqa: E402
from threshold import SHORT, glyph_sets, noise_images, trained  # noqa: E402

SHARE = 0.05  # of the labels moved
SEEDS = range(5)
KINDS = ("jpeg", "resize", "crop", "grey")
SIZE = 64  # the icons' size, and the mosaics'


def slug(name: str) -> str:
    """A setting's name as a file name."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def moved(items: list[Item], seed: int) -> tuple[list[Item], set[Path]]:
    """The items with a seeded 5 % of their labels moved to another of the collection's labels, and those paths."""
    rng = np.random.default_rng(seed)
    labels = sorted({item.label for item in items})
    chosen = set(rng.choice(len(items), round(SHARE * len(items)), replace=False).tolist())
    out = []
    for row, item in enumerate(items):
        label = item.label
        if row in chosen:
            label = str(rng.choice([other for other in labels if other != item.label]))
        out.append(Item(item.path, label))
    return out, {items[row].path for row in chosen}


def audited(run: Path, data: Path, *options: str) -> dict:
    """`retrieval audit RUN DATA --json [options]`, parsed."""
    done = subprocess.run([RETRIEVAL, "audit", str(run), str(data), "--json", *options], check=True, capture_output=True, text=True)
    return json.loads(done.stdout)


def vote(run: Path, items: list[Item]) -> list[Path]:
    """The plain baseline: images by how little of a similarity-weighted vote of 10 neighbours their label gets."""
    embedded = embed_items(OnnxEmbedder.from_run(RunDir(run)), items, progress=False)
    labels = np.array([item.label for item in embedded.items])
    ids, sims = nearest_neighbours(embedded.vectors, embedded.vectors, 10, exclude_self=True)
    weights = np.maximum(sims, 0)
    own = (weights * (labels[ids] == labels[:, None])).sum(1) / np.maximum(weights.sum(1), 1e-12)
    return [embedded.items[row].path for row in np.argsort(own, kind="stable")]


def found(ranked: list[Path], moved_paths: set[Path]) -> tuple[float, float]:
    """(precision@N, share of the moved in the top 2N)."""
    count = len(moved_paths)
    return sum(path in moved_paths for path in ranked[:count]) / count, sum(path in moved_paths for path in ranked[: 2 * count]) / count


def labels_setting(name: str, run: Path, items: list[Item], work: Path, *options: str) -> dict:
    """Audit and vote over the seeds on a collection with labels moved."""
    audit_scores, vote_scores = [], []
    for seed in SEEDS:
        shifted, moved_paths = moved(items, seed)
        data = write_collection_csv(work / f"{slug(name)}-moved-{seed}.csv", shifted)
        suspects = [Path(row["path"]) for row in audited(run, data, *options)["labels"]]
        audit_scores.append(found(suspects, moved_paths))
        vote_scores.append(found(vote(run, shifted), moved_paths))
    audit_mean, vote_mean = np.mean(audit_scores, axis=0), np.mean(vote_scores, axis=0)
    return {
        "setting": name, "images": len(items), "moved": len(moved_paths), "options": " ".join(options),
        "audit precision@N": round(float(audit_mean[0]), 3), "audit top-2N recall": round(float(audit_mean[1]), 3),
        "vote precision@N": round(float(vote_mean[0]), 3), "vote top-2N recall": round(float(vote_mean[1]), 3),
    }  # fmt: skip


def planted(items: list[Item], work: Path, count: int = 100, seed: int = 0) -> list[tuple[Path, Path, str]]:
    """(original, copy, kind) for a seeded sample of the items, the copies written under work."""
    rng = np.random.default_rng(seed)
    work.mkdir(parents=True, exist_ok=True)
    out = []
    for number, row in enumerate(rng.choice(len(items), count, replace=False)):
        kind, image = KINDS[number % 4], load_image(items[row].path)
        if kind == "jpeg":
            buffer = io.BytesIO()
            image.save(buffer, "JPEG", quality=60)
            image = Image.open(io.BytesIO(buffer.getvalue())).convert("RGB")
        elif kind == "resize":
            scale = rng.uniform(0.5, 2.0)
            image = image.resize((max(8, round(image.width * scale)), max(8, round(image.height * scale))), Image.BICUBIC)
        elif kind == "crop":
            width, height = image.size
            left, top = rng.uniform(0, 0.1 * width), rng.uniform(0, 0.1 * height)
            image = image.crop((round(left), round(top), round(left + 0.9 * width), round(top + 0.9 * height)))
        else:
            image = image.convert("L").convert("RGB")
        path = work / f"{number:03d}-{kind}.{'jpg' if kind == 'jpeg' else 'png'}"
        image.save(path, **({"quality": 95} if kind == "jpeg" else {}))
        out.append((items[row].path, path, kind))
    return out


def copies_setting(name: str, run: Path, items: list[Item], work: Path) -> dict:
    """Every candidate pair's difference with copies planted: the curve, and the pairs that are truly copies."""
    copies = planted(items, work / f"{slug(name)}-copies")
    everything = items + [Item(copy, "") for _, copy, _ in copies]
    done = embed_items(OnnxEmbedder.from_run(RunDir(run)), everything, progress=False, thumbnail=THUMBNAIL)
    row_of = {item.path: row for row, item in enumerate(done.items)}
    true = {tuple(sorted((row_of[original], row_of[copy]))) for original, copy, _ in copies}
    pixels = {row: np.asarray(load_image(item.path)) for row, item in enumerate(done.items)}
    pairs = find_copies(done.vectors, done.hashes, done.thumbnails, threshold=1.0)
    same = {(p.a, p.b) for p in pairs if pixels[p.a].shape == pixels[p.b].shape and np.array_equal(pixels[p.a], pixels[p.b])}
    scored = [(p.difference, (p.a, p.b) in true or (p.a, p.b) in same) for p in pairs if p.difference < 1.0]
    differences = np.array([d for d, _ in scored])
    right = np.array([r for _, r in scored])
    thresholds = np.unique(np.r_[0.0, differences[differences <= 0.1]])
    curve = [
        {"threshold": float(t), "recall": float((differences[right] <= t).sum() / len(true | same)), "false pairs": int((differences[~right] <= t).sum())}
        for t in thresholds
    ]  # fmt: skip
    kinds = {kind: [tuple(sorted((row_of[o], row_of[c]))) for o, c, k in copies if k == kind] for kind in KINDS}
    differences_of = {(p.a, p.b): p.difference for p in pairs}
    worst = {kind: round(max(differences_of.get(pair, 1.0) for pair in rows), 4) for kind, rows in kinds.items()}
    return {"setting": name, "images": len(items), "planted": len(copies), "copies in the originals": len(same), "curve": curve, "worst difference by kind": worst}


def at_threshold(curve: list[dict], threshold: float) -> dict:
    """The curve's point at a threshold (the last one at or below it)."""
    below = [point for point in curve if point["threshold"] <= threshold]
    return below[-1] if below else {"threshold": threshold, "recall": 0.0, "false pairs": 0}


def outliers_setting(name: str, run: Path, items: list[Item], strangers: list[Path], spreads: list[float]) -> dict:
    """Each stranger (noise, glyphs) added alone to the items, and all of them at once: how many are listed as
    outliers at each robust spread, and how many of the items are."""
    embedder = OnnxEmbedder.from_run(RunDir(run))
    own = embed_items(embedder, items, progress=False)
    foreign = embed_items(embedder, [Item(path, "") for path in strangers], progress=False)
    rows = []
    for spread in spreads:
        audit_module.OUTLIER_SPREAD = spread
        alone = sum(
            bool([o for o in outliers(own.items + [item], np.concatenate([own.vectors, vector[None]])) if o.path == item.path])
            for item, vector in zip(foreign.items, foreign.vectors, strict=True)
        )
        together = {o.path for o in outliers(own.items + foreign.items, np.concatenate([own.vectors, foreign.vectors]))}
        rows.append({
            "spread": spread, "strangers found alone": alone, "strangers found together": sum(i.path in together for i in foreign.items),
            "collection listed": sum(i.path in together for i in own.items),
            "collection listed alone": len(outliers(own.items, own.vectors)),
        })  # fmt: skip
    trained_on = embed_items(embedder, load_collection(Path(json.loads(RunDir(run).config.read_text())["data"])).items, progress=False).vectors
    return {
        "setting": name, "images": len(own.items), "strangers": len(foreign.items), "by spread": rows,
        "AUROC, strangers together (noise; glyphs)": separation(own.vectors, foreign.vectors, trained_on),
    }  # fmt: skip


def separation(own: np.ndarray, foreign: np.ndarray, trained_on: np.ndarray) -> dict:
    """How well two scores tell the strangers (the first 20 noise, then glyphs) from the collection, all together, as
    AUROC (1: every stranger scores as more out of place than every image; 0.5: chance): the audit's closeness, and
    the Mahalanobis distance to the run's training images' embeddings (covariance shrunk by a tenth to its mean), and
    the similarity to the closest of them (k-NN out-of-distribution detection, Sun et al. 2022, k = 1)."""
    from sklearn.covariance import ShrunkCovariance
    from sklearn.metrics import roc_auc_score

    vectors = np.concatenate([own, foreign])
    distance = ShrunkCovariance(shrinkage=0.1).fit(trained_on).mahalanobis(vectors)
    scores = {
        "audit closeness": -audit_module.closeness(vectors), "Mahalanobis to the training images": distance,
        "closest training image": -(vectors @ trained_on.T).max(axis=1),
    }  # fmt: skip
    strangers = {"noise": np.arange(len(own), len(own) + 20), "glyphs": np.arange(len(own) + 20, len(vectors))}
    return {
        name: [round(float(roc_auc_score(np.r_[np.zeros(len(own)), np.ones(len(rows))], np.r_[score[: len(own)], score[rows]])), 3) for rows in strangers.values()]
        for name, score in scores.items()
    }  # fmt: skip


def mosaic(parts: list[Image.Image]) -> Image.Image:
    """Four pictures in a 2 x 2 grid at the icons' size: a picture unlike any other of the collection."""
    half = SIZE // 2
    canvas = Image.new("RGB", (SIZE, SIZE), "white")
    for place, part in enumerate(parts):
        canvas.paste(part.convert("RGB").resize((half, half)), ((place % 2) * half, (place // 2) * half))
    return canvas


def time_collection(items: list[Item], work: Path, kind: str, count: int) -> Path:
    """A CSV of `count` pictures made from the items: their augmented copies (many near copies, the copy
    check's worst case; labels they do not carry) or mosaics of four (distinct pictures, each labeled by
    its first part's label)."""
    folder = work / f"ten-thousand-{kind.replace(' ', '-')}"
    fresh = not folder.is_dir() or len(list(folder.glob("*.png"))) < count
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    listed = []
    for number in range(count):
        path = folder / f"{number:05d}.png"
        if kind == "augmented copies":
            item = items[number % len(items)]
            listed.append(Item(path, str(number % 10)))
            if fresh:
                augmented_copy(load_image(item.path), rng).save(path)
        else:
            parts = [items[index] for index in rng.choice(len(items), 4, replace=False)]
            listed.append(Item(path, parts[0].label))
            if fresh:
                mosaic([load_image(part.path) for part in parts]).save(path)
    return write_collection_csv(work / f"{folder.name}.csv", listed)


def time_setting(run: Path, items: list[Item], work: Path, kind: str, count: int = 10_000) -> dict:
    """The audit of `count` pictures of `time_collection` beside the embedding pass alone (one run, side by side)."""
    data = time_collection(items, work, kind, count)
    embedder = OnnxEmbedder.from_run(RunDir(run))
    started = time.perf_counter()
    embed_items(embedder, load_collection(data).items, progress=False)
    embedding = time.perf_counter() - started
    started = time.perf_counter()
    report = audited(run, data)
    whole = time.perf_counter() - started
    found = {"label suspects": len(report["labels"]), "copy groups": len(report["duplicates"])}
    return {"collection": kind, "images": count, **found, "embedding pass s": round(embedding, 1), "audit s (command, start-up included)": round(whole, 1), "ratio": round(whole / embedding, 2)}


def folds_setting(work: Path, epochs: int) -> dict:
    """A run trained on icons train/ with 5 % of its labels moved, audited on its own images plainly and with --folds
    (3, or fewer where the smallest label has fewer images)."""
    items = load_collection(icons() / "train").items
    shifted, moved_paths = moved(items, 0)
    data = write_collection_csv(work / "noisy-train.csv", shifted)
    run = work / "noisy-run"
    if not (run / "model.onnx").is_file():
        run_quietly("train", str(data), "--run", str(run), "--overwrite", "--epochs", str(epochs))
        run_quietly("export", str(run))
    folds = str(min(3, min(Counter(item.label for item in shifted).values())))  # as many as the smallest label allows
    started = time.perf_counter()
    folded = found([Path(row["path"]) for row in audited(run, data, "--folds", folds)["labels"]], moved_paths)
    seconds = time.perf_counter() - started
    plain = found([Path(row["path"]) for row in audited(run, data)["labels"]], moved_paths)
    voted = found(vote(run, shifted), moved_paths)
    return {
        "setting": f"icons train/, the run's own images ({epochs} epochs, 5 % moved before training)", "moved": len(moved_paths),
        "vote precision@N": voted[0], "audit precision@N": plain[0], "audit top-2N recall": plain[1], "folds": int(folds),
        "audit --folds precision@N": folded[0], "audit --folds top-2N recall": folded[1], "--folds s": round(seconds, 1),
    }  # fmt: skip


def plot(settings: list[dict], threshold: float, path: Path) -> None:
    """The copies' recall against false pairs as the threshold rises, per setting, the threshold marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6.4, 4.2))
    for setting in settings:
        curve = setting["curve"]
        axes.plot([p["false pairs"] for p in curve], [p["recall"] for p in curve], marker=".", label=setting["setting"])
        chosen = at_threshold(curve, threshold)
        axes.scatter([chosen["false pairs"]], [chosen["recall"]], color="black", zorder=3)
    axes.set_xlabel("false pairs reported")
    axes.set_ylabel("recall of the planted copies")
    axes.set_xscale("symlog", linthresh=1)
    axes.set_title(f"copies as the difference threshold rises (dot: {threshold:g})")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("/tmp/audit-bench"))
    parser.add_argument("--out", type=Path)
    parser.add_argument("--plot", type=Path)
    parser.add_argument("--fold-run-epochs", type=int, default=30)
    parser.add_argument("--skip", default="", help="comma-separated parts to leave out: labels, copies, outliers, time, folds")
    arguments = parser.parse_args()
    work, skip = arguments.work, set(arguments.skip.split(","))
    work.mkdir(parents=True, exist_ok=True)
    from retrieval.duplicates import COPY_DIFFERENCE

    glyph_train, glyph_choose, glyph_report = glyph_sets(work)
    glyph_run = trained(work / "glyph-run-3", glyph_train, SHORT)
    fit, validation = training_data("validation", work)
    icon_run = trained(work / "icon-run", fit)
    test = load_collection(icons() / "test").items
    result: dict = {"copy threshold": COPY_DIFFERENCE}
    if "labels" not in skip:
        result["labels"] = [
            labels_setting("glyphs a, c, e, ... (to choose)", glyph_run, load_collection(glyph_choose).items, work),
            labels_setting("glyphs b, d, f, ... (report)", glyph_run, load_collection(glyph_report).items, work),
            labels_setting("icons held-out training fifth (to choose)", icon_run, load_collection(validation).items, work),
            labels_setting("icons test/ (report)", icon_run, test, work),
        ]
    if "copies" not in skip:
        result["copies"] = [copies_setting("icons held-out training fifth (to choose)", icon_run, load_collection(validation).items, work), copies_setting("icons test/ (report)", icon_run, test, work)]
        for setting in result["copies"]:
            setting["at the threshold"] = at_threshold(setting["curve"], COPY_DIFFERENCE)
        if arguments.plot:
            plot(result["copies"], COPY_DIFFERENCE, arguments.plot)
    if "outliers" not in skip:
        noise, spreads = noise_images(work), [2.0, 2.5, 3.0, 4.0]
        choose = noise[20:40] + [item.path for item in load_collection(glyph_choose).items][:20]
        report = noise[:20] + [item.path for item in load_collection(glyph_report).items][:20]
        result["outliers"] = [
            outliers_setting("icons held-out training fifth + 20 noise + 20 glyphs a, c, e (to choose)", icon_run, load_collection(validation).items, choose, spreads),
            outliers_setting("icons test/ + 20 noise + 20 glyphs b, d, f (report)", icon_run, test, report, spreads),
        ]
    if "time" not in skip:
        everything = test + load_collection(icons() / "train").items
        result["time"] = [time_setting(icon_run, everything, work, kind) for kind in ("augmented copies", "mosaics")]
    if "folds" not in skip:
        result["folds"] = folds_setting(work, arguments.fold_run_epochs)
    shown = {key: value for key, value in result.items() if key != "copies"}
    shown["copies"] = [{key: value for key, value in s.items() if key != "curve"} for s in result.get("copies", [])]
    print(json.dumps(shown, indent=2))
    if arguments.out:
        arguments.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
