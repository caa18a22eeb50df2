"""What the model gets wrong: confused class pairs, the per-class table, each query's first hit, per-class comparison
of two runs, and `retrieval evaluate` printing them (tables, --json, --compare)."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from retrieval.commands import main
from retrieval.data import Item
from retrieval.metrics import score_queries
from retrieval.mistakes import FirstHits, class_table, compare_classes, confusions, mistakes
from retrieval.runs import RunDir
from tests.conftest import copy_classes


def planted() -> tuple[np.ndarray, list[Item]]:
    """Three classes in 2-D: a's and b's images lie together (every a finds a b first), c apart."""
    points = {"a": [(1.0, 0.02), (1.0, 0.06)], "b": [(1.0, 0.04), (1.0, 0.08), (1.0, 0.2)], "c": [(0.0, 1.0), (0.05, 1.0)]}
    vectors, items = [], []
    for label, rows in points.items():
        for number, row in enumerate(rows):
            vectors.append(row)
            items.append(Item(Path(f"/g/{label}/{number}.png"), label))
    vectors = np.asarray(vectors, np.float32)
    return vectors / np.linalg.norm(vectors, axis=1, keepdims=True), items


def test_confused_pairs_and_the_class_table_follow_the_first_hits() -> None:
    vectors, items = planted()
    scores = score_queries(vectors, [item.label for item in items], ks=(1,))
    first = FirstHits.of(scores, items, items)
    expected = [(item.label, hit.label) for item, hit in zip(first.queries, first.hits)]
    assert expected == [("a", "b"), ("a", "b"), ("b", "a"), ("b", "a"), ("b", "b"), ("c", "c"), ("c", "c")]
    pairs = confusions(first)
    assert [(pair.label, pair.confused_with, pair.count, pair.queries) for pair in pairs] == [("a", "b", 2, 2), ("b", "a", 2, 3)]
    assert pairs[0].examples[0] == ("/g/a/0.png", "/g/b/0.png")
    table = class_table(scores, first)
    assert [(row["label"], row["recall@1"], row["confused_with"], row["confused"]) for row in table] == [("a", 0.0, "b", 2), ("b", pytest.approx(1 / 3), "a", 2), ("c", 1.0, None, 0)]
    found = mistakes(scores, items, items)
    assert found["first_hits"][0] == {"query": "/g/a/0.png", "label": "a", "hit": "/g/b/0.png", "hit_label": "b", "score": pytest.approx(float(vectors[0] @ vectors[2]))}
    assert json.loads(json.dumps(found)) == found  # JSON as it stands


def test_compare_classes_lists_the_better_and_the_worse() -> None:
    ours = [{"label": "a", "queries": 4, "recall@1": 0.25}, {"label": "b", "queries": 4, "recall@1": 1.0}, {"label": "c", "queries": 2, "recall@1": 0.5}, {"label": "gone", "queries": 1, "recall@1": 0.0}]
    theirs = [{"label": "a", "queries": 4, "recall@1": 0.75}, {"label": "b", "queries": 4, "recall@1": 0.5}, {"label": "c", "queries": 2, "recall@1": 0.5}]
    changes = compare_classes(ours, theirs)
    assert [(row["label"], row["change"]) for row in changes["better"]] == [("a", 0.5)]
    assert [(row["label"], row["before"], row["after"]) for row in changes["worse"]] == [("b", 1.0, 0.5)]
    assert changes["unchanged"] == 1 and changes["classes"] == 3


def test_evaluate_prints_the_confusions_and_json_and_compares_per_class(demo_run: RunDir, icons_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    shutil.copytree(demo_run.root, run)
    data = copy_classes(icons_root, tmp_path / "data", 6, split="test")
    capsys.readouterr()
    assert main(["evaluate", str(run), str(data)]) == 0
    printed = capsys.readouterr().out
    assert "most confused classes" in printed
    assert (run / "plots" / "confusions.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["evaluate", str(run), str(data), "--json", "--compare", str(demo_run.root)]) == 0
    found = json.loads(capsys.readouterr().out)  # stdout is the JSON alone
    saved = json.loads((run / "metrics.json").read_text())
    assert found["classes"] == saved["classes"] and len(found["classes"]) == 6
    assert found["num_queries"] == len(found["first_hits"]) == sum(row["queries"] for row in found["classes"])
    wrong = Counter((hit["label"], hit["hit_label"]) for hit in found["first_hits"] if hit["hit_label"] != hit["label"])
    assert [pair["count"] for pair in found["confusions"]] == sorted(wrong.values(), reverse=True)[:15]
    compared = found["comparison"]["classes"]
    assert compared["classes"] == 6 and compared["unchanged"] == 6 and not compared["better"] and not compared["worse"]  # the same model


def test_a_grid_of_few_thumbnails_keeps_its_title_inside_and_its_captions_off_the_pictures(icons_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A confusions or worst-queries grid of one or two pictures is narrower than its title (it was cut off at both
    sides), and a caption of two lines overlapped the picture above it."""
    import retrieval.plots as plots

    drawn: list = []
    monkeypatch.setattr(plots, "_save", lambda figure, target: drawn.append(figure) or target)
    first, second = sorted((icons_root / "test").rglob("*.png"))[:2]
    pair = {"label": "a", "confused_with": "b", "count": 2, "queries": 3}
    plots.plot_confusions([{**pair, "examples": [{"query": str(first), "hit": str(second)}]}] * 2, tmp_path / "c.png")
    plots.plot_worst_queries([(Item(first, "a"), [(Item(second, "b"), 0.5)])] * 2, tmp_path / "w.png")
    plots.plot_confusions([], tmp_path / "none.png")
    for figure in drawn:
        figure.canvas.draw()
        renderer = figure.canvas.get_renderer()
        texts = [figure._suptitle, *figure.texts, *(axis.title for axis in figure.axes if axis.get_title())]
        for text in filter(None, texts):
            box = text.get_window_extent(renderer)
            assert figure.bbox.x0 <= box.x0 and box.x1 <= figure.bbox.x1 and box.y1 <= figure.bbox.y1, text.get_text()
        pictures = [axis.get_window_extent(renderer) for axis in figure.axes if axis.images]
        for axis in figure.axes:
            if axis.get_title():
                caption = axis.title.get_window_extent(renderer)
                assert not any(caption.overlaps(picture) for picture in pictures), axis.get_title()


