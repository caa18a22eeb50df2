"""An int8 encoder for CPUs: ONNX Runtime's static quantisation of model.onnx, accepted only if retrieval survives it.

QDQ format, weights int8 per channel, activations uint8 (the U8S8 kernels of x86 VNNI), calibrated
on a seeded sample of the run's own training images read with the inference preprocessing. A second,
disjoint sample of those images is embedded by both models: the int8 model is written (as
RUN/model.int8.onnx, recorded under "int8" in the model card) only if its recall@1 there is within
MAX_RECALL_DROP of the float32 model's (or one query, on fewer than 100 images) and its top-10
neighbours overlap the float32 ones by at least MIN_OVERLAP; otherwise nothing is written and the
error gives the figures.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from retrieval.benchmarks import load_training_data
from retrieval.data import Item, load_image
from retrieval.embedders import OnnxEmbedder
from retrieval.errors import ImageError, RetrievalError, one_of
from retrieval.knn import nearest_neighbours
from retrieval.metrics import score_queries
from retrieval.runs import RunDir, read_json, write_atomic, write_json

CALIBRATION_IMAGES = 300
CALIBRATION_BATCH = 30
HELD_OUT_IMAGES = 500
MAX_RECALL_DROP = 0.01
MIN_OVERLAP = 0.9
METHODS = ("minmax", "entropy", "percentile")
DEFAULT_METHOD = "minmax"  # docs/benchmarks.md: the three measured on a trained run, within one query of each other
NEIGHBOURS = 10


@dataclass(frozen=True)
class Int8Report:
    """What the quality gate measured on the held-out images."""

    method: str
    calibration_images: int
    held_out_images: int
    overlap_at_10: float
    recall_at_1_float32: float
    recall_at_1_int8: float

    @property
    def allowed_drop(self) -> float:
        """MAX_RECALL_DROP, or one query's worth on fewer than 100 held-out images (the finest step they can show)."""
        return max(MAX_RECALL_DROP, 1 / self.held_out_images)

    @property
    def ok(self) -> bool:
        drop = self.recall_at_1_float32 - self.recall_at_1_int8
        return drop <= self.allowed_drop + 1e-9 and self.overlap_at_10 >= MIN_OVERLAP

    def describe(self) -> str:
        return (
            f"top-{NEIGHBOURS} overlap with float32 {self.overlap_at_10:.3f} (at least {MIN_OVERLAP}), recall@1 "
            f"{self.recall_at_1_int8:.3f} against float32's {self.recall_at_1_float32:.3f} "
            f"(at most {self.allowed_drop:.3g} lower), on {self.held_out_images} held-out training images"
        )


def export_int8(run: RunDir | str | Path, method: str = DEFAULT_METHOD) -> Int8Report:
    """Quantises RUN/model.onnx to RUN/model.int8.onnx after the quality gate; raises RetrievalError if it fails."""
    run = RunDir.of(run)
    if method not in METHODS:
        raise RetrievalError(f"unknown calibration method {method!r}; {one_of(method, METHODS)}")
    float32 = OnnxEmbedder.from_run(run)
    if float32.card.get("precision") == "float16":
        raise RetrievalError(
            f"{run.model}: a float16 model; int8 is quantised from the float32 one: export "
            "again without --fp16, then with --int8"
        )
    calibration, held_out = _samples(run)
    with tempfile.TemporaryDirectory(dir=run.root, prefix=".int8-") as scratch:
        candidate = Path(scratch) / "model.int8.onnx"
        quantise(float32, calibration, candidate, method)
        data = candidate.read_bytes()
        card = read_json(run.model_card)
        int8_card = {**card, "precision": "int8", "sha256": hashlib.sha256(data).hexdigest()}
        report = _gate(float32, OnnxEmbedder(candidate, int8_card), held_out, method, len(calibration))
        if not report.ok:
            raise RetrievalError(
                f"the int8 model of {run.root} loses too much retrieval: {report.describe()}; "
                "no model.int8.onnx was written (try another --calibration, or serve the float32 model)"
            )
        write_atomic(run.int8_model, data)
    card["int8"] = {
        "file": run.int8_model.name,
        "sha256": int8_card["sha256"],
        "format": "QDQ, weights int8 per channel, activations uint8",
        "calibration": {"method": method, "images": len(calibration)},
        "gate": {
            "held_out_images": report.held_out_images,
            "overlap_at_10": report.overlap_at_10,
            "recall_at_1_float32": report.recall_at_1_float32,
            "recall_at_1_int8": report.recall_at_1_int8,
        },
    }
    write_json(run.model_card, card, sealed=True)
    return report


