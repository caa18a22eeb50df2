"""`retrieval evaluate`: the three protocols, the metric set in metrics.json, and the plots."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from retrieval.commands import main
from retrieval.runs import RunDir
from tests.conftest import copy_classes

PNG = b"\x89PNG\r\n\x1a\n"


def test_leave_one_out_writes_the_metric_set_and_plots(demo_run: RunDir, icons_root: Path, tmp_path: Path) -> None:
    data = copy_classes(icons_root, tmp_path / "data", 6, split="test")
    assert main(["evaluate", str(demo_run.root), str(data), "-k", "1,2,5"]) == 0
    metrics = json.loads(demo_run.metrics.read_text())
    for key in ("recall@1", "recall@5", "precision@2", "r_precision", "map@r", "map", "nmi", "ami", "tolerance"):
        assert 0 <= abs(metrics[key]) <= 1, key
    assert -8 <= metrics["uniformity"] <= 0  # log mean exp(-2 d^2) of unit vectors, d^2 <= 4
    assert len(metrics["cmc"]) == 5 and metrics["cmc"][0] == metrics["recall@1"] and metrics["cmc"][4] == metrics["recall@5"]
    assert metrics["protocol"] == "leave-one-out" and metrics["encoder"]
    worst = metrics["worst_classes"]
    assert len(worst) == 6 and [entry["recall@1"] for entry in worst] == sorted(entry["recall@1"] for entry in worst)
    assert sum(entry["recall@1"] * entry["queries"] for entry in worst) == pytest.approx(metrics["recall@1"] * metrics["num_queries"])
    for name in ("recall_at_k.png", "similarities.png", "class_recall.png", "worst_queries.png", "diagnostics.png"):
        assert (demo_run.root / "plots" / name).read_bytes()[:8] == PNG


def test_split_classes_scores_a_held_out_part(demo_run: RunDir, icons_root: Path, tmp_path: Path) -> None:
    data = copy_classes(icons_root, tmp_path / "data", 8, split="test")
    assert main(["evaluate", str(demo_run.root), str(data), "--split-classes", "0.5", "--seed", "3", "-k", "5"]) == 0
    metrics = json.loads(demo_run.metrics.read_text())
    images_in_four_classes = {len(list(folder.iterdir())) for folder in data.iterdir()}
    assert metrics["protocol"] == "leave-one-out on 0.5 of the classes (seed 3)"
    assert "recall@5" in metrics and "recall@1" in metrics  # -k 5 without 1 ended in KeyError 'recall@1'
    assert metrics["num_queries"] <= 4 * max(images_in_four_classes)
    assert metrics["num_queries"] < sum(len(list(folder.iterdir())) for folder in data.iterdir())


def test_query_and_gallery_sets(demo_run: RunDir, icons_root: Path, tmp_path: Path) -> None:
    gallery = copy_classes(icons_root, tmp_path / "gallery", 6, split="test")
    queries = tmp_path / "queries"
    for folder in gallery.iterdir():  # one image of each class moves to the query set
        (queries / folder.name).mkdir(parents=True)
        first = sorted(folder.iterdir())[0]
        shutil.move(first, queries / folder.name / first.name)
    assert main(["evaluate", str(demo_run.root), "--query", str(queries), "--gallery", str(gallery), "-k", "1,3"]) == 0
    metrics = json.loads(demo_run.metrics.read_text())
    assert metrics["protocol"] == "query-gallery" and metrics["num_queries"] == 6
    assert metrics["queries"] == str(queries) and metrics["gallery"] == str(gallery)


def test_queries_that_are_gallery_images_are_refused(demo_run: RunDir, icons_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--query X --gallery X scored every query against itself: recall@1 1.000, written as the run's metrics."""
    data = copy_classes(icons_root, tmp_path / "data", 3, split="test")
    before = demo_run.metrics.read_bytes() if demo_run.metrics.is_file() else None
    assert main(["evaluate", str(demo_run.root), "--query", str(data), "--gallery", str(data)]) == 2
    err = capsys.readouterr().err
    count = sum(len(list(folder.iterdir())) for folder in data.iterdir())
    assert f"share {count} of the {count} query images" in err and "give the images once, as IMAGES" in err
    assert err.count("\n") == 1
    assert (demo_run.metrics.read_bytes() if demo_run.metrics.is_file() else None) == before


