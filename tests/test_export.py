"""ONNX export: parity with PyTorch at several batch sizes, the model card, and refusal on failure."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

import training.export as export_module
from retrieval.embedders import OnnxEmbedder
from retrieval.errors import RetrievalError
from retrieval.runs import RunDir
from training.config import TrainConfig
from training.export import export
from training.train import load_encoder, train
from tests.conftest import copy_classes


@pytest.fixture(scope="module")
def trained(icons_root: Path, tmp_path_factory: pytest.TempPathFactory) -> RunDir:
    folder = copy_classes(icons_root, tmp_path_factory.mktemp("data"), 3)
    run = RunDir(tmp_path_factory.mktemp("runs") / "run")
    train(TrainConfig(data=str(folder), epochs=1, batch_size=12, image_size=40, embedding_dim=32), run, progress=False)
    return run


def test_export_writes_a_checked_model_and_card(trained: RunDir) -> None:
    parity = export(trained)
    assert parity.ok
    card = json.loads(trained.model_card.read_text())
    assert card["sha256"] == hashlib.sha256(trained.model.read_bytes()).hexdigest()
    assert card["embedding_dim"] == 32 and card["preprocessing"]["image_size"] == 40
    assert card["opset"] == export_module.OPSET
    assert card["parity"]["batch_sizes"][:4] == [1, 2, 7, 64]


@pytest.mark.parametrize("batch_size", [1, 2, 7, 64])
def test_onnx_matches_pytorch(trained: RunDir, batch_size: int) -> None:
    if not trained.model.is_file():
        export(trained)
    model, _ = load_encoder(trained)
    embedder = OnnxEmbedder.from_run(trained)
    images = np.random.default_rng(batch_size).standard_normal((batch_size, 3, 40, 40)).astype(np.float32)
    with torch.no_grad():
        expected = model(torch.from_numpy(images)).numpy()
    (actual,) = embedder.session.run(None, {embedder.input_name: images})
    assert actual.shape == (batch_size, 32)
    assert np.abs(expected - actual).max() <= 1e-4
    assert (expected * actual).sum(axis=1).min() >= 0.9999


def test_a_failed_parity_check_leaves_no_model(trained: RunDir, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = RunDir(tmp_path / "copy")
    run.checkpoints.mkdir(parents=True)
    run.config.write_bytes(trained.config.read_bytes())
    run.last_checkpoint.write_bytes(trained.last_checkpoint.read_bytes())
    monkeypatch.setattr(export_module, "MAX_ABS_DIFFERENCE", -1.0)
    with pytest.raises(RetrievalError, match=r"failed its parity check: max \|Δ\|"):
        export(run)
    assert not run.model.exists() and not run.model_card.exists()
    assert not list(run.root.glob(".export-*"))


def test_export_without_a_checkpoint_says_to_train(tmp_path: Path) -> None:
    with pytest.raises(RetrievalError, match="no trained checkpoint.*retrieval train"):
        export(RunDir(tmp_path))


def test_a_model_that_does_not_match_its_card_is_refused(trained: RunDir, tmp_path: Path) -> None:
    if not trained.model.is_file():
        export(trained)
    run = RunDir(tmp_path / "tampered")
    run.root.mkdir()
    run.model_card.write_bytes(trained.model_card.read_bytes())
    run.model.write_bytes(trained.model.read_bytes()[:-10])
    with pytest.raises(RetrievalError, match="does not match model.json"):
        OnnxEmbedder.from_run(run)