def quantise(float32: OnnxEmbedder, calibration: Sequence[Item], output: Path, method: str = DEFAULT_METHOD) -> None:
    """Writes the static QDQ int8 quantisation of float32's model to output, calibrated on the images of calibration.

    The calibration batches are all of one size (the histogram calibrators stack them): the last one is
    filled up with the first images again.
    """
    quantization = _quantization()
    reader = _Calibration(float32, calibration)
    with tempfile.TemporaryDirectory(prefix="retrieval-int8-") as scratch:
        prepared = Path(scratch) / "prepared.onnx"
        try:
            quantization.shape_inference.quant_pre_process(
                str(float32.model_path), str(prepared), skip_symbolic_shape=True
            )
            with contextlib.redirect_stdout(io.StringIO()):  # the histogram calibrators print their bin counts
                quantization.quantize_static(
                    str(prepared),
                    str(output),
                    reader,
                    quant_format=quantization.QuantFormat.QDQ,
                    per_channel=True,
                    reduce_range=True,
                    activation_type=quantization.QuantType.QUInt8,
                    weight_type=quantization.QuantType.QInt8,
                    calibrate_method=getattr(
                        quantization.CalibrationMethod, {"minmax": "MinMax"}.get(method, method.title())
                    ),
                )
        except Exception as error:  # onnxruntime.quantization raises many untyped errors
            raise RetrievalError(
                f"ONNX Runtime could not quantise {float32.model_path} with {method} calibration "
                f"({str(error).splitlines()[0][:200]}); try --calibration minmax"
            ) from None


def _quantization() -> object:
    """onnxruntime.quantization, with its per-node log lines silenced."""
    import onnxruntime.quantization as quantization
    import onnxruntime.quantization.shape_inference  # noqa: F401  (the submodule quant_pre_process lives in)

    logging.getLogger("onnxruntime.quantization").setLevel(logging.ERROR)
    logging.getLogger().setLevel(max(logging.getLogger().level, logging.WARNING))
    return quantization


def _samples(run: RunDir) -> tuple[list[Item], list[Item]]:
    """Two disjoint seeded samples of the run's labeled training images: calibration, and held out for the gate."""
    config = read_json(run.config)
    try:
        items = [item for item in load_training_data(config["data"], config.get("benchmark")).items if item.label]
    except RetrievalError as error:
        raise RetrievalError(
            f"the int8 model is calibrated and checked on the run's training images, which cannot be read ({error}); "
            "put them back where config.json says"
        ) from None
    order = np.random.default_rng(0).permutation(len(items))
    shuffled = [items[i] for i in order]
    split = min(CALIBRATION_IMAGES, len(items) // 2)  # a small collection: half to calibrate, half to check
    calibration = shuffled[:split]
    held_out = shuffled[split : split + HELD_OUT_IMAGES]
    if len(calibration) < 16 or len({item.label for item in held_out}) < 2:
        raise RetrievalError(
            f"{config['data']}: {len(items)} labeled training images are too few to calibrate and check an int8 "
            f"model (it takes up to {CALIBRATION_IMAGES} + {HELD_OUT_IMAGES}; at least 32, of two labels or more)"
        )
    return calibration, held_out


class _Calibration:
    """ONNX Runtime's CalibrationDataReader: the readable images, preprocessed, in batches of one size (the last
    filled up with the first images again)."""

    def __init__(self, embedder: OnnxEmbedder, items: Sequence[Item]) -> None:
        self.name = embedder.input_name
        images = _readable(items, embedder.input_size)
        if not images:
            raise RetrievalError("none of the calibration images could be read; check the run's training data")
        batch = min(CALIBRATION_BATCH, len(images))
        images += images[: -len(images) % batch or 0]
        self.batches: Iterator[np.ndarray] = (
            embedder.prepare(images[start : start + batch]) for start in range(0, len(images), batch)
        )

    def get_next(self) -> dict[str, np.ndarray] | None:
        batch = next(self.batches, None)
        return None if batch is None else {self.name: batch}


def _readable(items: Sequence[Item], size: int) -> list:
    """The items' images that decode (the others are left out), for an input of size pixels (as indexing decodes)."""
    images = []
    for item in items:
        try:
            images.append(load_image(item.path, size))
        except ImageError:
            continue
    return images


def _gate(float32: OnnxEmbedder, int8: OnnxEmbedder, items: Sequence[Item], method: str, calibrated: int) -> Int8Report:
    """Embeds the held-out items with both models: top-10 overlap and leave-one-out recall@1 of each."""
    pairs = [(image, item.label) for item in items for image in _readable([item], float32.input_size)]
    images, labels = [image for image, _ in pairs], [label for _, label in pairs]
    reference, quantised = float32.embed(images), int8.embed(images)
    k = min(NEIGHBOURS, len(images) - 1)
    expected, _ = nearest_neighbours(reference, reference, k, exclude_self=True)
    found, _ = nearest_neighbours(quantised, quantised, k, exclude_self=True)
    overlap = float(np.mean([len(set(a) & set(b)) / k for a, b in zip(expected, found)]))
    recall = [
        float(score_queries(vectors, labels, ks=(1,)).values["recall@1"].mean()) for vectors in (reference, quantised)
    ]
    return Int8Report(method, calibrated, len(images), overlap, recall[0], recall[1])
