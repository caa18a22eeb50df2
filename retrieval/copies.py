"""Quality figures without labels: how well each image, changed as a copy of it would be, finds itself.

Each image of a collection (a seeded sample of up to COPY_SAMPLE) gets one augmented copy: a crop of
70-100 % of each side, rescaled by 0.6-1.4, brightness, contrast and saturation moved by up to 30 %,
grey one time in five, blurred one time in four (Pillow only: no torch). The figures, from the
copies and the originals' embeddings:

- `copy recall@1`: the share of copies whose nearest original (among all of them) is their own;
- `alignment` (Wang & Isola 2020): mean ||f(x) - f(copy of x)||^2 (lower: a copy stays close);
- `uniformity` (Wang & Isola 2020): log mean exp(-2 ||f(x) - f(y)||^2) over the originals' pairs
  (lower: more spread out).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageEnhance, ImageFilter

from retrieval.data import Item, Skipped, load_image
from retrieval.embedders import Embedder, embed_items
from retrieval.errors import ImageError, RetrievalError
from retrieval.knn import nearest_neighbours
from retrieval.metrics import uniformity

COPY_SAMPLE = 2000  # images copied and searched at most (a seeded sample above)
PROTOCOL = "augmented copies (no labels): each image's copy searches the originals"


def augmented_copy(image: Image.Image, rng: np.random.Generator) -> Image.Image:
    """A changed copy of an image (see the module's text), drawn from rng."""
    width, height = image.size
    keep_x, keep_y = rng.uniform(0.7, 1.0, 2)
    left, top = rng.uniform(0, 1 - keep_x) * width, rng.uniform(0, 1 - keep_y) * height
    image = image.crop((int(left), int(top), int(left + keep_x * width), int(top + keep_y * height)))
    scale = rng.uniform(0.6, 1.4)
    image = image.resize((max(8, round(image.width * scale)), max(8, round(image.height * scale))))
    for enhance in (ImageEnhance.Brightness, ImageEnhance.Contrast, ImageEnhance.Color):
        image = enhance(image).enhance(rng.uniform(0.7, 1.3))
    if rng.random() < 0.2:
        image = image.convert("L").convert("RGB")
    if rng.random() < 0.25:
        image = image.filter(ImageFilter.GaussianBlur(rng.uniform(0.3, 1.2)))
    return image


@dataclass
class CopyEvaluation:
    """The figures of a collection without labels (copy recall@1, alignment, uniformity, ...) and the files left out."""

    metrics: dict
    skipped: list[Skipped]


def copy_figures(
    embedder: Embedder, items: Sequence[Item], sample: int = COPY_SAMPLE, seed: int = 0, progress: bool = True
) -> CopyEvaluation:
    """copy recall@1, alignment and uniformity over a seeded sample of the items, and the files left out."""
    rng = np.random.default_rng(seed)
    picked = range(len(items)) if len(items) <= sample else sorted(rng.choice(len(items), sample, replace=False))
    chosen = [items[i] for i in picked]
    originals = embed_items(embedder, chosen, progress=progress)
    if len(originals.items) < 2:
        raise RetrievalError("quality figures without labels need at least two readable images")
    copies = []
    for item in originals.items:
        try:
            copies.append(augmented_copy(load_image(item.path), rng))
        except ImageError:  # read a moment ago; gone since
            copies.append(Image.new("RGB", (32, 32)))
    vectors = np.concatenate([embedder.embed(copies[start : start + 64]) for start in range(0, len(copies), 64)])
    found, _ = nearest_neighbours(vectors, originals.vectors, 1)
    figures = {
        "copy recall@1": float(np.mean(found[:, 0] == np.arange(len(vectors)))),
        "alignment": float(np.mean(np.sum((originals.vectors - vectors) ** 2, axis=1))),
        "uniformity": uniformity(originals.vectors),
        "num_queries": len(vectors),
        "protocol": PROTOCOL,
        "encoder": embedder.fingerprint,
    }
    return CopyEvaluation(figures, originals.skipped)
