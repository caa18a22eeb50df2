"""Labeled image collections (a folder of label folders, or a CSV) and safe image decoding."""

from __future__ import annotations

import csv
import hashlib
import io
import os
import re
import stat
import warnings
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from retrieval.errors import ImageError, RetrievalError
from retrieval.runs import IMAGE_SUFFIXES, RunDir, holds_index, shell_path, write_json
from retrieval.wording import counted

HEIF_BRANDS = frozenset({b"heic", b"heix", b"heim", b"heis", b"hevc", b"hevx"})  # ISO-BMFF brands of HEIC photos
HEIF_ADVICE = "a HEIC/HEIF photo: install pillow-heif to read it (pip install pillow-heif), or convert it to JPEG"
# Refuse decompression bombs: 64 megapixels is far above any retrieval input size.
MAX_PIXELS = 64_000_000
SPLIT_NAMES = frozenset(
    {"train", "training", "test", "testing", "val", "valid", "validation", "dev", "query", "gallery"}
)
WINDOWS_DRIVE = re.compile(r"[A-Za-z]:[\\/]")  # C:\photos\a.png, D:/x.png
CSV_SEPARATORS = ",;\t"  # a spreadsheet's CSV: commas, semicolons where the comma is the decimal mark, or tabs


@dataclass(frozen=True)
class Item:
    """One image of a collection: an absolute path and its label ("" when unlabeled)."""

    path: Path
    label: str


@dataclass(frozen=True)
class Skipped:
    """A file left out of a job, and why."""

    path: Path
    reason: str


@dataclass
class Collection:
    """The items found under a source, plus what was left out while listing it."""

    source: Path
    items: list[Item]
    skipped: list[Skipped] = field(default_factory=list)

    def class_counts(self) -> Counter[str]:
        return Counter(item.label for item in self.items if item.label)


def as_collection(collection: Collection | str | os.PathLike, use: str = "read") -> Collection:
    """A collection given as itself or as its path (read as load_collection reads it), as the Python entry points
    take it; anything else (a list of files) is refused in one line, not a TypeError from deep inside."""
    if isinstance(collection, Collection):
        return collection
    if isinstance(collection, (str, os.PathLike)):
        return load_collection(collection)
    raise _not_a_path("collection: a Collection or its path", collection, use)


def _not_a_path(what: str, given: object, use: str = "read") -> RetrievalError:
    return RetrievalError(
        f"{what} (a folder, a CSV or a .txt list of images), not a {type(given).__name__}; to {use} a list of "
        "files, write them into a .txt list"
    )


def as_items(items: Sequence[Item | str | Path] | Collection | str | Path) -> list[Item]:
    """What a caller gives to embed as Items: a collection or its path, or a list of Items or of image paths
    (unlabeled); a list of paths failed deep inside with "'str' object has no attribute 'path'"."""
    if isinstance(items, (Collection, str, os.PathLike)):
        return as_collection(items).items
    return [item if isinstance(item, Item) else Item(Path(item).resolve(), "") for item in items]


TABLE_SUFFIXES = (".csv", ".tsv")  # a labels table; its separator (comma, semicolon, tab) is read from its header


def load_collection(source: str | Path) -> Collection:
    """Lists a folder `ROOT/<label>/<image>`, a CSV with columns `path,label`, or a .txt list of paths.

    Paths in a CSV or list are relative to that file. Files directly under a folder root, the files
    of a list, and CSV rows with an empty label (or a CSV without a label column) are unlabeled.
    Files with a non-image suffix are skipped and reported; decoding problems are found later, when
    the image is read.
    """
    if not isinstance(source, (str, os.PathLike)):  # a list of files failed inside pathlib
        raise _not_a_path("source: a collection's path", source)
    source = require_source(source)
    try:
        if source.is_dir():
            collection = _load_folder(source)
        elif source.suffix.lower() == ".txt":
            collection = _load_list(source)
        else:
            collection = _load_csv(source)
    except UnicodeDecodeError as error:  # a spreadsheet's own format, or a CSV saved in another encoding
        raise RetrievalError(
            f"{source}: not UTF-8 text (byte {error.object[error.start]:#04x} at offset {error.start}); "
            "save it as a UTF-8 CSV with columns path,label, or a UTF-8 list of paths"
        ) from None
    if not collection.items:
        if collection.skipped:  # every file it names was refused: say why, not only that none is left
            found = (
                f"no usable images ({len(collection.skipped)} skipped; the first, {first_skipped(collection.skipped)})"
            )
        elif source.is_dir():
            found = f"no images found (looked for {', '.join(sorted(IMAGE_SUFFIXES))})"
        else:
            found = "lists no images" + (
                " (no row below its header)" if source.suffix.lower() in TABLE_SUFFIXES else ""
            )
        raise RetrievalError(f"{source}: {found}; give {COLLECTION_HINT}")
    return collection


