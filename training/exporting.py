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

from retrieval.benchmarks import load_training_data
from retrieval.data import load_collection, load_image, split_by_class
from retrieval.embedders import OnnxEmbedder
from retrieval.errors import ImageError, RetrievalError
from retrieval.knn import nearest_neighbours
from retrieval.runs import RunDir, write_atomic, write_json
from training.checkpoints import load_encoder
from training.config import TrainConfig
from training.whitening import whiten_encoder

OPSET = 18
PARITY_BATCH_SIZES = (1, 2, 7, 64, 256)  # 64 and 256: the batch sizes OnnxEmbedder uses on CPU and CUDA
MAX_ABS_DIFFERENCE = 1e-4
MIN_COSINE = 0.9999
MIN_COSINE_FLOAT16 = 0.999
NEIGHBOURS = 10
DEFAULT_WHITENING: float | None = 0.8  # the shrinkage of the whitening fitted at export (None: none); docs/recipe.md
# Layers that stay in float32 in a float16 export: normalisations (BatchNorm is folded into the
# convolutions by the exporter) and the final L2 normalisation (ReduceL2, Clip of its epsilon, Div).
FLOAT32_OPS = [
    "BatchNormalization",
    "LayerNormalization",
    "InstanceNormalization",
    "GroupNormalization",
    "ReduceL2",
    "Clip",
    "Div",
]


@dataclass(frozen=True)
class Parity:
    """How far ONNX Runtime's outputs are from PyTorch's over all checked batches."""

    max_abs_difference: float
    min_cosine: float
    same_neighbours: bool
    precision: str = "float32"

    @property
    def ok(self) -> bool:
        if self.precision == "float16":
            return self.min_cosine >= MIN_COSINE_FLOAT16
        return self.max_abs_difference <= MAX_ABS_DIFFERENCE and self.min_cosine >= MIN_COSINE and self.same_neighbours

    def describe(self) -> str:
        if self.precision == "float16":
            return f"min cosine {self.min_cosine:.6f} (limit {MIN_COSINE_FLOAT16})"
        return (
            f"max |Δ| {self.max_abs_difference:.2e} "
            f"(limit {MAX_ABS_DIFFERENCE:.0e}), "
            f"min cosine {self.min_cosine:.6f} "
            f"(limit {MIN_COSINE}), "
            f"top-{NEIGHBOURS} neighbours {'identical' if self.same_neighbours else 'DIFFERENT'}"
        )


def export(
    run: RunDir | str | Path,
    parity_images: Sequence[Path] = (),
    float16: bool = False,
    whiten: float | None = DEFAULT_WHITENING,
    whiten_dim: int | None = None,
) -> Parity:
    """Exports RUN's encoder to RUN/model.onnx + RUN/model.json after a parity check against PyTorch.

    With whiten (a shrinkage in [0, 1]), PCA-whitening fitted on the run's training images (its
    validation classes left out; training.whitening) is part of the exported graph, optionally
    keeping the whiten_dim strongest directions.

    The check runs random inputs at batch sizes 1, 2, 7, 64 and 256 plus real images (parity_images, or
    the training data listed in config.json when it is still there): float32 must agree within
    max |Δ| 1e-4 and cosine 0.9999 with identical top-10 neighbours among those images; float16
    (for GPUs: float32 inputs and outputs, normalisations in float32) within cosine 0.999. A failed
    check leaves no new model.onnx and raises RetrievalError with the measured differences.
    """
    run = RunDir.of(run)
    _check_arguments(parity_images, whiten, whiten_dim)
    model, config = load_encoder(run)
    preprocessing = config.preprocessing
    size = preprocessing.image_size
    whitening = None
    if whiten is not None:
        model = whiten_encoder(model, _fit_images(config), preprocessing, whiten, whiten_dim)
        whitening = {"shrinkage": whiten, "dim": model.embedding_dim, "fitted_on_images": model.fitted_on}
    example = torch.randn(2, 3, size, size)
    with tempfile.TemporaryDirectory(dir=run.root, prefix=".export-") as scratch:
        candidate = Path(scratch) / "model.onnx"
        _export_onnx(model, example, candidate)
        if float16:
            _convert_to_float16(candidate)
        onnx.checker.check_model(str(candidate), full_check=True)
        model_bytes = candidate.read_bytes()
        card = _model_card(run, config, model.embedding_dim, hashlib.sha256(model_bytes).hexdigest(), float16)
        card["whitening"] = whitening
        embedder = OnnxEmbedder(candidate, card)
        inputs = _parity_inputs(config, parity_images)
        parity = measure_parity(model, embedder, inputs, card["precision"])
        if not parity.ok:
            raise RetrievalError(
                f"ONNX export of {run.root} failed its parity check: {parity.describe()}; no model.onnx was written"
            )
        card["parity"] = {
            "max_abs_difference": parity.max_abs_difference,
            "min_cosine": parity.min_cosine,
            "same_top10_neighbours": parity.same_neighbours,
            "batch_sizes": [len(x) for x in inputs],
        }
        write_atomic(run.model, model_bytes)
    write_json(run.model_card, card, sealed=True)
    return parity


