"""The int8 encoder: static quantisation behind a retrieval-quality gate, and --model int8 for the serving commands."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

import training.quantise as quantise_module
from app.api import build_api
from app.service import SearchService
from index.backends import built_with
from retrieval.commands import main
from retrieval.embedders import OnnxEmbedder, chosen_model
from retrieval.errors import RetrievalError
from retrieval.runs import RunDir
from training.quantise import export_int8


@pytest.fixture(scope="module")
def run(demo_run: RunDir, tmp_path_factory: pytest.TempPathFactory) -> RunDir:
    """A copy of the demo run (2 epochs), exported unwhitened: whitening inflates the weak directions of so short a
    run's features, and with them the int8 rounding, past the gate (top-10 overlap 0.84); a trained run passes."""
    copy = RunDir(tmp_path_factory.mktemp("int8") / "run")
    shutil.copytree(demo_run.root, copy.root)
    assert main(["export", str(copy.root), "--whiten", "none"]) == 0
    return copy


def test_export_int8_writes_the_model_and_its_gate_figures(run: RunDir, icons_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["export", str(run.root), "--whiten", "none", "--int8"]) == 0
    assert "model.int8.onnx (int8, minmax calibration; top-10 overlap" in capsys.readouterr().out.replace("\n", " ")
    card = json.loads(run.model_card.read_text())
    gate = card["int8"]["gate"]
    allowed = max(0.01, 1 / gate["held_out_images"])
    assert gate["overlap_at_10"] >= 0.9 and gate["recall_at_1_float32"] - gate["recall_at_1_int8"] <= allowed + 1e-9
    assert card["int8"]["calibration"]["method"] == "minmax" and card["int8"]["calibration"]["images"] >= 16
    int8, float32 = OnnxEmbedder.from_run(run, model="int8"), OnnxEmbedder.from_run(run)
    assert int8.fingerprint != float32.fingerprint and int8.dim == float32.dim
    import onnx
    from onnx import numpy_helper

    graph = onnx.load(str(run.root / "model.int8.onnx")).graph
    weights = [numpy_helper.to_array(w) for w in graph.initializer if w.data_type == onnx.TensorProto.INT8 and w.dims]
    assert weights and max(int(abs(w.astype(int)).max()) for w in weights) <= 64  # 7 bits: no saturation without VNNI
    assert main(["evaluate", str(run.root), str(icons_root / "test"), "--model", "int8"]) == 0
    assert (run.metric_sets / "test-int8.json").is_file()
    index = tmp_path / "int8-index"
    assert main(["index", str(run.root), str(icons_root / "test"), "--index", str(index), "--model", "int8"]) == 0
    capsys.readouterr()
    assert main(["search", str(run.root), "--index", str(index), "--id", "2", "--model", "int8", "--json"]) == 0
    given = json.loads(capsys.readouterr().out)
    assert main(["search", str(run.root), "--index", str(index), "--id", "2", "--json"]) == 0  # auto: the index's model
    assert json.loads(capsys.readouterr().out) == given
    assert main(["search", str(run.root), "--index", str(index), "--id", "2", "--model", "float32"]) == 2
    assert "use the model it was built with (--model float32 or int8)" in capsys.readouterr().err.replace("\n", " ")


def test_auto_serves_the_int8_model_that_passed_its_gate(run: RunDir, icons_root: Path, tmp_path: Path) -> None:
    """--model auto (the default of index, search and serve): a new index gets int8 where the run has a gated
    int8 model; an index keeps the model it was built with; /api/v1/stats says int8 and its gate's figures."""
    if not run.int8_model.is_file():
        export_int8(run)
    card = json.loads(run.model_card.read_text())
    assert chosen_model(run, "auto") == "int8" and chosen_model(run, "float32") == "float32"
    assert chosen_model(run, "auto", built_with=OnnxEmbedder.from_run(run).fingerprint) == "float32"
    assert main(["index", str(run.root), str(icons_root / "test"), "--index", str(tmp_path / "auto")]) == 0
    assert built_with(tmp_path / "auto") == card["int8"]["sha256"]
    assert main(["index", str(run.root), str(icons_root / "test"), "--index", str(tmp_path / "plain"), "--model", "float32"]) == 0
    assert SearchService(run, tmp_path / "plain").embedder.card["precision"] == "float32"
    service = SearchService(run, tmp_path / "auto")
    try:
        stats = TestClient(build_api(service, None, "20MB")).get("/api/v1/stats").json()
    finally:
        service.close()
    assert stats["precision"] == "int8" and stats["int8_gate"] == card["int8"]["gate"]
    bare = RunDir(tmp_path / "bare")
    shutil.copytree(run.root, bare.root, ignore=shutil.ignore_patterns("model.int8.onnx", "index"))
    assert chosen_model(bare, "auto") == "float32"  # the card names an int8 model that is not there


def test_a_failed_gate_writes_nothing(run: RunDir, monkeypatch: pytest.MonkeyPatch) -> None:
    run.int8_model.unlink(missing_ok=True)
    monkeypatch.setattr(quantise_module, "MIN_OVERLAP", 1.01)
    with pytest.raises(RetrievalError, match="loses too much retrieval: top-10 overlap"):
        export_int8(run)
    assert not run.int8_model.exists()
    assert not list(run.root.glob(".int8-*"))


@pytest.mark.parametrize("method", ["entropy", "percentile"])
def test_the_histogram_calibrations_work_on_uneven_batches(run: RunDir, method: str, capsys: pytest.CaptureFixture[str]) -> None:
    report = export_int8(run, method)  # the demo's calibration sample is not a multiple of the batch size
    assert report.method == method and report.ok
    assert "Number of" not in capsys.readouterr().out  # ONNX Runtime's histogram prints are kept off the output


def test_int8_mistakes_get_one_line_each(run: RunDir, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(RetrievalError, match="unknown calibration method 'kl'"):
        export_int8(run, "kl")
    run.int8_model.unlink(missing_ok=True)
    assert main(["search", str(run.root), "--id", "2", "--model", "int8"]) == 2
    assert f"make it with `retrieval export {run.root} --int8`" in capsys.readouterr().err.replace("\n", "")
    with pytest.raises(RetrievalError, match="--model must be one of float32, int8"):
        OnnxEmbedder.from_run(run, model="int4")
