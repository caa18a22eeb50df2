"""The embedded icons dataset (see ICONS.md for its provenance and licences), unpacked on first use."""

from __future__ import annotations

import csv
import hashlib
import os
import shutil
import time
import zipfile
from pathlib import Path

from retrieval.errors import RetrievalError

ICONS_ARCHIVE = Path(__file__).with_name("icons.zip")


def cache_dir() -> Path:
    """Returns where unpacked data lives: $RETRIEVAL_CACHE, else $XDG_CACHE_HOME/retrieval, else ~/.cache/retrieval."""
    if "RETRIEVAL_CACHE" in os.environ:
        return Path(os.environ["RETRIEVAL_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")).expanduser() / "retrieval"


def icons(root: Path | None = None) -> Path:
    """Returns the folder holding the icons dataset's train/ and test/ splits, unpacking and verifying it once.

    Every file is checked against the sha256 in MANIFEST.csv; the folder appears only when complete.
    """
    archive_digest = hashlib.sha256(ICONS_ARCHIVE.read_bytes()).hexdigest()[:12]
    target = (root or cache_dir()) / f"icons-{archive_digest}"
    if (target / "MANIFEST.csv").is_file():
        return target
    staging = target.with_name(f".{target.name}.tmp-{time.time_ns()}")
    try:
        with zipfile.ZipFile(ICONS_ARCHIVE) as archive:
            archive.extractall(staging)
        with (staging / "MANIFEST.csv").open(newline="", encoding="utf-8") as handle:
            for row in csv.DictReader(handle):
                if hashlib.sha256((staging / row["path"]).read_bytes()).hexdigest() != row["sha256"]:
                    raise RetrievalError(
                        f"{ICONS_ARCHIVE}: {row['path']} does not match "
                        "MANIFEST.csv; the package is damaged, reinstall it"
                    )
        staging.rename(target)
    except OSError as error:
        if (target / "MANIFEST.csv").is_file():
            return target  # another process unpacked it first
        raise RetrievalError(
            f"cannot unpack the icons dataset into {target.parent} ({error}); set RETRIEVAL_CACHE to a writable folder"
        ) from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