def _model_card(run: RunDir, config: TrainConfig, embedding_dim: int, digest: str, float16: bool) -> dict:
    """What serving needs to know about the exported model: input, output, preprocessing, sha256, provenance."""
    return {
        "format": "onnx",
        "opset": OPSET,
        "precision": "float16" if float16 else "float32",
        "input": {
            "name": "images",
            "shape": ["batch", 3, config.image_size, config.image_size],
            "dtype": "float32",
            "colour": "RGB, alpha composited over white",
        },
        "output": {"name": "embeddings", "shape": ["batch", embedding_dim], "l2_normalised": True},
        "preprocessing": config.preprocessing.to_dict(),
        "embedding_dim": embedding_dim,
        "backbone": config.backbone,
        "sha256": digest,
        "run": str(run.root.resolve()),
        "trained_on": config.data,
        "mode": config.mode or "supervised",
        "seen_without_labels": config.adapt,  # the gallery the run adapted to (--adapt), its labels never used
        "exported": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def measure_parity(
    model: torch.nn.Module, embedder: OnnxEmbedder, inputs: Sequence[np.ndarray], precision: str = "float32"
) -> Parity:
    """Compares the torch model and the ONNX session on the same preprocessed batches.

    The neighbour check ranks all checked images against each other (leave-one-out) with both
    outputs: ONNX Runtime's top 10 must be PyTorch's, up to exact ties in PyTorch's own similarities.
    """
    expected_rows, actual_rows = [], []
    with torch.no_grad():
        for batch in inputs:
            expected_rows.append(model(torch.from_numpy(batch)).numpy())
            actual_rows.append(embedder.session.run(None, {embedder.input_name: batch})[0])
    expected, actual = np.concatenate(expected_rows), np.concatenate(actual_rows)
    cosine = (expected * actual).sum(axis=1) / (np.linalg.norm(expected, axis=1) * np.linalg.norm(actual, axis=1))
    reference_ids, reference_scores = nearest_neighbours(expected, expected, NEIGHBOURS, exclude_self=True)
    actual_ids, _ = nearest_neighbours(actual, actual, NEIGHBOURS, exclude_self=True)
    # a different id at some rank is fine only if PyTorch scores it as its own choice there, within what the outputs'
    # difference can move a similarity (twice the largest distance between the two outputs of one input, at most what
    # the limit on |Δ| allows): near ties among near-identical embeddings (random inputs to a self-supervised encoder)
    # may swap, a reordered ranking may not
    allowed = MAX_ABS_DIFFERENCE * np.sqrt(expected.shape[1])
    tolerance = max(1e-6, 2 * min(float(np.linalg.norm(expected - actual, axis=1).max()), allowed))
    rescored = np.take_along_axis(expected @ expected.T, actual_ids, axis=1)
    same = bool(np.all((actual_ids == reference_ids) | (np.abs(rescored - reference_scores) <= tolerance)))
    return Parity(float(np.abs(expected - actual).max()), float(cosine.min()), same, precision)


def _convert_to_float16(path: Path) -> None:
    from onnxconverter_common import float16

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # it warns for every weight below float16's smallest normal number
        converted = float16.convert_float_to_float16(
            onnx.load(str(path)), keep_io_types=True, op_block_list=FLOAT32_OPS
        )
    onnx.save(converted, str(path))


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


def _fit_images(config: TrainConfig) -> list[Path]:
    """The images the run trained on, labeled or not (its validation classes left out, the gallery it adapted to
    in), to fit the whitening on."""
    try:
        items = load_training_data(config.data, config.benchmark).items
        gallery = load_collection(config.adapt).items if config.adapt else []
    except RetrievalError as error:
        raise RetrievalError(
            f"whitening is fitted on the run's training images, which cannot be read ({error}); "
            "put them back, or export with --whiten none"
        ) from None
    labeled = split_by_class([item for item in items if item.label], config.val_classes, config.seed)[0]
    return [item.path for item in labeled + [item for item in items + gallery if not item.label]]


def _training_images(data: str, benchmark: str | None) -> list[Path]:
    try:
        return [item.path for item in load_training_data(data, benchmark).items]
    except RetrievalError:
        return []  # the training data may have moved since; random inputs still check the graph


def _parity_inputs(config: TrainConfig, parity_images: Sequence[Path]) -> list[np.ndarray]:
    """The batches the parity check runs: random inputs at each of PARITY_BATCH_SIZES, then real images (those given,
    else the training data's) where any can be read."""
    preprocessing = config.preprocessing
    size = preprocessing.image_size
    inputs = [
        np.random.default_rng(n).standard_normal((n, 3, size, size)).astype(np.float32) for n in PARITY_BATCH_SIZES
    ]
    paths = parity_images or _training_images(config.data, config.benchmark)
    real = _real_images(paths, max(PARITY_BATCH_SIZES), size)
    if real:
        inputs.append(preprocessing(real))
    return inputs


def _check_arguments(parity_images: Sequence[Path], whiten: float | None, whiten_dim: int | None) -> None:
    """Refuses a Python caller's arguments of the wrong kind in one line: one path for parity_images (it was read
    letter by letter, each a missing file), whiten="none" and whiten_dim="5" (failed deep in a comparison); and a
    whiten_dim without whitening, which was dropped without a word."""
    if whiten is None and whiten_dim is not None:
        raise RetrievalError(
            f"--whiten-dim {whiten_dim} keeps that many whitened dimensions, and --whiten none exports none: drop "
            "one of the two"
        )
    if isinstance(parity_images, (str, Path)):
        raise RetrievalError(f"parity_images: a list of image files, not one file; write [{str(parity_images)!r}]")
    if whiten is not None and (isinstance(whiten, bool) or not isinstance(whiten, (int, float))):
        raise RetrievalError(f"whiten: a shrinkage in [0, 1], or None for no whitening; got {whiten!r}")
    if whiten_dim is not None and (isinstance(whiten_dim, bool) or not isinstance(whiten_dim, int)):
        raise RetrievalError(f"whiten_dim: a whole number of dimensions, or None for all; got {whiten_dim!r}")


def _real_images(paths: Sequence[Path], limit: int, size: int) -> list:
    """Up to limit of the images at paths that decode, for an input of size pixels (as indexing decodes)."""
    images = []
    for path in paths[:limit]:
        try:
            images.append(load_image(path, size))
        except ImageError:
            continue
    return images
