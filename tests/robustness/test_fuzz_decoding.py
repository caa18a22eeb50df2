"""Property-based fuzzing of the image decoding and preprocessing path (hypothesis).

Whatever the bytes, decode_image returns an RGB image or raises our ImageError, within a bounded
time (the hypothesis deadline); whatever image it returns, the evaluation preprocessing and the
training augmentation make float32 arrays of the declared shape with finite values.
HYPOTHESIS_PROFILE=long runs many more examples (bench/robustness.py uses it).
"""

from __future__ import annotations

import io
import os
from datetime import timedelta

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from retrieval.data import decode_image
from retrieval.errors import ImageError
from retrieval.preprocess import Preprocessing
from training.augment import make_augmentation

settings.register_profile("ci", max_examples=150, deadline=timedelta(seconds=5), suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("long", max_examples=5000, deadline=timedelta(seconds=5), suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

SIZE = 48
PREPROCESSING = Preprocessing(SIZE)
AUGMENT = make_augmentation("crop,color,hue,grayscale,invert,blur,affine,erase", PREPROCESSING)
FORMATS = {  # format -> the modes Pillow writes in it
    "PNG": ("1", "L", "LA", "P", "RGB", "RGBA", "I;16", "I"),
    "JPEG": ("L", "RGB", "CMYK"),
    "WEBP": ("RGB", "RGBA"),
    "GIF": ("L", "P"),
    "TIFF": ("1", "L", "LA", "P", "RGB", "RGBA", "CMYK", "I;16", "I", "F"),
    "BMP": ("1", "L", "P", "RGB"),
}


def check_output(image: Image.Image) -> None:
    """The decoded image and everything made from it have the declared types and shapes."""
    assert image.mode == "RGB" and image.width >= 1 and image.height >= 1
    batch = PREPROCESSING([image])
    assert batch.dtype == np.float32 and batch.shape == (1, 3, SIZE, SIZE) and np.isfinite(batch).all()
    view = AUGMENT(image)
    assert view.dtype.is_floating_point and tuple(view.shape) == (3, SIZE, SIZE) and bool(view.isfinite().all())


def decode_or_refuse(data: bytes) -> None:
    try:
        image = decode_image(data, "fuzzed")
    except ImageError as error:
        assert error.reason and "fuzzed" in str(error)
        return
    check_output(image)


@st.composite
def encoded_images(draw: st.DrawFn) -> bytes:
    """A random image of a random mode and size, encoded in a format that holds that mode."""
    format = draw(st.sampled_from(sorted(FORMATS)))
    mode = draw(st.sampled_from(FORMATS[format]))
    width, height = draw(st.integers(1, 300)), draw(st.integers(1, 300))
    seed = draw(st.integers(0, 2**32 - 1))
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    image = Image.fromarray(pixels, "RGB")
    image = image.convert("L").convert(mode) if mode in ("I;16", "I", "F") else image.convert(mode)
    buffer = io.BytesIO()
    options = {"save_all": True, "append_images": [image.copy()]} if format in ("GIF", "WEBP") and draw(st.booleans()) else {}
    image.save(buffer, format=format, **options)
    return buffer.getvalue()


@given(st.binary(max_size=4096))
def test_random_bytes_decode_or_are_refused(data: bytes) -> None:
    decode_or_refuse(data)


@given(encoded_images())
def test_valid_images_of_any_mode_and_size_become_the_declared_arrays(data: bytes) -> None:
    check_output(decode_image(data, "fuzzed"))


@given(encoded_images(), st.data())
def test_damaged_images_decode_or_are_refused(data: bytes, draws: st.DataObject) -> None:
    damaged = bytearray(data[: draws.draw(st.integers(0, len(data)), label="kept bytes")])
    for _ in range(draws.draw(st.integers(0, 8), label="flipped bytes")):
        if damaged:
            position = draws.draw(st.integers(0, len(damaged) - 1))
            damaged[position] ^= draws.draw(st.integers(1, 255))
    decode_or_refuse(bytes(damaged))
