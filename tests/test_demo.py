"""End to end: `retrieval demo --no-serve` on a small subset of the embedded dataset."""

from __future__ import annotations

import json

from retrieval.runs import RunDir


def test_demo_trains_exports_indexes_and_evaluates(demo_run: RunDir) -> None:
    for path in (demo_run.config, demo_run.last_checkpoint, demo_run.model, demo_run.model_card, demo_run.metrics, demo_run.index / "manifest.json"):
        assert path.is_file(), path
    metrics = json.loads(demo_run.metrics.read_text())
    baseline = json.loads((demo_run.root / "baseline_metrics.json").read_text())
    assert metrics["protocol"] == baseline["protocol"] == "leave-one-out"
    assert metrics["num_queries"] == baseline["num_queries"] > 0
    assert 0.0 <= metrics["recall@1"] <= metrics["recall@5"] <= metrics["recall@10"] <= 1.0
    assert baseline["encoder"] == "raw-pixels-16x16-grayscale"
    manifest = json.loads((demo_run.index / "manifest.json").read_text())
    assert manifest["count"] == metrics["num_queries"]
    log = [json.loads(line) for line in demo_run.train_log.read_text().splitlines()]
    assert [entry["epoch"] for entry in log] == [1, 2]
    assert demo_run.loss_plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
