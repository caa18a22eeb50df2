"""The images a run trains on, decoded on access and augmented: one view of a labeled image for the supervised
loss, two views of a pool image for the self-supervised one (its instance id is its position in the pool)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from PIL import Image
from torch.utils.data import Dataset

from retrieval.data import Item, load_image
from retrieval.preprocess import Preprocessing
from training.augment import make_augmentation

VIEWS = 2  # views of each image for the self-supervised loss
DECODED_SIDES = 4  # JPEGs are decoded at the reduced DCT scale that keeps both sides >= this many input sizes: the
# smallest random crop (30 % of the area: strongcrop, training.augment) keeps more pixels a side than the input


def decoded(item: Item, preprocessing: Preprocessing) -> Image.Image:
    """A training image decoded (a large JPEG at a reduced scale that the augmentation's crops do not miss: a
    12-megapixel photo decodes in a quarter of the time, and its crops are resized from a 64th of the pixels)."""
    return load_image(item.path, DECODED_SIDES * preprocessing.image_size)


class AugmentedImages(Dataset):
    """Items decoded on access, augmented (training.augment) and normalised as at evaluation."""

    def __init__(
        self, items: Sequence[Item], classes: Sequence[str], preprocessing: Preprocessing, augment: str
    ) -> None:
        self.items = list(items)
        codes = {label: code for code, label in enumerate(classes)}
        self.codes = [codes[item.label] for item in self.items]
        self.augment = make_augmentation(augment, preprocessing)
        self.preprocessing = preprocessing

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.augment(decoded(self.items[index], self.preprocessing)), self.codes[index]


@dataclass
class Batch:
    """A batch with a self-supervised part: labeled images [L, 3, S, S] with their class codes [L], and the two views
    [U, 2, 3, S, S] of pool images with their instance ids [U] (L is 0 in a self-supervised run)."""

    images: torch.Tensor
    labels: torch.Tensor
    views: torch.Tensor
    instances: torch.Tensor


class ViewedImages(Dataset):
    """The labeled images (indices 0..L-1: one view each, as AugmentedImages) followed by the pool (indices L..: two
    views each, of the self-supervised augmentation)."""

    def __init__(
        self,
        labeled: AugmentedImages | None,
        pool: Sequence[Item],
        preprocessing: Preprocessing,
        augment: str,
    ) -> None:
        self.labeled = labeled
        self.offset = len(labeled) if labeled is not None else 0
        self.pool = list(pool)
        self.augment = make_augmentation(augment, preprocessing)
        self.preprocessing = preprocessing

    def __len__(self) -> int:
        return self.offset + len(self.pool)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int, int]:
        if index < self.offset:
            image, code = self.labeled[index]  # type: ignore[index]
            return image[None], code, -1
        position = index - self.offset
        image = decoded(self.pool[position], self.preprocessing)
        return torch.stack([self.augment(image) for _ in range(VIEWS)]), -1, position


def collate(samples: list[tuple[torch.Tensor, int, int]]) -> Batch:
    """The samples of ViewedImages as one Batch (labeled first, as the mixed sampler yields them)."""
    labeled = [sample for sample in samples if sample[2] < 0]
    pooled = [sample for sample in samples if sample[2] >= 0]
    shape = samples[0][0].shape[1:]
    return Batch(
        images=torch.stack([image[0] for image, _, _ in labeled]) if labeled else torch.zeros(0, *shape),
        labels=torch.tensor([code for _, code, _ in labeled], dtype=torch.long),
        views=torch.stack([views for views, _, _ in pooled]) if pooled else torch.zeros(0, VIEWS, *shape),
        instances=torch.tensor([position for _, _, position in pooled], dtype=torch.long),
    )
