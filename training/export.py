"""ONNX export of a run's encoder, accepted only after its outputs match PyTorch's."""

from __future__ import annotations

import hashlib
import logging
import tempfile
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import onnx
import torch

from retrieval.data import load_collection, load_image
from retrieval.embedders import OnnxEmbedder
from retrieval.errors import ImageError, RetrievalError
from retrieval.runs import RunDir, write_atomic, write_json
from training.train import load_encoder

OPSET = 18
PARITY_BATCH_SIZES = (1, 2, 7, 64)
MAX_ABS_DIFFERENCE = 1e-4
MIN_COSINE = 0.9999


@dataclass(frozen=True)
class Parity:
    """How far ONNX Runtime's outputs are from PyTorch's over all checked batches."""

    max_abs_difference: float
    min_cosine: float

    @property
    def ok(self) -> bool:
        return self.max_abs_difference <= MAX_ABS_DIFFERENCE and self.min_cosine >= MIN_COSINE


def export(run: RunDir, parity_images: Sequence[Path] = ()) -> Parity:
    """Exports RUN's encoder to RUN/model.onnx + RUN/model.json after a parity check against PyTorch.

    The check runs random inputs at batch sizes 1, 2, 7 and 64 plus real images (parity_images, or
    the training data listed in config.json when it is still there). A failed check leaves no
    model.onnx and raises RetrievalError with the measured differences.
    """
    model, config = load_encoder(run)
    preprocessing = config.preprocessing
    size = preprocessing.image_size
    example = torch.randn(2, 3, size, size)
    with tempfile.TemporaryDirectory(dir=run.root, prefix=".export-") as scratch:
        candidate = Path(scratch) / "model.onnx"
        _export_onnx(model, example, candidate)
        onnx.checker.check_model(str(candidate), full_check=True)
        digest = hashlib.sha256(candidate.read_bytes()).hexdigest()
        card = {
            "format": "onnx",
            "opset": OPSET,
            "input": {"name": "images", "shape": ["batch", 3, size, size], "dtype": "float32", "colour": "RGB, alpha composited over white"},
            "output": {"name": "embeddings", "shape": ["batch", model.embedding_dim], "l2_normalised": True},
            "preprocessing": preprocessing.to_dict(),
            "embedding_dim": model.embedding_dim,
            "backbone": config.backbone,
            "sha256": digest,
            "run": str(run.root.resolve()),
            "trained_on": config.data,
            "exported": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        }
        embedder = OnnxEmbedder(candidate, card)
        inputs = [np.random.default_rng(n).standard_normal((n, 3, size, size)).astype(np.float32) for n in PARITY_BATCH_SIZES]
        real = _real_images(parity_images or _training_images(config.data), limit=max(PARITY_BATCH_SIZES))
        if real:
            inputs.append(preprocessing(real))
        parity = measure_parity(model, embedder, inputs)
        if not parity.ok:
            raise RetrievalError(
                f"ONNX export of {run.root} failed its parity check: max |Δ| {parity.max_abs_difference:.2e} (limit {MAX_ABS_DIFFERENCE:.0e}), "
                f"min cosine {parity.min_cosine:.6f} (limit {MIN_COSINE}); no model.onnx was written"
            )
        card["parity"] = {"max_abs_difference": parity.max_abs_difference, "min_cosine": parity.min_cosine, "batch_sizes": [len(x) for x in inputs]}
        write_atomic(run.model, candidate.read_bytes())
    write_json(run.model_card, card)
    return parity


def measure_parity(model: torch.nn.Module, embedder: OnnxEmbedder, inputs: Sequence[np.ndarray]) -> Parity:
    """Compares the torch model and the ONNX session on the same preprocessed batches."""
    worst_abs, worst_cos = 0.0, 1.0
    with torch.no_grad():
        for batch in inputs:
            expected = model(torch.from_numpy(batch)).numpy()
            (actual,) = embedder.session.run(None, {embedder.input_name: batch})
            worst_abs = max(worst_abs, float(np.abs(expected - actual).max()))
            cosine = (expected * actual).sum(axis=1) / (np.linalg.norm(expected, axis=1) * np.linalg.norm(actual, axis=1))
            worst_cos = min(worst_cos, float(cosine.min()))
    return Parity(worst_abs, worst_cos)


def _export_onnx(model: torch.nn.Module, example: torch.Tensor, path: Path) -> None:
    batch = torch.export.Dim("batch", min=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.getLogger("torch.onnx").setLevel(logging.ERROR)
        torch.onnx.export(
            model,
            (example,),
            str(path),
            input_names=["images"],
            output_names=["embeddings"],
            dynamic_shapes={"images": {0: batch}},
            opset_version=OPSET,
            dynamo=True,
            external_data=False,
            verbose=False,
        )


def _training_images(data: str) -> list[Path]:
    try:
        return [item.path for item in load_collection(data).items]
    except RetrievalError:
        return []  # the training data may have moved since; random inputs still check the graph


def _real_images(paths: Sequence[Path], limit: int) -> list:
    images = []
    for path in paths[:limit]:
        try:
            images.append(load_image(path))
        except ImageError:
            continue
    return images