def test_a_confused_pair_clicked_in_the_metrics_tab_shows_its_queries_beside_the_hits_they_were_taken_for(demo_run: RunDir) -> None:
    import gradio as gr

    from app.handlers import Handlers
    from app.service import SearchService

    service = SearchService(demo_run)
    try:
        name, metrics = next(iter(service.metric_sets.items()))  # the set the tab opens on
        assert metrics["confusions"], "a 2-epoch model confuses some of its 8 test classes"
        pair = metrics["confusions"][-1]
        row = [pair["label"], pair["confused_with"], pair["count"], pair["queries"]]
        tiles, said = Handlers(service).confusion_view(name, gr.SelectData(None, {"index": [len(metrics["confusions"]) - 1, 0], "value": row[0], "row_value": row}))
    finally:
        service.close()
    taken = [hit for hit in metrics["first_hits"] if hit["label"] == pair["label"] and hit["hit_label"] == pair["confused_with"]]
    assert len(tiles) == 2 * len(taken) == 2 * pair["count"]
    assert [Path(caption.split(" · ")[1]).name for _, caption in tiles[0::2]] == [Path(hit["query"]).name for hit in taken]
    assert all(caption.startswith("miss · ") and caption.endswith(f" · {pair['confused_with']}") for _, caption in tiles[1::2])
    assert f"{pair['count']} of its {pair['queries']} quer" in said and pair["confused_with"] in said