def test_compare_scores_two_runs_on_the_same_protocol(demo_run: RunDir, icons_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = copy_classes(icons_root, tmp_path / "data", 5, split="test")
    other = tmp_path / "other"
    shutil.copytree(demo_run.root, other)
    assert main(["evaluate", str(other), str(data), "--split-classes", "0.5"]) == 0
    alone = json.loads((other / "metrics.json").read_text())
    assert main(["evaluate", str(demo_run.root), str(data), "--split-classes", "0.5", "--compare", str(other)]) == 0
    comparison = json.loads((demo_run.root / "comparison.json").read_text())
    runs = comparison["runs"]
    assert list(runs) == [str(demo_run.root), str(other)] and comparison["protocol"] == alone["protocol"]
    assert runs[str(other)]["recall@1"] == alone["recall@1"] and runs[str(other)]["num_queries"] == alone["num_queries"]
    assert (demo_run.root / "plots" / "compare_recall_at_k.png").read_bytes()[:8] == PNG
    table = capsys.readouterr().out
    assert "other - run" in table and "0.000" in table  # the same model: no difference
    assert "recall@1 per class, this run -> other: the same in all 2 classes" in table  # not an empty table
    assert main(["evaluate", str(demo_run.root), str(data), "--compare", str(demo_run.root / ".." / "run")]) == 2
    assert capsys.readouterr().err.startswith(f"error: --compare {demo_run.root / '..' / 'run'}: the run being evaluated")  # fmt: skip


def test_class_recall_and_worst_queries_by_hand() -> None:
    import numpy as np

    from retrieval.data import Item
    from retrieval.evaluation import Evaluation
    from retrieval.metrics import score_queries

    angles = np.array([0.0, 0.1, 1.0, 1.05, 3.0, 3.02])  # a a | b b | c c, but b's first image sits nearest to a
    vectors = np.stack([np.cos(angles), np.sin(angles)], axis=1).astype(np.float32)
    labels = ["a", "b", "a", "b", "c", "c"]
    items = [Item(Path(f"{n}.png"), label) for n, label in enumerate(labels)]
    evaluation = Evaluation({}, [], vectors, items, items, score_queries(vectors, labels, ks=(1,)))
    # neighbours: 0->1 (miss), 1->0 (miss), 2->3 (miss), 3->2 (miss), 4->5 (hit), 5->4 (hit)
    assert evaluation.class_recall() == {"a": (0.0, 2), "b": (0.0, 2), "c": (1.0, 2)}
    worst = evaluation.worst_queries(4)
    assert sorted(worst) == [0, 1, 2, 3] and worst[0] in (2, 3)  # 2 and 3 are the most confident misses


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--query", "q"], "--query and --gallery go together"),
        (["IMAGES", "--query", "q", "--gallery", "g"], "either IMAGES"),
        ([], "either IMAGES"),
        (["--query", "q", "--gallery", "g", "--split-classes", "0.5"], "does not apply to --query"),
        (["--query", "q", "--gallery", "g", "--benchmark", "cub"], "--benchmark reads IMAGES"),
        (["IMAGES", "--benchmark", "mnist"], "choose one of cub"),
        # ignored without the option they go with: the evaluation ran as if they had not been given
        (["IMAGES", "--seed", "3"], "--seed 3 seeds --split-classes and --linear: add one, or leave --seed out"),
        (["IMAGES", "--index", "elsewhere"], "--index elsewhere names the index --deployed scores: add --deployed"),
    ],
)
def test_protocol_mistakes_are_explained(demo_run: RunDir, tmp_path: Path, capsys: pytest.CaptureFixture[str], arguments: list[str], message: str) -> None:
    arguments = [str(tmp_path) if argument == "IMAGES" else argument for argument in arguments]
    assert main(["evaluate", str(demo_run.root), *arguments]) == 2
    assert message in capsys.readouterr().err.replace("\n", "")


