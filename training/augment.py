"""Training-time augmentation, built from named steps (`retrieval train --augment crop,color,...`).

Each step makes another view of the same concept as cross-style retrieval sees it: other framings
(crop, affine), other colours and tones (color: mild brightness, contrast, saturation and hue
changes; hue: any hue; grayscale; invert), other line weights and detail (blur), occlusion
(erase). No flips: some classes are mirror images of each other. docs/recipe.md measures each.
Self-supervised views are stronger (SimCLR, MoCo v2): strongcrop (30-100 % of the image) and
jitter (brightness, contrast, saturation 0.4, hue 0.1, 80 % of the time), with grey and blur.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from PIL import Image
from torchvision.transforms import v2

from retrieval.errors import RetrievalError, one_of
from retrieval.preprocess import Preprocessing, resize_and_crop

WHITE = (255, 255, 255)  # the background transparent images are composed on (retrieval.data.load_image)


def _pil_step(name: str, size: int) -> v2.Transform:
    if name == "crop":
        return v2.RandomResizedCrop(size, scale=(0.7, 1.0), ratio=(0.9, 1.1), antialias=True)
    if name == "strongcrop":  # SimCLR's and MoCo's crop, its smallest share raised for small images
        return v2.RandomResizedCrop(size, scale=(0.3, 1.0), ratio=(0.75, 1.33), antialias=True)
    if name == "jitter":  # SimCLR's colour distortion
        return v2.RandomApply([v2.ColorJitter(0.4, 0.4, 0.4, 0.1)], p=0.8)
    if name == "color":
        return v2.RandomApply([v2.ColorJitter(0.2, 0.2, 0.2, 0.05)], p=0.5)
    if name == "hue":
        return v2.RandomApply([v2.ColorJitter(hue=0.5)], p=0.5)
    if name == "grayscale":
        return v2.RandomGrayscale(p=0.2)
    if name == "invert":
        return v2.RandomInvert(p=0.2)
    if name == "blur":
        return v2.RandomApply([v2.GaussianBlur(5, sigma=(0.1, 1.5))], p=0.3)
    if name == "affine":
        return v2.RandomAffine(degrees=10, translate=(0.1, 0.1), scale=(0.85, 1.05), fill=WHITE)
    raise AssertionError(name)


AUGMENTATIONS = ("crop", "strongcrop", "color", "jitter", "hue", "grayscale", "invert", "blur", "affine", "erase")
CROPS = ("crop", "strongcrop")
DEFAULT_AUGMENT = "crop,color"
# The two views of self-supervised training (SimCLR and MoCo v2: crop, colour distortion, grey, blur; docs/recipe.md)
SSL_AUGMENT = "strongcrop,jitter,grayscale,blur"


def parse_augment(text: str, option: str = "--augment") -> tuple[str, ...]:
    """The step names of an --augment (or --ssl-augment, named in the errors) value ("none" or an empty string: no
    augmentation)."""
    names = tuple(part.strip() for part in text.split(",") if part.strip() and part.strip() != "none")
    unknown = [name for name in names if name not in AUGMENTATIONS]
    if unknown:
        raise RetrievalError(f"{option}: unknown step {unknown[0]!r}; {one_of(unknown[0], AUGMENTATIONS)}, or none")
    if len(set(names)) != len(names):
        raise RetrievalError(f"{option} {text!r} names a step twice")
    if all(crop in names for crop in CROPS):
        raise RetrievalError(f"{option} {text!r}: take crop or strongcrop, not both")
    return names


def make_augmentation(text: str, preprocessing: Preprocessing) -> Callable[[Image.Image], torch.Tensor]:
    """Returns image -> normalised float32 [3, S, S] tensor: the named steps, in their canonical order.

    The S x S image comes first (a random crop, or without one the evaluation resize and centre
    crop), so that the other Pillow steps work on small images; random erasing runs last, on the
    normalised tensor, erasing to the mean colour.
    """
    names = parse_augment(text)
    size = preprocessing.image_size
    pil_steps = [_pil_step(name, size) for name in AUGMENTATIONS if name in names and name != "erase"]
    steps = v2.Compose(pil_steps) if pil_steps else v2.Identity()
    erase = v2.RandomErasing(p=0.25, scale=(0.02, 0.15), value=0) if "erase" in names else None

    def augment(image: Image.Image) -> torch.Tensor:
        viewed = steps(image if any(crop in names for crop in CROPS) else resize_and_crop(image, size))
        tensor = torch.from_numpy(preprocessing.normalise(viewed))
        return erase(tensor) if erase is not None else tensor

    return augment