COLLECTION_HINT = "an image folder ROOT/<label>/<image>, a CSV with columns path,label or a .txt list of paths"
LABELED_COLLECTION_HINT = (
    "an image folder ROOT/<label>/<image> or a CSV with columns path,label"  # a .txt list has no labels
)


def first_skipped(skipped: Sequence[Skipped]) -> str:
    """ "PATH: REASON" of the first skipped file, to say why a job has nothing left."""
    return f"{skipped[0].path}: {skipped[0].reason}"


def none_readable(source: str | Path, skipped: Sequence[Skipped]) -> RetrievalError:
    """The error for a collection none of whose images could be read: how many, and the first one's reason (every
    file corrupt, or a CSV's paths relative to another folder), where a count of classes or images would mislead."""
    if len(skipped) == 1:
        return RetrievalError(
            f"{source}: its one image could not be read ({first_skipped(skipped)}); replace or remove it, or point at "
            "the right folder"
        )
    return RetrievalError(
        f"{source}: none of its {len(skipped):,} images could be read (the first, {first_skipped(skipped)}); "
        "replace or remove them, or point at the right folder"
    )


def one_level_too_high(source: str | Path, labels: set[str]) -> str:
    """ "; ... give ROOT/<group>" where a folder's only label is a folder of folders (ROOT/<group>/<label>/<image>:
    every image labeled <group>), to end a message about too few classes with; "" otherwise."""
    inner = Path(source) / next(iter(labels)) if len(labels) == 1 else None
    if inner is not None and inner.is_dir() and any(entry.is_dir() for entry in inner.iterdir()):
        return f"; its images are in folders under {inner}: if those are the classes, give {inner}"
    return ""


def require_source(source: str | Path, option: str = "", hint: str = COLLECTION_HINT) -> Path:
    """The path of a collection, or one line saying it is not there (before anything slow is imported); option
    names the command-line option that gave it, hint what to give instead."""
    source = Path(source).expanduser()
    if not source.exists():
        given = option + " " if option else ""
        if str(source).partition(":/")[0].lower() in ("http", "https"):  # a path has lost one slash of the address
            address = str(source).replace(":/", "://", 1)
            raise RetrievalError(f"{given}{address}: a web address; files on this machine are read: download it first")
        if any(mark in source.name for mark in "*?["):  # "photos/*.jpg" in quotes: no file has that name
            raise RetrievalError(
                f"{given}{source}: no such file; a pattern is expanded by the shell when it is not in quotes: write it "
                f"without them, or give {hint}"
            )
        raise RetrievalError(f"{given}{source}: no such file or folder; give {hint}")
    return source


def _load_folder(root: Path) -> Collection:
    items: list[Item] = []
    base = root.absolute()  # skipped files are reported with absolute paths, as every image is
    files, skipped = _walk(base)
    for path in sorted(files):
        if path.name.startswith("."):  # hidden files; hidden folders were not walked
            continue
        if path.suffix.lower() not in IMAGE_SUFFIXES:
            skipped.append(Skipped(path, f"not an image file type ({path.suffix or 'no suffix'})"))
            continue
        problem = file_problem(path)
        if problem:
            skipped.append(Skipped(path, problem))
            continue
        relative = path.relative_to(base)
        label = relative.parts[0] if len(relative.parts) > 1 else ""
        items.append(Item(path.resolve(), label))
    _refuse_split_labels(root, {item.label for item in items})
    return Collection(root.resolve(), items, sorted(skipped, key=lambda entry: entry.path))


