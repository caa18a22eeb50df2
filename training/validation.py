"""Validation during training: retrieval and embedding diagnostics on held-out classes, once per epoch.

The held-out images are decoded once and kept as the encoder's uint8 pixels while they fit in
VALIDATION_MEMORY (10,000 images at 224 px are 1.4 GiB so, 5.6 GiB as float32); a larger split is
decoded again, batch by batch, each epoch, so that memory stays bounded whatever its size.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
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
VALIDATION_MEMORY = 2**31  # bytes of decoded held-out pixels kept between epochs; beyond, decoded each epoch


class Validator:
    """Leave-one-out recall@1 and MAP@R, alignment, uniformity and tolerance on held-out classes."""

    def __init__(
        self,
        items: Sequence[Item],
        preprocessing: Preprocessing,
        device: torch.device,
        memory: int = VALIDATION_MEMORY,
    ) -> None:
        self.items = list(items)
        self.labels = [item.label for item in items]
        self.preprocessing = preprocessing
        self.device = device
        size = preprocessing.image_size
        self.pixels: np.ndarray | None = None  # [N, S, S, 3] uint8, filled in place (no list of copies to stack)
        if len(items) * size * size * 3 <= memory:
            self.pixels = np.empty((len(items), size, size, 3), np.uint8)
            for row, item in enumerate(items):
                self.pixels[row] = self._decoded(item)
        self.mean = torch.tensor(preprocessing.mean, dtype=torch.float32).view(1, 3, 1, 1)
        self.std = torch.tensor(preprocessing.std, dtype=torch.float32).view(1, 3, 1, 1)

    def _decoded(self, item: Item) -> np.ndarray:
        return self.preprocessing.pixels(load_image(item.path, self.preprocessing.image_size))  # as indexing decodes

    def batches(self) -> Iterator[torch.Tensor]:
        """The held-out images as normalised float32 batches [B, 3, S, S], in order.

        The same float32 operations as Preprocessing.normalise_pixels, in torch: the same values, several times
        faster on a large split.
        """
        for start in range(0, len(self.items), BATCH):
            if self.pixels is not None:
                pixels = self.pixels[start : start + BATCH]
            else:
                pixels = np.stack([self._decoded(item) for item in self.items[start : start + BATCH]])
            channels_first = torch.from_numpy(pixels).permute(0, 3, 1, 2).contiguous()
            yield channels_first.float().div_(255.0).sub_(self.mean).div_(self.std)

    def __call__(self, model: Encoder) -> dict:
        """Scores the embeddings; the diagnostics also of the projections the loss sees (prefixed loss_)."""
        model.eval()
        with torch.no_grad():
            batches = [model.embed_and_project(batch.to(self.device)) for batch in self.batches()]
        model.train()
        vectors = torch.cat([embedded for embedded, _ in batches]).float().cpu().numpy()
        projections = torch.cat([projected for _, projected in batches]).float().cpu().numpy()
        scores = {**retrieval_metrics(vectors, self.labels, ks=(1,)), **embedding_diagnostics(vectors, self.labels)}
        scores.update(
            {f"loss_{name}": value for name, value in embedding_diagnostics(projections, self.labels).items()}
        )
        return scores
