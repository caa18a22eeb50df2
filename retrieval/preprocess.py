"""The evaluation-time image transform, in numpy and Pillow, shared by training, export and inference."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from retrieval.errors import RetrievalError

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class Preprocessing:
    """How an RGB image becomes the encoder's input: resize the shorter side, centre-crop, normalise."""

    image_size: int = 64
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    resize: str = "shorter-side-bilinear-then-center-crop"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> Preprocessing:
        return cls(
            image_size=int(values["image_size"]),
            mean=tuple(float(v) for v in values["mean"]),
            std=tuple(float(v) for v in values["std"]),
            resize=str(values.get("resize", cls.resize)),
        )

    def __call__(self, images: Sequence[Image.Image]) -> np.ndarray:
        """Returns float32 [N, 3, S, S] normalised input for RGB images ([0, 3, S, S] for none)."""
        if not require_images(images):
            return np.zeros((0, 3, self.image_size, self.image_size), np.float32)
        return self.normalise_pixels(np.stack([self.pixels(image) for image in images]))

    def pixels(self, image: Image.Image) -> np.ndarray:
        """Returns uint8 [S, S, 3]: the image resized and cropped as the encoder sees it, before normalising
        (a quarter of the float32 input's memory, for images kept between epochs)."""
        image = resize_and_crop(image, self.image_size)
        return np.asarray(image if image.mode == "RGB" else image.convert("RGB"), dtype=np.uint8)

    def normalise(self, image: Image.Image) -> np.ndarray:
        """Returns float32 [3, H, W]: pixels scaled to [0, 1], minus mean, over std."""
        return self.normalise_pixels(np.asarray(image.convert("RGB"))[None])[0]

    def normalise_pixels(self, pixels: np.ndarray) -> np.ndarray:
        """Returns float32 [N, 3, H, W] of uint8 pixels [N, H, W, 3]: scaled to [0, 1], minus mean, over std.

        Channels go first while the pixels are still bytes, and the float operations run in place on contiguous
        rows: the same values as dividing, subtracting and dividing a float copy, about 20 times faster.
        """
        array = np.ascontiguousarray(np.asarray(pixels).transpose(0, 3, 1, 2)).astype(np.float32)
        array /= 255.0
        array -= np.asarray(self.mean, np.float32).reshape(1, 3, 1, 1)
        array /= np.asarray(self.std, np.float32).reshape(1, 3, 1, 1)
        return array


def resize_and_crop(image: Image.Image, size: int) -> Image.Image:
    """Returns a size x size image: the shorter side resized to size (bilinear), then centre-cropped.

    Sizes and offsets are rounded as torchvision's Resize(size) + CenterCrop(size) round them, so that
    training-time evaluation and this torch-free path give the same pixels.
    """
    width, height = image.size
    if (width, height) == (size, size):
        return image
    if width <= height:
        new_size = (size, int(size * height / width))
    else:
        new_size = (int(size * width / height), size)
    image = image.resize(new_size, Image.Resampling.BILINEAR)
    left = int(round((new_size[0] - size) / 2.0))
    top = int(round((new_size[1] - size) / 2.0))
    return image.crop((left, top, left + size, top + size))


def require_images(images: Sequence[Image.Image]) -> Sequence[Image.Image]:
    """The images, refusing what an embedder cannot take: one image not in a list, or a path (files are read by
    retrieval.embedders.embed_items, which skips and reports those that cannot be read)."""
    if isinstance(images, (str, Path)):
        raise RetrievalError(
            f"images: {str(images)!r} is a path, not a list of PIL images; embed files with "
            "retrieval.embed_items(embedder, [path])"
        )
    if isinstance(images, Image.Image):
        raise RetrievalError("images: a list of images, not one image; write [image]")
    wrong = next((image for image in images if not isinstance(image, Image.Image)), None)
    if wrong is not None:
        raise RetrievalError(
            f"images: {wrong!r} is a {type(wrong).__name__}, not a PIL image; open it with PIL.Image.open, or embed "
            "files with retrieval.embed_items(embedder, paths)"
        )
    return images
