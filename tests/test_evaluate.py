"""`retrieval evaluate`: the three protocols, the metric set in metrics.json, and the plots."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from retrieval.cli import main
from retrieval.runs import RunDir
from tests.conftest import copy_classes

PNG = b"\x89PNG\r\n\x1a\n"


def test_leave_one_out_writes_the_metric_set_and_plots(demo_run: RunDir, icons_root: Path, tmp_path: Path) -> None:
    data = copy_classes(icons_root, tmp_path / "data", 6, split="test")
    assert main(["evaluate", str(demo_run.root), str(data), "-k", "1,2,5"]) == 0
    metrics = json.loads(demo_run.metrics.read_text())
    for key in ("recall@1", "recall@5", "precision@2", "r_precision", "map@r", "map", "nmi", "ami", "uniformity", "tolerance"):
        assert 0 <= abs(metrics[key]) <= 1, key
    assert len(metrics["cmc"]) == 5 and metrics["cmc"][0] == metrics["recall@1"] and metrics["cmc"][4] == metrics["recall@5"]
    assert metrics["protocol"] == "leave-one-out" and metrics["encoder"]
    for name in ("recall_at_k.png", "similarities.png"):
        assert (demo_run.root / "plots" / name).read_bytes()[:8] == PNG


def test_split_classes_scores_a_held_out_part(demo_run: RunDir, icons_root: Path, tmp_path: Path) -> None:
    data = copy_classes(icons_root, tmp_path / "data", 8, split="test")
    assert main(["evaluate", str(demo_run.root), str(data), "--split-classes", "0.5", "--seed", "3"]) == 0
    metrics = json.loads(demo_run.metrics.read_text())
    images_in_four_classes = {len(list(folder.iterdir())) for folder in data.iterdir()}
    assert metrics["protocol"] == "leave-one-out on 0.5 of the classes (seed 3)"
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


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--query", "q"], "--query and --gallery go together"),
        (["IMAGES", "--query", "q", "--gallery", "g"], "either IMAGES"),
        ([], "either IMAGES"),
        (["--query", "q", "--gallery", "g", "--split-classes", "0.5"], "does not apply to --query"),
    ],
)
def test_protocol_mistakes_are_explained(demo_run: RunDir, tmp_path: Path, capsys: pytest.CaptureFixture[str], arguments: list[str], message: str) -> None:
    arguments = [str(tmp_path) if argument == "IMAGES" else argument for argument in arguments]
    assert main(["evaluate", str(demo_run.root), *arguments]) == 2
    assert message in capsys.readouterr().err.replace("\n", "")
