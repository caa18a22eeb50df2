"""Embedders (images -> L2-normalised float32 rows) and batch embedding of a collection."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
from PIL import Image
from tqdm import tqdm

from retrieval.data import Item, Skipped, decode_image, read_image_bytes
from retrieval.errors import ImageError, RetrievalError
from retrieval.preprocess import Preprocessing
from retrieval.runs import RunDir, read_json


class Embedder(Protocol):
    """Maps RGB images to L2-normalised embeddings; `fingerprint` names the exact encoder."""

    dim: int
    fingerprint: str

    def embed(self, images: Sequence[Image.Image]) -> np.ndarray:
        """Returns float32 [N, dim] with unit-norm rows."""
        ...


def l2_normalise(vectors: np.ndarray) -> np.ndarray:
    """Returns float32 rows scaled to unit length (zero rows stay zero)."""
    vectors = np.asarray(vectors, dtype=np.float32)
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    return vectors / np.maximum(norms, 1e-12)


class OnnxEmbedder:
    """Runs an exported encoder (model.onnx + model.json) with ONNX Runtime, on CUDA when available."""

    def __init__(self, model_path: Path, card: dict, threads: int | None = None) -> None:
        import onnxruntime as ort  # imported here so that metrics and data need no runtime

        self.card = card
        self.preprocessing = Preprocessing.from_dict(card["preprocessing"])
        self.dim = int(card["embedding_dim"])
        self.fingerprint = str(card["sha256"])
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.intra_op_num_threads = threads or os.cpu_count() or 1
        available = ort.get_available_providers()
        providers = [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in available]
        try:
            self.session = ort.InferenceSession(str(model_path), options, providers=providers)
        except Exception as error:  # onnxruntime raises its own untyped errors for bad files
            raise RetrievalError(f"{model_path}: ONNX Runtime cannot load it ({error}); re-export with `retrieval export`") from None
        self.input_name = self.session.get_inputs()[0].name
        self.batch_size = 256 if "CUDAExecutionProvider" in self.session.get_providers() else 64

    @classmethod
    def from_run(cls, run: RunDir, threads: int | None = None) -> "OnnxEmbedder":
        """Loads the run's exported model, checking it against the sha256 in its model card."""
        model_path = run.require_model()
        card = read_json(run.model_card)
        digest = hashlib.sha256(model_path.read_bytes()).hexdigest()
        if digest != card.get("sha256"):
            raise RetrievalError(f"{model_path}: sha256 {digest[:12]}… does not match model.json ({str(card.get('sha256'))[:12]}…); re-export with `retrieval export {run.root}`")
        return cls(model_path, card, threads)

    def embed(self, images: Sequence[Image.Image]) -> np.ndarray:
        if not images:
            return np.zeros((0, self.dim), np.float32)
        batch = self.preprocessing(images)
        (output,) = self.session.run(None, {self.input_name: batch})
        return l2_normalise(output)


class PixelEmbedder:
    """The raw-pixel baseline: each image shrunk to size x size grayscale and flattened, compared by cosine."""

    def __init__(self, size: int = 16) -> None:
        self.size = size
        self.dim = size * size
        self.fingerprint = f"raw-pixels-{size}x{size}-grayscale"
        self.batch_size = 256

    def embed(self, images: Sequence[Image.Image]) -> np.ndarray:
        rows = [np.asarray(image.convert("L").resize((self.size, self.size), Image.Resampling.BILINEAR), np.float32).ravel() for image in images]
        return l2_normalise(np.stack(rows) if rows else np.zeros((0, self.dim), np.float32))


@dataclass
class Embedded:
    """The result of embedding a list of items: vectors for the good ones, reasons for the rest."""

    vectors: np.ndarray
    items: list[Item]
    hashes: list[str]
    skipped: list[Skipped]


def embed_items(embedder: Embedder, items: Sequence[Item], batch_size: int | None = None, progress: bool = True) -> Embedded:
    """Embeds items in batches; files that cannot be decoded are skipped and reported, the rest kept."""
    batch_size = batch_size or getattr(embedder, "batch_size", 64)
    vectors: list[np.ndarray] = []
    kept: list[Item] = []
    hashes: list[str] = []
    skipped: list[Skipped] = []
    with tqdm(total=len(items), desc="embedding", unit="img", disable=not progress) as bar:
        for start in range(0, len(items), batch_size):
            images: list[Image.Image] = []
            for item in items[start : start + batch_size]:
                try:
                    data, digest = read_image_bytes(item.path)
                    images.append(decode_image(data, item.path))
                except ImageError as error:
                    skipped.append(Skipped(item.path, error.reason))
                    continue
                kept.append(item)
                hashes.append(digest)
            if images:
                vectors.append(embedder.embed(images))
            bar.update(min(batch_size, len(items) - start))
    matrix = np.concatenate(vectors) if vectors else np.zeros((0, embedder.dim), np.float32)
    return Embedded(matrix, kept, hashes, skipped)
