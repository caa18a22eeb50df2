"""PCA-whitening of the embeddings, fitted on the run's own training images and exported inside the ONNX graph.

The covariance of the training embeddings is shrunk towards a multiple of the identity before it is
inverted (Ledoit & Wolf's form): shrinkage 0 is full whitening, 1 only centres the embeddings. The
whitened embedding is normalised again, so serving is unchanged: same input, unit-norm output.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from retrieval.data import load_image
from retrieval.errors import ImageError, RetrievalError
from retrieval.preprocess import Preprocessing

MAX_IMAGES = 5000  # a seeded sample of the training images is enough to estimate the covariance
BATCH = 256


class Whitened(nn.Module):
    """An encoder followed by whitening: normalise((encoder(x) - mean) @ projection); fitted_on: how many images the
    whitening was fitted on (the model card says so)."""

    def __init__(self, encoder: nn.Module, mean: np.ndarray, projection: np.ndarray, fitted_on: int) -> None:
        super().__init__()
        self.encoder = encoder
        self.fitted_on = fitted_on
        self.register_buffer("mean", torch.from_numpy(np.asarray(mean, np.float32)))
        self.register_buffer("projection", torch.from_numpy(np.asarray(projection, np.float32)))
        self.embedding_dim = int(self.projection.shape[1])

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return F.normalize((self.encoder(images) - self.mean) @ self.projection, dim=1)


def fit_whitening(vectors: np.ndarray, shrinkage: float, dim: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(mean [D], projection [D, dim]) whitening vectors' shrunk covariance, its strongest `dim` directions kept."""
    if not 0 <= shrinkage <= 1:
        raise RetrievalError(f"--whiten is a shrinkage in [0, 1] (or none), got {shrinkage}")
    vectors = np.asarray(vectors, np.float64)
    width = vectors.shape[1]
    if dim is not None and not 1 <= dim <= width:
        raise RetrievalError(f"--whiten-dim must be between 1 and the embedding's {width} dimensions, got {dim}")
    if dim is not None and dim > len(vectors) - 1:
        raise RetrievalError(
            f"--whiten-dim {dim}: the whitening is fitted on {len(vectors)} training images, which vary along at most "
            f"{len(vectors) - 1} directions; give at most {len(vectors) - 1}, or train on more images"
        )
    if shrinkage == 0 and dim is None and width > len(vectors) - 1:  # the rest: noise scaled up 1000x (the floor)
        raise RetrievalError(
            f"--whiten 0 (full whitening): fitted on {len(vectors)} training images, which vary along at most "
            f"{len(vectors) - 1} of the embedding's {width} directions; give --whiten-dim {len(vectors) - 1} or less "
            "with it, a shrinkage above 0 (e.g. 0.5), or train on more images"
        )
    mean = vectors.mean(axis=0)
    centred = vectors - mean
    covariance = centred.T @ centred / len(vectors)
    covariance = (1 - shrinkage) * covariance + shrinkage * np.trace(covariance) / width * np.eye(width)
    values, directions = np.linalg.eigh(covariance)
    order = np.argsort(values)[::-1][: dim or width]
    floor = values.max() * 1e-6  # full whitening of directions the training images never vary along
    projection = directions[:, order] / np.sqrt(np.maximum(values[order], floor))
    return mean.astype(np.float32), projection.astype(np.float32)


def whiten_encoder(
    model: nn.Module, paths: Sequence[Path], preprocessing: Preprocessing, shrinkage: float, dim: int | None = None
) -> Whitened:
    """The model with whitening fitted on its embeddings of (a seeded sample of) paths."""
    if len(paths) > MAX_IMAGES:
        chosen = np.random.default_rng(0).choice(len(paths), MAX_IMAGES, replace=False)
        paths = [paths[i] for i in sorted(chosen)]
    rows = []
    with torch.no_grad():
        for start in range(0, len(paths), BATCH):
            images = []
            for path in paths[start : start + BATCH]:
                try:
                    images.append(load_image(path, preprocessing.image_size))  # as indexing decodes
                except ImageError:
                    continue
            if images:
                rows.append(model(torch.from_numpy(preprocessing(images))).numpy())
    vectors = np.concatenate(rows) if rows else np.zeros((0, 1), np.float32)
    if len(vectors) < 2:
        raise RetrievalError(
            "whitening is fitted on the run's training images, and fewer than two of them could be read; "
            "put the training data back where config.json says, or export with --whiten none"
        )
    mean, projection = fit_whitening(vectors, shrinkage, dim)
    return Whitened(model, mean, projection, len(vectors)).eval()
