"""The index directory on disk: its writer lock, the atomic swap of a new version, SQLite and raw vectors.

A save writes a complete temporary sibling directory, fsyncs it and renames it into place, so a
crash leaves the old index or the new one. Writers go one at a time: `writer_lock` (an flock on the
sibling file `.NAME.lock`) is held by `retrieval index` and by the app's add/remove around their
read-modify-write, across processes; readers need no lock.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import sqlite3
import time
from collections.abc import Iterator
from contextlib import closing, contextmanager
from pathlib import Path

import numpy as np

from index.types import FORMAT_VERSION, INDEX_FILES, MANIFEST, RAW, Manifest, index_command, rebuild_advice
from retrieval.errors import RetrievalError
from retrieval.runs import RunDir, folder_lock, fsync_dir, holds_images, read_json, shell_path, writable_folder


@contextmanager
def writer_lock(directory: Path, timeout: float = 600.0) -> Iterator[None]:
    """Holds the index's writer lock (one writer at a time, across processes), waiting up to timeout s."""
    directory = writable_folder(directory, "index", make=False)  # a file there is refused, not replaced
    _refuse_foreign_folder(directory)
    busy = (
        f"{directory}: another writer (a `retrieval index` job, or an app started with --allow-write) "
        f"has held .{directory.name}.lock for over {timeout:.0f} s; try again when it has finished"
    )
    with folder_lock(directory, "index", busy, timeout):
        yield


def _refuse_foreign_folder(directory: Path) -> None:
    """A save replaces the index's folder as a whole: a folder of other files (a gallery, a home folder) would be
    deleted with them, and the folder this process works in would be moved away from under it; both are refused."""
    folder, here = os.path.abspath(directory), os.getcwd()
    if os.path.commonpath([folder, here]) == folder:
        raise RetrievalError(
            f"index {directory}: the folder you are in (or one above it); an index replaces its folder whole: "
            "give a folder of its own, e.g. index"
        )
    if not directory.is_dir() or (directory / MANIFEST).is_file():
        return  # a new folder, or an index (a damaged one without its manifest holds only INDEX_FILES)
    if RunDir(directory).config.is_file():
        raise RetrievalError(f"index {directory}: a run, not an index's folder; its index is {RunDir(directory).index}")
    other = sorted(path.name for path in directory.iterdir() if path.name not in INDEX_FILES)
    if other:
        raise RetrievalError(
            f"index {directory}: holds files that are not an index's ({', '.join(other[:3])}"
            f"{', ...' if len(other) > 3 else ''}), which building it there would delete; give a new or empty folder"
        )


def _other_encoder_advice(directory: Path, built_with: str, given: str) -> str:
    """What to do about an index another model built: where it is RUN/index, RUN's own model built it and the model
    given is none of RUN's, another run's model is in use (use RUN, or index the images with the model given into a
    folder of its own); else the other precision of the run's model, or a rebuild."""
    try:
        precisions = RunDir(directory.parent).fingerprints() if directory.name == "index" else {}
    except RetrievalError:  # no card, or a damaged one: nothing to say about whose index this is
        precisions = {}
    by_digest = {digest: precision for precision, digest in precisions.items()}
    if built_with in by_digest and given not in by_digest:
        return (
            f"it is {directory.parent}'s own index, built by that run's model: use {directory.parent}, or index the "
            "images with this model into a folder of its own (`retrieval index RUN IMAGES --index NEW`)"
        )
    if built_with in by_digest:
        return f"use the model it was built with (--model {by_digest[built_with]}), or {rebuild_advice(directory)}"
    if given in by_digest:  # the run's models are all newer than its index: it said to pick one of them
        return f"no model of {directory.parent} built it (exported again since?): {rebuild_advice(directory)}"
    return f"use the model it was built with (--model float32 or int8), or {rebuild_advice(directory)}"


def staging_directory(directory: Path) -> Path:
    """A new, empty temporary sibling of directory, after removing those a killed writer left behind."""
    for leftover in [
        *directory.parent.glob(f".{directory.name}.tmp-*"),
        *directory.parent.glob(f".{directory.name}.old-*"),
    ]:
        shutil.rmtree(leftover, ignore_errors=True)  # writers go one at a time: nobody else is using them
    staging = directory.with_name(f".{directory.name}.tmp-{time.time_ns()}")
    staging.mkdir(parents=True)
    return staging


def _exchange(first: Path, second: Path) -> bool:
    """Swaps two paths in one step (Linux renameat2 RENAME_EXCHANGE); False where the system cannot."""
    function = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if function is None:
        return False
    at_cwd, exchange = -100, 2
    return function(at_cwd, bytes(first), at_cwd, bytes(second), exchange) == 0


