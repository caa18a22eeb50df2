"""Metrics of the deployed index beside exact search: the index's own search (type, tuned depth), the same
stored vectors, the gap; through `retrieval evaluate --deployed` and the app's "evaluate now"."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from index.search import Query, search_items
from index.stats import exact_and_deployed
from index.store import GalleryIndex
from index.types import Additions
from retrieval.commands import main
from retrieval.data import Item
from retrieval.metrics import map_at_r
from retrieval.runs import RunDir


def approximate_index(tmp_path: Path) -> GalleryIndex:
    """An IVF index over clustered vectors whose classes straddle the lists, searched at nprobe 1."""
    rng = np.random.default_rng(0)
    labels = [f"c{n % 20}" for n in range(600)]
    vectors = rng.standard_normal((600, 24)).astype(np.float32) + 1.5 * rng.standard_normal((20, 24)).astype(np.float32)[[n % 20 for n in range(600)]]
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    items = [Item(tmp_path / f"{n}.png", label) for n, label in enumerate(labels)]
    index = GalleryIndex.create(tmp_path / "ivf", [Additions(vectors, items, [f"{n:064x}" for n in range(600)])], "0" * 64, 24, factory="IVF32,Flat")
    index.manifest = replace(index.manifest, search={"nprobe": 1})
    return index


def test_the_deployed_lists_are_the_index_searches_and_cost_something(tmp_path: Path) -> None:
    index = approximate_index(tmp_path)
    evaluated = exact_and_deployed(index, ks=(1, 5))
    exact, deployed = evaluated.exact, evaluated.deployed
    assert deployed.metrics["search"] == "IVF32,Flat, nprobe 1" and exact.metrics["search"] == "exact"
    assert deployed.metrics["recall@5"] < exact.metrics["recall@5"]
    ids = sorted(index.items())
    labels = {item_id: item.label for item_id, item in index.items().items()}
    found = search_items(index, ids, Query(1))
    recall = np.mean([bool(hits) and labels[hits[0].id] == labels[item_id] for item_id, hits in zip(ids, found)])
    assert deployed.metrics["recall@1"] == pytest.approx(recall)
    relevant = np.array([sum(labels[other] == labels[item_id] for other in ids) - 1 for item_id in ids])
    wide = search_items(index, ids, Query(int(relevant.max())))
    hits = np.zeros((len(ids), int(relevant.max())), bool)
    for row, (item_id, found_hits) in enumerate(zip(ids, wide)):
        hits[row, : len(found_hits)] = [labels[hit.id] == labels[item_id] for hit in found_hits]
    assert deployed.metrics["map@r"] == pytest.approx(float(map_at_r(hits, relevant).mean()))


def test_evaluate_deployed_writes_both_sets_and_the_gap(demo_run: RunDir, icons_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    index = tmp_path / "ivf-index"
    assert main(["index", str(demo_run.root), str(icons_root / "test"), "--index", str(index), "--faiss", "IVF8,Flat"]) == 0
    capsys.readouterr()
    assert main(["evaluate", str(demo_run.root), "--deployed", "--index", str(index)]) == 0
    out = capsys.readouterr().out
    assert "exact search" in out and "deployed - exact" in out
    exact = json.loads((demo_run.metric_sets / "ivf-index-float32-exact.json").read_text())
    deployed = json.loads((demo_run.metric_sets / "ivf-index-float32-deployed.json").read_text())
    assert deployed["search"].startswith("IVF8,Flat, nprobe ") and exact["num_queries"] == deployed["num_queries"]
    assert main(["evaluate", str(demo_run.root), str(icons_root / "test"), "--deployed"]) == 2
    assert "--deployed scores the run's index itself" in capsys.readouterr().err
