"""ONNX export: parity with PyTorch at several batch sizes, the model card, and refusal on failure."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

import training.exporting as export_module
from retrieval.embedders import OnnxEmbedder
from retrieval.errors import RetrievalError
from retrieval.runs import RunDir
from training.config import TrainConfig
from training.exporting import DEFAULT_WHITENING, export
from training.whitening import fit_whitening, whiten_encoder
from retrieval.data import load_collection
from retrieval.runs import read_json
from training.checkpoints import load_encoder
from training.loop import train
from tests.conftest import copy_classes
from retrieval.commands import main


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
    assert card["parity"]["batch_sizes"][:5] == [1, 2, 7, 64, 256]


@pytest.mark.parametrize("batch_size", [1, 2, 7, 64])
def test_onnx_matches_pytorch(trained: RunDir, batch_size: int) -> None:
    export(trained)  # whitened, as by default: the whitening fitted on the run's images is part of both sides
    config = TrainConfig.from_dict(read_json(trained.config))
    model, _ = load_encoder(trained)
    model = whiten_encoder(model, [item.path for item in load_collection(Path(config.data)).items], config.preprocessing, DEFAULT_WHITENING)
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


def test_float16_export_keeps_float32_io_and_passes_its_check(trained: RunDir, tmp_path: Path) -> None:
    run = RunDir(tmp_path / "fp16")
    run.checkpoints.mkdir(parents=True)
    run.config.write_bytes(trained.config.read_bytes())
    run.last_checkpoint.write_bytes(trained.last_checkpoint.read_bytes())
    parity = export(run, float16=True)
    card = json.loads(run.model_card.read_text())
    assert card["precision"] == "float16" and parity.min_cosine >= export_module.MIN_COSINE_FLOAT16
    embedder = OnnxEmbedder.from_run(run)
    assert embedder.session.get_inputs()[0].type == "tensor(float)"
    vectors = embedder.embed_prepared(np.random.default_rng(0).standard_normal((3, 3, 40, 40)).astype(np.float32))
    assert vectors.dtype == np.float32 and np.allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-3)
    assert run.model.stat().st_size < 0.6 * trained.model.stat().st_size
    from training.quantise import export_int8

    with pytest.raises(RetrievalError, match=r"model.onnx: a float16 model; int8 is quantised from the float32 one"):
        export_int8(run)  # it quantised the float16 graph, warned from inside ONNX Runtime and failed its gate
    before = run.model.read_bytes()
    assert main(["export", str(run.root), "--fp16", "--int8"]) == 2
    assert run.model.read_bytes() == before and not run.int8_model.exists()


class SwappedSession:
    """An ONNX session stand-in whose output puts two images in each other's place."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def run(self, _: object, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        with torch.no_grad():
            out = self.model(torch.from_numpy(feeds["images"])).numpy()
        if len(out) > 3:
            out[[0, 3]] = out[[3, 0]]
        return [out]


def test_the_neighbour_check_catches_a_reordered_ranking(trained: RunDir) -> None:
    model, _ = load_encoder(trained)
    stand_in = type("Stub", (), {"session": SwappedSession(model), "input_name": "images"})()
    batches = [np.random.default_rng(1).standard_normal((16, 3, 40, 40)).astype(np.float32)]
    parity = export_module.measure_parity(model, stand_in, batches)
    assert not parity.same_neighbours and not parity.ok
    assert "DIFFERENT" in parity.describe()


def test_whiten_dim_beyond_the_embedding_or_the_training_images_is_one_line() -> None:
    """--whiten-dim keeps directions that the training images vary along: no more than the embedding has, nor than
    the images can span (n images: n - 1 directions about their mean)."""
    vectors = np.random.default_rng(0).standard_normal((20, 32)).astype(np.float32)
    mean, projection = fit_whitening(vectors, 0.0, 19)
    assert projection.shape == (32, 19) and mean.shape == (32,)
    with pytest.raises(RetrievalError, match="between 1 and the embedding's 32 dimensions, got 33"):
        fit_whitening(vectors, 0.0, 33)
    with pytest.raises(RetrievalError, match="fitted on 20 training images, which vary along at most 19 directions; give at most 19"):
        fit_whitening(vectors, 0.0, 20)
    with pytest.raises(RetrievalError, match="--whiten 0 .full whitening.: fitted on 20 training images, which vary along at most 19 of "
                       "the embedding's 32 directions; give --whiten-dim 19 or less with it, a shrinkage above 0"):
        fit_whitening(vectors, 0.0)  # the export failed its parity check: noise directions scaled up 1000x
    assert fit_whitening(vectors, 0.1)[1].shape == (32, 32)


def test_an_export_over_an_indexed_run_says_the_index_needs_rebuilding(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Re-exporting (another --whiten) left the index of the model before; only the next search said so."""
    import index.backends
    from retrieval.commands.export import _stale_index_note
    from retrieval.runs import write_json

    run = RunDir(tmp_path / "run")
    write_json(run.model_card, {"sha256": "new"})
    for built, said in (("old", True), ("new", False), (None, False)):
        monkeypatch.setattr(index.backends, "built_with", lambda directory, built=built: built)
        _stale_index_note(run)
        out = capsys.readouterr().out.replace("\n", " ")
        assert ("holds the vectors of the model exported before" in out and "--rebuild" in out) == said, out


def test_arguments_of_the_wrong_kind_from_python_are_one_line(trained: RunDir) -> None:
    """export(run, whiten="none") failed in "'<=' not supported between instances of 'int' and 'str'", and
    export(run, parity_images="query.png") read the path letter by letter, each letter a missing image."""
    before = trained.model.read_bytes() if trained.model.is_file() else None
    for options, said in [({"whiten": "none"}, "whiten: a shrinkage in [0, 1], or None for no whitening; got 'none'"), ({"parity_images": "query.png"}, "parity_images: a list of image files, not one file; write ['query.png']"), ({"whiten": None, "whiten_dim": 8}, "--whiten-dim 8 keeps that many whitened dimensions, and --whiten none exports none: drop one of the two"), ({"whiten_dim": "8"}, "whiten_dim: a whole number of dimensions, or None for all; got '8'")]:
        with pytest.raises(RetrievalError) as refused:
            export(trained, **options)
        assert str(refused.value) == said
    assert (trained.model.read_bytes() if trained.model.is_file() else None) == before
