"""The adversarial corpus, generated on the fly (nothing binary is committed).

write_corpus(folder) fills folder/<label>/ with files that every entry point must survive: the
good ones (odd modes, sizes and containers that must be read correctly) and the bad ones (which
must be skipped with a reason, or answered with a message), and says which is which.
"""

from __future__ import annotations

import io
import os
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image

LABEL = "adversarial"


@dataclass
class Corpus:
    """Where the corpus is, and what each file is expected to do."""

    folder: Path  # folder/<LABEL>/ holds the files
    good: dict[str, Path] = field(default_factory=dict)  # must be read (and indexed, searched, trained on)
    bad: dict[str, Path] = field(default_factory=dict)  # must be skipped or refused with a reason

    @property
    def all(self) -> dict[str, Path]:
        return {**self.good, **self.bad}


def icon(size: int = 48, seed: int = 0) -> Image.Image:
    """A small RGB image with some structure (random blocks)."""
    blocks = np.random.default_rng(seed).integers(0, 256, (4, 4, 3), dtype=np.uint8)
    return Image.fromarray(blocks).resize((size, size), Image.Resampling.NEAREST)


def encoded(image: Image.Image, format: str, **options: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=format, **options)
    return buffer.getvalue()


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def bomb_png(side: int = 30_000) -> bytes:
    """A valid 1-bit side x side PNG of zeros: a few hundred kilobytes that decode to side² pixels."""
    row = b"\x00" * (1 + (side + 7) // 8)  # filter byte + packed bits
    compressor = zlib.compressobj(9)
    body = b"".join(compressor.compress(row) for _ in range(side)) + compressor.flush()
    header = struct.pack(">IIBBBBB", side, side, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", header) + png_chunk(b"IDAT", body) + png_chunk(b"IEND", b"")


def lying_png() -> bytes:
    """A PNG whose header says 400x400 but whose pixel data is that of a 20x20 image."""
    small = encoded(icon(20), "PNG")
    header = struct.pack(">IIBBBBB", 400, 400, 8, 2, 0, 0, 0)
    return small[:8] + png_chunk(b"IHDR", header) + small[8 + 25 :]


def exif_rotated() -> bytes:
    """A 60x30 JPEG whose EXIF orientation (6) says to turn it a quarter: it is read as 30x60."""
    exif = Image.Exif()
    exif[0x0112] = 6
    return encoded(icon(30).resize((60, 30)), "JPEG", exif=exif.tobytes())


def write_corpus(folder: Path) -> Corpus:
    """Writes the adversarial files into folder/<LABEL>/ and returns what each should do."""
    target = folder / LABEL
    target.mkdir(parents=True, exist_ok=True)
    corpus = Corpus(folder)
    base = icon(64, seed=7)
    png = encoded(base, "PNG")
    jpeg = encoded(base, "JPEG", quality=90)
    webp = encoded(base, "WEBP")
    frames = [icon(40, seed) for seed in range(3)]

    def put(kind: str, name: str | bytes, data: bytes, good: bool) -> Path:
        if isinstance(name, bytes):  # a name that is not valid UTF-8
            raw = os.fsencode(target) + b"/" + name
            with open(raw, "wb") as handle:
                handle.write(data)
            path = Path(os.fsdecode(raw))
        else:
            path = target / name
            path.write_bytes(data)
        (corpus.good if good else corpus.bad)[kind] = path
        return path

    # good: read, converted to RGB, searched and indexed
    put("1x1 image", "one-pixel.png", encoded(Image.new("RGB", (1, 1), (10, 200, 30)), "PNG"), True)
    put("CMYK JPEG", "cmyk.jpg", encoded(base.convert("CMYK"), "JPEG"), True)
    put("16-bit TIFF", "sixteen-bit.tif", encoded(Image.fromarray((np.asarray(base.convert("L"), np.uint16) * 257).astype(np.uint16)), "TIFF"), True)
    put("float TIFF", "float.tiff", encoded(Image.fromarray(np.asarray(base.convert("L"), np.float32) / 255.0, "F"), "TIFF"), True)
    palette = base.convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    put("palette PNG with transparency", "palette.png", encoded(palette, "PNG", transparency=0), True)
    put("animated GIF", "animated.gif", encoded(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=100, loop=0), True)
    put("animated WebP", "animated.webp", encoded(frames[0], "WEBP", save_all=True, append_images=frames[1:], duration=100), True)
    put("EXIF-rotated JPEG", "rotated.jpg", exif_rotated(), True)
    put("very long file name", "a" * 240 + ".png", encoded(icon(64, seed=8), "PNG"), True)
    put("name with commas and quotes", 'a, "quoted" name.png', encoded(icon(64, seed=9), "PNG"), True)
    unreadable = put("unreadable permissions", "no-permission.png", encoded(icon(64, seed=10), "PNG"), True)
    os.chmod(unreadable, 0)
    if not os.access(unreadable, os.R_OK):  # root reads it anyway
        corpus.bad["unreadable permissions"] = corpus.good.pop("unreadable permissions")

    # bad: skipped with a reason, or refused with a message
    put("zero-byte file", "empty.png", b"", False)
    put("truncated JPEG", "truncated.jpg", jpeg[: len(jpeg) // 2], False)
    put("truncated PNG", "truncated.png", png[: len(png) // 2], False)
    put("truncated WebP", "truncated.webp", webp[: len(webp) // 2], False)
    put("text file named .jpg", "notes.jpg", b"this is a text file, not an image\n" * 20, False)
    put("30,000 x 30,000 PNG (decompression bomb)", "bomb.png", bomb_png(), False)
    put("PNG whose header lies about its size", "lying.png", lying_png(), False)
    put("non-UTF-8 file name", b"\xff\xfe-latin1-\xe9.png", png, False)
    loop = target / "loop.jpg"
    loop.symlink_to(loop.name)  # a symlink to itself
    corpus.bad["symlink loop (file)"] = loop
    os.mkfifo(target / "pipe.png")  # a reader that opened it would wait for a writer forever
    corpus.bad["named pipe with an image name"] = target / "pipe.png"
    (target / "subfolder").mkdir()
    (target / "subfolder" / "up").symlink_to("..", target_is_directory=True)  # a folder loop: walking must not recurse forever
    corpus.bad["symlink loop (folder)"] = target / "subfolder" / "up"
    return corpus