def swap_into_place(staging: Path, directory: Path) -> None:
    """Puts staging at directory and removes the previous index: one atomic exchange where Linux offers it (a
    writer killed at any moment leaves one whole version at directory), else two renames."""
    if directory.exists() and _exchange(staging, directory):
        fsync_dir(directory.parent)
        shutil.rmtree(staging, ignore_errors=True)  # now the previous version
        return
    previous = directory.with_name(f".{directory.name}.old-{time.time_ns()}")
    if directory.exists():
        directory.rename(previous)
    staging.rename(directory)
    fsync_dir(directory.parent)
    shutil.rmtree(previous, ignore_errors=True)


def read_only(path: Path) -> closing[sqlite3.Connection]:
    """A read-only SQLite connection to the items file (usable from the server's threads)."""
    return closing(sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, check_same_thread=False))


def create_items(path: Path) -> None:
    """Creates an empty items table (id, path, label, sha256, added_at)."""
    with closing(sqlite3.connect(path)) as connection:
        connection.execute(
            "CREATE TABLE items (id INTEGER PRIMARY KEY, path TEXT NOT NULL, label TEXT NOT NULL, "
            "sha256 TEXT NOT NULL, added_at TEXT NOT NULL)"
        )
        connection.commit()


def open_raw(directory: Path, rows: int, dim: int) -> np.ndarray:
    """The exact vectors file of a compressed index, memory-mapped read-only, checked for its size."""
    path = directory / RAW
    expected = rows * dim * 4
    if not path.is_file() or path.stat().st_size != expected:
        found = f"{path.stat().st_size:,} bytes" if path.is_file() else "missing"
        raise RetrievalError(
            f"{path}: {found}, expected {expected:,} bytes ({rows:,} vectors of {dim} floats); "
            f"{rebuild_advice(directory)}"
        )
    return np.memmap(path, np.float32, "r", shape=(rows, dim)) if rows else np.zeros((0, dim), np.float32)


def _folder_advice(parent: Path) -> str:
    """Where the index is when a file was named in its place: the file's own folder, its run's, or neither."""
    if (parent / MANIFEST).is_file():
        return f"give its folder, {parent}"
    if (RunDir(parent).index / MANIFEST).is_file():
        return f"its run's index is {RunDir(parent).index}"
    return "give the folder `retrieval index` wrote (a run's index/, or the one its --index named)"


MANIFEST_KEYS = {"format_version", "dim", "count", "next_id", "encoder_sha256", "created"}


def read_manifest(directory: Path, encoder_sha256: str | None = None, dim: int | None = None) -> Manifest:
    """The manifest of an index directory, refused when incomplete, of another format, or of another encoder."""
    if directory.is_file():
        raise RetrievalError(f"{directory}: a file, not an index's folder; {_folder_advice(directory.parent)}")
    if not (directory / MANIFEST).is_file() and (RunDir(directory).index / MANIFEST).is_file():
        raise RetrievalError(f"{directory}: a run, not an index; its index is {RunDir(directory).index}")
    if not (directory / MANIFEST).is_file() and holds_images(directory):  # it said to build an index among them
        raise RetrievalError(
            f"{directory}: a folder of images, not an index; index them with "
            f"`retrieval index RUN {shell_path(directory)}`"
        )
    if not (directory / MANIFEST).is_file():
        raise RetrievalError(f"{directory}: not an index (no {MANIFEST}); build one with `{index_command(directory)}`")
    values = read_json(directory / MANIFEST, remedy=rebuild_advice(directory))
    missing = MANIFEST_KEYS - set(values)
    if missing:
        raise RetrievalError(f"{directory / MANIFEST}: lacks {', '.join(sorted(missing))}; {rebuild_advice(directory)}")
    if values["format_version"] != FORMAT_VERSION:
        raise RetrievalError(
            f"{directory}: index format {values['format_version']} is not {FORMAT_VERSION}; {rebuild_advice(directory)}"
        )
    manifest = Manifest.from_dict(values, directory / MANIFEST)
    if encoder_sha256 is not None and manifest.encoder_sha256 != encoder_sha256:
        raise RetrievalError(
            f"{directory}: built with encoder {manifest.encoder_sha256[:12]}…, not with this model "
            f"({encoder_sha256[:12]}…); {_other_encoder_advice(directory, manifest.encoder_sha256, encoder_sha256)}"
        )
    if dim is not None and manifest.dim != dim:
        raise RetrievalError(
            f"{directory}: holds {manifest.dim}-dimensional vectors, the encoder makes {dim}; "
            f"{rebuild_advice(directory)}"
        )
    return manifest