def _refuse_split_labels(root: Path, labels: set[str]) -> None:
    """Raises RetrievalError where a folder's labels would be its splits (ROOT/train/<label>/<image>, ROOT/test/...):
    every image labeled train or test, which trains and scores a model of the wrong classes without a word."""
    if "" in labels or not labels or not {label.casefold() for label in labels} <= SPLIT_NAMES:
        return
    splits = sorted(labels, key=lambda label: (not label.casefold().startswith("train"), label))  # train/ first
    named, pair = {label.casefold(): label for label in labels}, ""
    if {"query", "gallery"} <= set(named):
        pair = f" (`retrieval evaluate RUN --query {root / named['query']} --gallery {root / named['gallery']}`)"
    raise RetrievalError(
        f"{root}: its folders {', '.join(f'{label}/' for label in splits)} are splits, not labels (every image would "
        f"be labeled by its split); give one of them, e.g. {root / splits[0]}, whose folders are the labels, or a CSV "
        f"path,label of several{pair}"
    )


def _walk(root: Path) -> tuple[list[Path], list[Skipped]]:
    """Every non-folder entry under root, and the folders not entered, with why: symlinked ones (no loops, nothing
    outside root), run directories (`train photos --run photos/run`: the run's plots are not photos) and indexes; hidden
    folders are not entered either (their files are left out, as hidden files are)."""
    if RunDir(root).holds_run():
        raise RetrievalError(f"{root}: a run directory, not a collection of images; give the folder of images")
    found: list[Path] = []
    unwalked: list[Skipped] = []
    for folder, folders, files in os.walk(root):
        base = Path(folder)
        found.extend(base / name for name in files)
        entered = []
        for name in folders:
            if name.startswith("."):
                continue
            reason = _not_entered(base / name)
            if reason:
                unwalked.append(Skipped(base / name, reason))
            else:
                entered.append(name)
        folders[:] = entered
    return found, unwalked


def _not_entered(folder: Path) -> str | None:
    """Why a folder of a collection is not walked (None: it is)."""
    if folder.is_symlink():
        return "a link to a folder: not followed (it could loop, or lead out of the collection)"
    if RunDir(folder).holds_run():
        return "a run directory (its plots and checkpoints are not images): not read"
    if holds_index(folder):
        return "an index (`retrieval index ... --index` put it here): not read"
    return None


def _name_problem(path: Path) -> str | None:
    """Why path's name cannot be stored or printed (None: it can): not valid UTF-8."""
    try:
        str(path).encode("utf-8")
    except UnicodeEncodeError:
        return "its name is not valid UTF-8; rename it"
    return None


def file_problem(path: Path) -> str | None:
    """Why path cannot be an image of a collection (None: it can): not UTF-8, not a regular file."""
    problem = _name_problem(path)
    if problem:
        return problem
    try:
        if path.resolve(strict=True).is_file():
            return None
    except (OSError, RuntimeError) as error:  # a symlink loop is a RuntimeError in Python 3.11
        return f"cannot be read ({getattr(error, 'strerror', None) or error})"
    return "not a regular file (a folder link, a pipe or a device); only image files are read"


def _csv_columns(csv_path: Path, header: str) -> tuple[str, list[str]]:
    """The separator of a labels CSV and its column names (stripped, in lower case), from its header line: a
    spreadsheet's "Path; Label" is read as path,label. Raises RetrievalError, saying what the header lacks, where
    there is no column path, or where other columns stand beside it but no label (the labels would be dropped)."""
    for separator in CSV_SEPARATORS:
        columns = [name.strip().casefold() for name in next(csv.reader([header], delimiter=separator), [])]
        if "path" in columns:
            break
    else:
        first = (next(csv.reader([header]), None) or [""])[0].strip()
        if not header.strip():
            problem = "it is empty; its first line must be the header path,label, then a row per image"
        elif Path(first).suffix.lower() in IMAGE_SUFFIXES:
            problem = f"its first line is a row ({first}), not a header; add the line path,label above it"
        else:
            problem = f"no column path (its header: {header.strip()}); the header must name path,label"
        raise RetrievalError(f"{csv_path}: {problem} (or path alone: unlabeled images)")
    if "label" not in columns and len([name for name in columns if name]) > 1:
        others = ", ".join(name for name in columns if name and name != "path")
        raise RetrievalError(
            f"{csv_path}: no column label beside path (its other columns: {others}); name the labels' column label, "
            "or keep path alone for unlabeled images"
        )
    return separator, columns