def test_a_query_or_gallery_that_cannot_be_read_names_its_option(demo_run: RunDir, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Errors about --query's or --gallery's images began with the path alone: which of the two was wrong was left to
    guess."""
    (tmp_path / "empty").mkdir()
    assert main(["evaluate", str(demo_run.root), "--query", str(tmp_path / "empty"), "--gallery", str(tmp_path / "empty")]) == 2
    assert capsys.readouterr().err.startswith(f"error: --query {tmp_path / 'empty'}: no images found")
    (tmp_path / "queries" / "a").mkdir(parents=True)
    (tmp_path / "queries" / "a" / "1.png").write_bytes(b"listed, not yet read")
    assert main(["evaluate", str(demo_run.root), "--query", str(tmp_path / "queries"), "--gallery", str(tmp_path / "nowhere")]) == 2
    assert capsys.readouterr().err.startswith(f"error: --gallery {tmp_path / 'nowhere'}: no such file or folder")


def test_evaluating_the_images_a_run_trained_on_says_the_figures_flatter_it(demo_run: RunDir, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """recall@1 1.000 on a run's own training images was printed like any other figure; held-out images say
    nothing more, and an evaluation with nothing to confuse says so in one line (it was an empty table)."""
    from retrieval.commands.output import confusion_table
    from retrieval.data import load_collection, write_collection_csv
    from retrieval.runs import read_json

    run = tmp_path / "run"
    shutil.copytree(demo_run.root, run)
    trained_on = read_json(RunDir(run).model_card)["trained_on"]
    assert main(["evaluate", str(run), trained_on]) == 0
    out = " ".join(capsys.readouterr().out.split())
    total = len(load_collection(trained_on).items)
    assert f"note: all {total:,} images evaluated are images {run} trained on ({trained_on})" in out
    trained_set = next(iter(RunDir(run).saved_metrics()))  # the latest
    assert read_json(RunDir(run).metrics)["images trained on"] == total
    assert main(["evaluate", str(run), str(run / "demo-test.csv")]) == 0
    assert "note:" not in capsys.readouterr().out
    assert "images trained on" not in read_json(RunDir(run).metrics)
    held_out = load_collection(run / "demo-test.csv").items[:5]
    mixed = write_collection_csv(tmp_path / "mixed.csv", load_collection(trained_on).items[:3] + held_out)
    assert main(["evaluate", str(run), str(mixed)]) == 0
    assert f"note: 3 of the 8 images evaluated are images {run} trained on" in " ".join(capsys.readouterr().out.split())
    from app.handlers import Handlers
    from app.service import SearchService

    service = SearchService(RunDir(run))  # the app's Metrics tab says it above the set's figures too
    try:
        said = Handlers(service).metric_source(trained_set)
        assert f"**{total:,} of these images are images the run trained on**: its figures there flatter it" in said
        assert "trained on" not in Handlers(service).metric_source("demo-test") and trained_set != "demo-test"
    finally:
        service.close()
    assert confusion_table([]) == "most confused classes: none (every query's top-1 hit has its own label)"


def test_unscored_queries_are_named_with_labels_that_differ_only_in_case(demo_run: RunDir, icons_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Queries labeled APPLE against a gallery labeled apple were left out of every figure without a word (only
    num_skipped_queries in the table); all of them would be refused, some of them silently made the figures."""
    gallery = copy_classes(icons_root, tmp_path / "gallery", 4, split="test")
    classes = sorted(folder.name for folder in gallery.iterdir())
    rows = ["path,label"]
    for number, label in enumerate(classes):
        first = sorted((gallery / label).iterdir())[0]
        moved = tmp_path / "queries" / f"{label}.png"
        moved.parent.mkdir(exist_ok=True)
        shutil.move(first, moved)
        rows.append(f"{moved},{label.upper() if number < 2 else label}")
    (tmp_path / "queries.csv").write_text("\n".join(rows) + "\n")
    assert main(["evaluate", str(demo_run.root), "--query", str(tmp_path / "queries.csv"), "--gallery", str(gallery)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    metrics = json.loads(demo_run.metrics.read_text())
    assert (metrics["num_queries"], metrics["num_skipped_queries"]) == (2, 2)
    assert f"note: 2 of the 4 queries are not scored, the gallery has no image of their label ('{classes[0].upper()}', '{classes[1].upper()}')" in out
    assert "; labels written alike but for case, spaces, - or _ are different classes: " in out
    for label in classes[:2]:
        assert f"'{label}' ({len(list((gallery / label).iterdir()))} images) and '{label.upper()}' (1)" in out
    assert main(["evaluate", str(demo_run.root), str(gallery)]) == 0  # every query scored: no note
    assert "not scored" not in capsys.readouterr().out


def test_queries_whose_labels_no_gallery_image_has_are_refused_before_embedding(demo_run: RunDir, icons_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Queries labeled APPLE against a gallery labeled apple were embedded, then refused as 'no query has a relevant
    item in the gallery', without the labels that made it so."""
    gallery = copy_classes(icons_root, tmp_path / "gallery", 2, split="test")
    rows = ["path,label"]
    for image in sorted(gallery.glob("*/*"))[::3]:  # every third image moves out, as a query labeled in capitals
        rows.append(f"{image.rename(tmp_path / image.name)},{image.parent.name.upper()}")
    (tmp_path / "queries.csv").write_text("\n".join(rows) + "\n")
    assert main(["evaluate", str(demo_run.root), "--query", str(tmp_path / "queries.csv"), "--gallery", str(gallery)]) == 2
    captured = capsys.readouterr()
    first, second = sorted(folder.name for folder in gallery.iterdir())
    assert f"error: no query label is a gallery label: the queries ({tmp_path / 'queries.csv'}) have '{first.upper()}', '{second.upper()}' and the gallery ({gallery}) '{first}', '{second}'; labels written alike but for case" in " ".join(captured.err.split())
    assert "embedding" not in captured.out + captured.err  # said before the embedding pass


def test_k_values_no_scoring_can_use_are_refused_before_any_image_is_embedded(tmp_path: Path) -> None:
    """evaluate_collection(embedder, folder, ks="1,5") embedded every image, then failed with a TypeError inside the
    scoring; the k values are checked first (here the folder does not even exist, and the k values are named)."""
    from retrieval.embedders import PixelEmbedder
    from retrieval.errors import RetrievalError
    from retrieval.evaluation import evaluate_collection, evaluate_query_gallery

    with pytest.raises(RetrievalError, match=r"^ks='1,5': give a list of whole numbers, e\.g\. \[1, 5, 10\]$"):
        evaluate_collection(PixelEmbedder(), tmp_path / "missing", ks="1,5")  # type: ignore[arg-type]
    with pytest.raises(RetrievalError, match=r"^k must be at least 1, got \[0, 5\]$"):
        evaluate_query_gallery(PixelEmbedder(), tmp_path / "missing", tmp_path / "also missing", ks=[5, 0])
