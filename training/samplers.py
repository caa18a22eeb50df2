"""Class-balanced batches: P classes x M images per class, so every anchor has positives."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Sequence

import numpy as np
from torch.utils.data import Sampler

from retrieval.errors import RetrievalError


class ClassBalancedBatchSampler(Sampler[list[int]]):
    """Yields batches of `classes_per_batch` classes with `images_per_class` indices each.

    Classes are visited in a fresh random order every epoch; a class with fewer images than
    images_per_class repeats some (augmentation makes the repeats different views). One epoch has
    about len(labels) / batch_size batches in all. Under DDP every rank draws the same sequence of
    batches and keeps every world_size-th one from its rank on, so ranks see distinct batches.
    """

    def __init__(
        self,
        labels: Sequence[str],
        batch_size: int,
        images_per_class: int = 4,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        if images_per_class < 2:
            raise RetrievalError(f"images per class must be at least 2 for positive pairs, got {images_per_class}")
        if batch_size < 2 * images_per_class:
            raise RetrievalError(f"batch size {batch_size} must hold at least two classes of {images_per_class} images")
        by_class: dict[str, list[int]] = defaultdict(list)
        for index, label in enumerate(labels):
            by_class[label].append(index)
        if len(by_class) < 2:
            raise RetrievalError("class-balanced batches need at least two classes")
        self.groups = [np.array(indices) for _, indices in sorted(by_class.items())]
        self.images_per_class = images_per_class
        self.classes_per_batch = min(batch_size // images_per_class, len(self.groups))
        self.num_batches = max(1, len(labels) // (self.classes_per_batch * images_per_class * world_size))
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.epoch = self.skip = 0

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        """Makes the next iteration yield this epoch's batches after the first `skip` (seeded by epoch)."""
        self.epoch, self.skip = epoch, skip

    def __len__(self) -> int:
        return self.num_batches - self.skip

    def __iter__(self) -> Iterator[list[int]]:
        rng = np.random.default_rng((self.seed, self.epoch))
        order: list[int] = []
        for number in range(self.num_batches * self.world_size):
            if len(order) < self.classes_per_batch:
                # a new pass over the classes; the leftover ones wait for the next pass, so no batch repeats a class
                order += [c for c in rng.permutation(len(self.groups)).tolist() if c not in order]
            chosen, order = order[: self.classes_per_batch], order[self.classes_per_batch :]
            batch: list[int] = []
            for group in (self.groups[c] for c in chosen):
                replace = len(group) < self.images_per_class
                batch += rng.choice(group, self.images_per_class, replace=replace).tolist()
            if number % self.world_size == self.rank and number // self.world_size >= self.skip:
                yield batch