_NOT_A_COLLECTION = "expected an image folder, a .csv file with columns path,label or a .txt list of paths"
_UNPACK = {".zip": "unzip", ".tar": "tar xf", ".tgz": "tar xzf", ".tar.gz": "tar xzf", ".tar.bz2": "tar xjf"}
_ARCHIVES = (*_UNPACK, ".tar.xz", ".tar.zst", ".7z", ".rar")


def _archive_advice(path: Path) -> str | None:
    """What to do with an archive given as a collection (a downloaded dataset, not unpacked yet); None otherwise."""
    name = path.name.lower()
    suffix = next((suffix for suffix in _ARCHIVES if name.endswith(suffix)), None)
    if suffix is None:
        return None
    how = f" (`{_UNPACK[suffix]} {shell_path(path)}`)" if suffix in _UNPACK else ""
    return f"an archive ({suffix}), not a collection; unpack it{how} and give the folder it holds"


def _load_csv(csv_path: Path) -> Collection:
    if csv_path.suffix.lower() in IMAGE_SUFFIXES:
        raise RetrievalError(
            f"{csv_path}: one image, not a collection; give the folder it is in ({csv_path.parent}), or a CSV or "
            ".txt list of images"
        )
    if csv_path.suffix.lower() not in TABLE_SUFFIXES:
        raise RetrievalError(f"{csv_path}: {_archive_advice(csv_path) or _NOT_A_COLLECTION}")
    base = csv_path.resolve().parent
    items: list[Item] = []
    skipped: list[Skipped] = []
    seen: dict[Path, str] = {}  # the label of each image's first row
    with csv_path.open(newline="", encoding="utf-8-sig") as handle:  # -sig: the BOM of Excel's "CSV UTF-8"
        separator, columns = _csv_columns(csv_path, handle.readline())
        reader, read = csv.reader(handle, delimiter=separator), 0
        for fields in reader:
            row = dict(zip(columns, fields))  # a short row lacks its last columns; a blank line is an empty row
            if reader.line_num > read + 1:  # the row took several lines
                _refuse_spanning(csv_path, row, read + 2)  # + 2: the header was read before the reader counted
            read = reader.line_num
            raw = (row.get("path") or "").strip()
            if not raw:
                continue
            path, missing = _listed(base, raw, "listed in the CSV but not found")
            if missing:
                skipped.append(Skipped(path, missing))
                continue
            resolved, label = path.resolve(), (row.get("label") or "").strip()  # one resolve: a call per part
            problem = file_problem(path) or (_listed_again(label, seen[resolved]) if resolved in seen else None)
            if problem:
                skipped.append(Skipped(path, problem))
                continue
            seen[resolved] = label
            items.append(Item(resolved, label))
    return Collection(csv_path.resolve(), items, skipped)


def _refuse_spanning(csv_path: Path, row: dict, line: int) -> None:
    """Raises RetrievalError where a row's path or label runs over several lines: a quote left open (\"cat) takes
    every row after it into one field, and those images would be lost without a word."""
    for column in ("path", "label"):
        value = row.get(column) or ""
        if "\n" in value or "\r" in value:
            first = value.splitlines()[0]
            raise RetrievalError(
                f"{csv_path}, line {line}: its {column} runs over {len(value.splitlines())} lines ({first!r} ...), a "
                'quote (") left open; close it or remove it'
            )


def _listed(base: Path, raw: str, not_found: str) -> tuple[Path, str | None]:
    """The path a CSV or list names (relative to its folder), and why it cannot be read (None: it is there). A path
    written on Windows (photos\\cat\\a.png) is read with / where only that form is there; a Windows drive's (C:\\...)
    is named as one."""
    path = base / raw
    if path.exists() or path.is_symlink():
        return path, None
    if "\\" in raw and (base / raw.replace("\\", "/")).exists():
        return base / raw.replace("\\", "/"), None
    if WINDOWS_DRIVE.match(raw):
        return path, f"{not_found}: a Windows path; list the images by paths on this machine (relative to the list)"
    if Path(raw).exists():  # written from the folder the command runs in: the list would read it only from there
        return path, (
            f"{not_found}: paths are read relative to the list's folder ({base}), and {raw} is relative to the "
            "current folder; write them relative to the list's folder, or in full"
        )
    return path, not_found


