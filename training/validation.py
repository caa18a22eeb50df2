"""Validation during training: retrieval and embedding diagnostics on held-out classes, once per epoch."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from retrieval.data import Item, load_image
from retrieval.metrics import embedding_diagnostics, retrieval_metrics
from retrieval.preprocess import Preprocessing
from training.model import Encoder

VALIDATION_KEYS = (
    "recall@1",
    "map@r",
    "alignment",
    "uniformity",
    "tolerance",
    "loss_alignment",
    "loss_uniformity",
    "loss_tolerance",
)
BATCH = 256


class Validator:
    """Leave-one-out recall@1 and MAP@R, alignment, uniformity and tolerance on held-out classes."""

    def __init__(self, items: Sequence[Item], preprocessing: Preprocessing, device: torch.device) -> None:
        self.labels = [item.label for item in items]
        self.images = torch.from_numpy(preprocessing([load_image(item.path) for item in items]))
        self.device = device

    def __call__(self, model: Encoder) -> dict:
        """Scores the embeddings; the diagnostics also of the projections the loss sees (prefixed loss_)."""
        model.eval()
        with torch.no_grad():
            batches = [
                model.embed_and_project(self.images[i : i + BATCH].to(self.device))
                for i in range(0, len(self.images), BATCH)
            ]
        model.train()
        vectors = torch.cat([embedded for embedded, _ in batches]).float().cpu().numpy()
        projections = torch.cat([projected for _, projected in batches]).float().cpu().numpy()
        scores = {**retrieval_metrics(vectors, self.labels, ks=(1,)), **embedding_diagnostics(vectors, self.labels)}
        scores.update(
            {f"loss_{name}": value for name, value in embedding_diagnostics(projections, self.labels).items()}
        )
        return scores
