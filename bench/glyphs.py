"""A labeled collection the benchmarks make on any machine: characters rendered in the fonts it has.

Each character is a class and each font one image of it (64 px, dark on white, its size, place and
slant seeded per font and character), so that a class holds as many images as there are fonts and
an embedding trained on some characters can be scored on others. Fonts are found with fc-list
(falling back to the usual folders); math and symbol fonts are left out.

    python bench/glyphs.py OUT [--chars ABC...]   writes OUT/<char>/<font>.png
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

UPPER = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
LOWER = "abcdefghijklmnopqrstuvwxyz"
DIGITS = "0123456789"
SIZE = 64
LEFT_OUT = ("math", "symbol", "emoji")


def fonts() -> list[Path]:
    """The scalable text fonts of this machine, sorted by path."""
    try:
        listed = subprocess.run(["fc-list", ":", "file"], capture_output=True, text=True, check=True).stdout
        paths = {Path(line.split(":")[0].strip()) for line in listed.splitlines() if line.strip()}
    except (OSError, subprocess.CalledProcessError):
        paths = set(Path("/usr/share/fonts").rglob("*.tt[fc]"))
    kept = sorted(path for path in paths if path.suffix.lower() in (".ttf", ".otf") and path.is_file())
    return [path for path in kept if not any(word in path.name.lower() for word in LEFT_OUT)]


def folder_name(char: str) -> str:
    """A class folder for a character that case-insensitive file systems keep apart from its other case."""
    return f"{char}_upper" if char.isupper() else f"{char}_lower" if char.islower() else char


def render(char: str, font: Path) -> Image.Image:
    """One glyph: the character in the font, its size, offset and slant seeded by both."""
    rng = np.random.default_rng(int.from_bytes(hashlib.sha256(f"{font.name}:{char}".encode()).digest()[:8], "little"))
    face = ImageFont.truetype(str(font), int(rng.integers(34, 48)))
    canvas = Image.new("L", (SIZE * 2, SIZE * 2), 255)
    draw = ImageDraw.Draw(canvas)
    left, top, right, bottom = draw.textbbox((0, 0), char, font=face)
    offset = rng.integers(-4, 5, size=2)
    position = (SIZE - (left + right) / 2 + offset[0], SIZE - (top + bottom) / 2 + offset[1])
    draw.text(position, char, fill=int(rng.integers(0, 60)), font=face)
    turned = canvas.rotate(float(rng.uniform(-8, 8)), resample=Image.BILINEAR, fillcolor=255)
    return turned.crop((SIZE // 2, SIZE // 2, SIZE // 2 + SIZE, SIZE // 2 + SIZE)).convert("RGB")


def write_glyphs(out: Path, chars: str) -> Path:
    """Writes out/<char>/<font>.png for every character and font (kept when already there); returns out."""
    for char in chars:
        folder = out / folder_name(char)
        folder.mkdir(parents=True, exist_ok=True)
        for font in fonts():
            target = folder / f"{font.stem}.png"
            if not target.is_file():
                render(char, font).save(target)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--chars", default=UPPER + LOWER + DIGITS)
    args = parser.parse_args()
    write_glyphs(args.out, args.chars)
    print(f"{args.out}: {len(args.chars)} characters x {len(fonts())} fonts")


if __name__ == "__main__":
    main()