def _listed_again(label: str, first: str) -> str:
    """Why a CSV row of an image listed before is skipped: a second row, or a second label (a conflict to resolve)."""
    if label == first:
        return "listed in the CSV more than once (the first row is used)"
    return f"listed in the CSV again with the label {label!r}; the first row's {first!r} is used"


def shared_paths(first: Sequence[Item], second: Sequence[Item]) -> list[Path]:
    """The files both lists of items hold (items' paths are resolved), in first's order: the same images given as two
    collections (audit --against, evaluate --query/--gallery)."""
    theirs = {item.path for item in second}
    return [item.path for item in first if item.path in theirs]


def same_images(first: Sequence[Item], second: Sequence[Item]) -> bool:
    """Whether two lists of items hold the same files, all of them: an audit of one against the other would list
    every image as a leak of itself."""
    return len(shared_paths(first, second)) == len(first) == len(second)


VARIANTS = "labels written alike but for case, spaces, - or _ are different classes"  # what label_variants finds


def label_variants(items: Sequence[Item]) -> list[dict[str, int]]:
    """Labels written alike but for case, spaces, - or _ (Cat and cat, golden-retriever and golden_retriever), each
    group with its images' counts, most images first: they are different classes, which is rarely what was meant."""
    counts = Counter(item.label for item in items if item.label)
    groups: dict[str, dict[str, int]] = {}
    for label, count in sorted(counts.items(), key=lambda entry: (-entry[1], entry[0])):
        groups.setdefault(" ".join(re.split(r"[\s_-]+", label.casefold())).strip(), {})[label] = count
    return [group for group in groups.values() if len(group) > 1]


def describe_variants(groups: Sequence[dict[str, int]], shown: int = 3) -> str:
    """The first groups of label_variants in words: 'Cat' (12 images) and 'cat' (3); ... and N more."""
    words = []
    for group in groups[:shown]:
        (first, count), *rest = group.items()
        named = [f"{first!r} ({counted(count, 'image')})", *(f"{label!r} ({n})" for label, n in rest)]
        words.append(" and ".join(named))
    more = f"; and {len(groups) - shown} more" if len(groups) > shown else ""
    return "; ".join(words) + more


def write_collection_csv(path: Path, items: Sequence[Item]) -> Path:
    """Writes items as a CSV with columns path,label (absolute paths), the form load_collection reads."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["path", "label"])
        writer.writerows([str(item.path), item.label] for item in items)
    return path


def _load_list(list_path: Path) -> Collection:
    base = list_path.resolve().parent
    items: list[Item] = []
    skipped: list[Skipped] = []
    for line in list_path.read_text(encoding="utf-8-sig").splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        path, problem = _listed(base, line.strip(), "listed but not found")
        problem = problem or file_problem(path)
        if problem:
            skipped.append(Skipped(path, problem))
        else:
            items.append(Item(path.resolve(), ""))
    return Collection(list_path.resolve(), items, skipped)


@dataclass(frozen=True)
class FileBytes:
    """A file's bytes and their sha256 (hex): the hash is what indexes and caches know a picture by."""

    data: bytes
    sha256: str


