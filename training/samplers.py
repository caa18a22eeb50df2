"""Class-balanced batches: P classes x M images per class, so every anchor has positives."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Sequence

import numpy as np
from torch.utils.data import Sampler

from retrieval.errors import RetrievalError


def refuse_batch_shape(batch_size: int, images_per_class: int) -> None:
    """One line for class-balanced batches that cannot hold two classes of a positive pair or more each; training
    asks it before it writes the run's files."""
    if images_per_class < 2:
        raise RetrievalError(f"--images-per-class {images_per_class}: give at least 2 (a positive pair per class)")
    if batch_size < 2 * images_per_class:
        raise RetrievalError(
            f"--batch-size {batch_size}: give at least {2 * images_per_class}, two classes of "
            f"--images-per-class {images_per_class}"
        )


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
        refuse_batch_shape(batch_size, images_per_class)
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


class InstanceBatchSampler(Sampler[list[int]]):
    """Batches of `batch_size` distinct images of `count`, in a fresh seeded order every epoch (each image its own
    class: self-supervised training). The last incomplete batch is left out, so every batch has the same size;
    under DDP every rank draws the same sequence and keeps every world_size-th batch from its rank on."""

    def __init__(self, count: int, batch_size: int, seed: int = 0, rank: int = 0, world_size: int = 1) -> None:
        if count < 2:
            raise RetrievalError(f"self-supervised training needs at least two images to contrast, got {count}")
        self.count, self.batch_size = count, max(2, min(batch_size, count))
        self.num_batches = max(1, count // (self.batch_size * world_size))
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.epoch = self.skip = 0

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        """Makes the next iteration yield this epoch's batches after the first `skip` (seeded by epoch)."""
        self.epoch, self.skip = epoch, skip

    def __len__(self) -> int:
        return self.num_batches - self.skip

    def __iter__(self) -> Iterator[list[int]]:
        rng = np.random.default_rng((self.seed, self.epoch))
        total = self.num_batches * self.world_size * self.batch_size
        order = np.concatenate([rng.permutation(self.count) for _ in range(total // self.count + 1)])
        for number in range(self.num_batches * self.world_size):
            if number % self.world_size == self.rank and number // self.world_size >= self.skip:
                yield order[number * self.batch_size : (number + 1) * self.batch_size].tolist()


class MixedBatchSampler(Sampler[list[int]]):
    """Class-balanced batches of the labeled images (ClassBalancedBatchSampler), each with `pool_batch` images of a
    pool for the self-supervised loss beside it (partly labeled and adapted runs).

    Indices below len(labels) are labeled images, the others pool images (len(labels) + their position in the
    pool). The pool is drawn in a seeded order per epoch, continued from batch to batch, so that an epoch of the
    labeled batches sees about epochs x batches x pool_batch pool images, and a resumed epoch the same ones.
    """

    def __init__(
        self, labeled: ClassBalancedBatchSampler, offset: int, pool: int, pool_batch: int, seed: int = 0
    ) -> None:
        if pool < 2:
            raise RetrievalError(f"the self-supervised loss needs at least two images to contrast, got {pool}")
        self.labeled, self.offset, self.pool = labeled, offset, pool
        self.pool_batch = max(2, min(pool_batch, pool))
        self.seed = seed
        self.num_batches = labeled.num_batches

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        self.labeled.set_epoch(epoch, skip)

    def __len__(self) -> int:
        return len(self.labeled)

    def __iter__(self) -> Iterator[list[int]]:
        sampler = self.labeled
        rng = np.random.default_rng((self.seed, sampler.epoch, 1))
        wanted = sampler.num_batches * sampler.world_size * self.pool_batch
        order = np.concatenate([rng.permutation(self.pool) for _ in range(wanted // self.pool + 1)])
        for number, batch in enumerate(sampler, start=sampler.skip):
            drawn = number * sampler.world_size + sampler.rank
            pool = order[drawn * self.pool_batch : (drawn + 1) * self.pool_batch] + self.offset
            yield batch + pool.tolist()