def read_image_bytes(path: Path) -> FileBytes:
    """Returns a file's bytes and their sha256, raising ImageError when it cannot be read.

    One open, non-blocking, then fstat: a pipe or device is refused instead of waited on, with no
    extra path lookups per image (this runs for every image of every epoch).
    """
    problem = _name_problem(Path(path))
    if problem:
        raise ImageError(path, problem)
    try:
        with open(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb") as handle:
            if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
                raise ImageError(path, "not a regular file (a folder, a pipe or a device); only image files are read")
            data = handle.read()
    except IsADirectoryError:
        raise ImageError(path, "a folder, not an image file; give an image file") from None
    except OSError as error:
        raise ImageError(path, f"cannot be read ({error.strerror or error})") from None
    return FileBytes(data, hashlib.sha256(data).hexdigest())


@dataclass(frozen=True)
class Decoded:
    """A decoded image in RGB, and whether its file holds more frames (an animation: the first one is used)."""

    image: Image.Image
    animated: bool


@lru_cache(maxsize=1)
def _heif_opener() -> bool:
    """Registers pillow-heif's HEIC/HEIF opener with Pillow, once, where it is installed (a dependency; an install
    without it says what to install); whether it is."""
    try:
        import pillow_heif
    except ImportError:
        return False
    pillow_heif.register_heif_opener()
    return True


def decode(data: bytes, name: str | Path = "image", min_size: int = 0) -> Decoded:
    """Decodes bytes into an RGB image: EXIF orientation applied, transparency composited over white.

    min_size > 0: a JPEG is decoded at the smallest of libjpeg's DCT scales (1/2, 1/4, 1/8) that keeps both
    sides at least min_size (Pillow's draft): an encoder whose input is small needs no more pixels.
    Raises ImageError for empty, truncated, non-image or oversized (decompression bomb) input.
    """
    if not data:
        raise ImageError(name, "empty file")
    if data[4:8] == b"ftyp" and data[8:12] in HEIF_BRANDS and not _heif_opener():  # an iPhone's photos, for one
        raise ImageError(name, HEIF_ADVICE)
    try:
        with warnings.catch_warnings():
            # Pillow's notes on damaged metadata: the image is used or refused anyway
            warnings.simplefilter("ignore", UserWarning)
            # Pillow warns from 89 MP: the limit below refuses such images with their size in the message
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            width, height = image.size
            if width * height > MAX_PIXELS:
                raise ImageError(
                    name, f"{width}x{height} pixels is over the limit of {MAX_PIXELS:,}; downscale it first"
                )
            animated = bool(getattr(image, "is_animated", False))
            if min_size > 0 and image.format == "JPEG":
                image.draft(None, (min_size, min_size))
            image.load()
            ImageOps.exif_transpose(image, in_place=True)
            return Decoded(_to_rgb(image), animated)
    except ImageError:
        raise
    except Image.DecompressionBombError:
        limit = f"{2 * Image.MAX_IMAGE_PIXELS:,}" if Image.MAX_IMAGE_PIXELS else "Pillow's limit"
        raise ImageError(name, f"over {limit} pixels (a decompression bomb guard); downscale it first") from None
    except UnidentifiedImageError:
        raise ImageError(name, "not a readable image (not a format Pillow recognises)") from None
    except (OSError, SyntaxError, ValueError, TypeError, EOFError) as error:
        raise ImageError(name, f"not a readable image ({error})") from None


def decode_image(data: bytes, name: str | Path = "image", min_size: int = 0) -> Image.Image:
    """Decodes bytes into an RGB image (see decode)."""
    return decode(data, name, min_size).image


def load_image(path: str | Path, min_size: int = 0) -> Image.Image:
    """Reads and decodes one image file into RGB (see decode_image; min_size: a JPEG's reduced-scale decoding)."""
    return decode_image(read_image_bytes(Path(path)).data, path, min_size)


def _to_rgb(image: Image.Image) -> Image.Image:
    if image.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I", "F"):
        array = np.asarray(image, dtype=np.float64)
        scale = 65535.0 if image.mode.startswith("I;16") else max(float(array.max()), 1.0)
        if image.mode == "F" and array.max() <= 1.0:
            scale = 1.0
        image = Image.fromarray(np.clip(array / scale * 255.0, 0, 255).astype(np.uint8), "L")
    if image.mode == "P" and "transparency" in image.info:
        image = image.convert("RGBA")
    if image.mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image if image.mode == "RGB" else image.convert("RGB")


def write_skip_report(path: Path, skipped: Sequence[Skipped]) -> None:
    """Writes the skipped files (absolute paths) and their reasons as JSON (an empty list when nothing was skipped)."""
    write_json(path, [{"path": str(Path(s.path).absolute()), "reason": s.reason} for s in skipped])


def split_by_class(items: Sequence[Item], fraction: float, seed: int = 0) -> tuple[list[Item], list[Item]]:
    """Splits labeled items class-disjointly: (the rest, a seeded random fraction of the classes)."""
    if not 0 <= fraction < 1:
        raise RetrievalError(f"the fraction of classes to hold out must be in [0, 1), got {fraction}")
    classes = sorted({item.label for item in items})
    count = round(len(classes) * fraction)
    held = set(np.random.default_rng(seed).permutation(classes)[:count].tolist()) if count else set()
    return [item for item in items if item.label not in held], [item for item in items if item.label in held]
