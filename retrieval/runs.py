"""The run-directory layout (see ARCHITECTURE.md) and atomic writes of the files in it."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import shlex
import sqlite3
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

from retrieval.errors import RetrievalError
from retrieval.wording import counted

IMAGE_SUFFIXES = frozenset(  # the files a collection reads as images (retrieval.data); a run is told apart from them
    {".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff", ".avif", ".heic", ".heif"}
)
# an index's files (index/types.py takes them from here; the core knows them to leave indexes out of collections)
INDEX_MANIFEST, INDEX_ITEMS = "manifest.json", "items.sqlite"


def first_image(folder: Path, subfolders: int = 100) -> Path | None:
    """An image file in folder or in one of its first subfolders (ROOT/<label>/<image>) that is not a run, or None:
    whether a folder holds a collection, found without listing a large one whole."""
    try:
        with os.scandir(folder) as entries:
            inner = []
            for entry in entries:
                if entry.is_dir(follow_symlinks=False) and not entry.name.startswith("."):  # hidden: not a label
                    inner.append(entry.path)
                elif _visible_image(entry.name):
                    return Path(entry.path)
        for path in inner[:subfolders]:
            if RunDir(Path(path)).holds_run():  # a run's plots are not a collection's images
                continue
            with os.scandir(path) as entries:
                found = next((e.path for e in entries if _visible_image(e.name)), None)
            if found is not None:
                return Path(found)
    except OSError:  # no folder there (yet), or one this user cannot list: nothing to say of it
        return None
    return None


def _visible_image(name: str) -> bool:
    """Whether a file name is one a collection reads as an image (an image suffix, not hidden)."""
    return not name.startswith(".") and Path(name).suffix.lower() in IMAGE_SUFFIXES


def holds_index(folder: Path) -> bool:
    """Whether folder holds an index (its manifest and its items' database)."""
    return (folder / INDEX_MANIFEST).is_file() and (folder / INDEX_ITEMS).is_file()


@dataclass(frozen=True)
class RunDir:
    """Paths of everything one model produced."""

    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))  # RunDir("runs/photos"), as a notebook writes it

    def refuse_foreign_folder(self) -> None:
        """Refuses to train in an index's folder (`--run runs/photos/index`: its skip report was replaced, checkpoints
        written among its files) and in a folder whose config.json is not a run's (`--run .` in a project): training
        would replace it. A run's names its data and loss. A file there, or a folder that cannot be made, is said as
        the command line says it (from Python it was "FileExistsError: [Errno 17] File exists")."""
        writable_folder(self.root, "--run", make=False)
        if holds_index(self.root):
            raise RetrievalError(
                f"--run {self.root}: an index's folder ({INDEX_MANIFEST}, {INDEX_ITEMS}), and training would write "
                "among its files; give the run a folder of its own, e.g. runs/photos"
            )
        image = None if self.holds_run() else first_image(self.root)
        if image is not None:  # `retrieval demo --run photos`: the run's files went among the user's images
            other = Path("runs", self.root.name)
            other = other.with_name(f"{other.name}-run") if other.absolute() == self.root.absolute() else other
            raise RetrievalError(
                f"--run {self.root}: a folder of images ({image.relative_to(self.root)}, ...), and training would "
                f"write among them; give the run a folder of its own, e.g. {shell_path(other)}"
            )
        parent = RunDir(self.root.parent)
        own = {parent.checkpoints, parent.metric_sets, parent.plots, parent.index}
        if self.root in own and parent.holds_run():  # its config.json and checkpoints/ went among the run's files
            raise RetrievalError(
                f"--run {self.root}: the {self.root.name} folder of the run {parent.root}, and training would write "
                "among its files; give the run a folder of its own, e.g. runs/photos"
            )
        if not self.config.is_file():
            return
        try:
            values = json.loads(self.config.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError):
            values = None
        if not (isinstance(values, dict) and {"data", "loss"} <= values.keys()):
            raise RetrievalError(
                f"--run {self.root}: its config.json is not a run's, and training would replace it; give the run a "
                "folder of its own, e.g. runs/photos"
            )

    def refuse_trained(self) -> None:
        """Refuses to start a training over a run that holds one (a trainer state or a checkpoint): it is continued
        (--resume) or started over (--overwrite), never silently, or its model, index and metrics would stay beside
        checkpoints of another training. A run killed before its first save has nothing to lose."""
        if not (self.trainer_state.is_file() or self.last_checkpoint.is_file()):
            return
        trained = len(self.train_log.read_text(encoding="utf-8").splitlines()) if self.train_log.is_file() else 0
        raise RetrievalError(
            f"{self.root} already holds a run ({counted(trained, 'epoch')} trained); continue it with "
            f"`retrieval train --run {shell_path(self.root)} --resume`, or start over with --overwrite (from Python: "
            "train(..., resume=True) or overwrite=True)"
        )

    @classmethod
    def of(cls, run: RunDir | str | os.PathLike) -> RunDir:
        """A run given as a RunDir or as its directory's path ("runs/photos"), as the Python entry points take it."""
        return run if isinstance(run, RunDir) else cls(run)  # type: ignore[arg-type]  # made a Path by __post_init__

    @property
    def config(self) -> Path:
        return self.root / "config.json"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def last_checkpoint(self) -> Path:
        return self.checkpoints / "last.safetensors"

    @property
    def trainer_state(self) -> Path:
        return self.checkpoints / "trainer.safetensors"

    @property
    def best_checkpoint(self) -> Path:
        return self.checkpoints / "best.safetensors"

    @property
    def train_log(self) -> Path:
        return self.root / "train_log.jsonl"

    @property
    def loss_plot(self) -> Path:
        return self.root / "train_loss.png"

    @property
    def model(self) -> Path:
        return self.root / "model.onnx"

    @property
    def int8_model(self) -> Path:
        return self.root / "model.int8.onnx"

    @property
    def model_card(self) -> Path:
        return self.root / "model.json"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.json"

    @property
    def metric_sets(self) -> Path:
        """One metrics file per evaluated source and protocol (metrics.json is a copy of the latest)."""
        return self.root / "metrics"

    def save_metrics(self, name: str, metrics: dict) -> Path:
        """Writes metrics as RUN/metrics/<name>.json and as the latest, RUN/metrics.json; returns the first."""
        path = self.metric_sets / f"{metric_set_name(name)}.json"
        write_json(path, metrics)
        write_json(self.metrics, metrics)
        return path

    def saved_metrics(self) -> dict[str, dict]:
        """Every evaluated set's metrics by name, the latest first ("latest" alone for a run evaluated before sets)."""
        paths = sorted(self.metric_sets.glob("*.json"), key=lambda path: path.stat().st_mtime_ns, reverse=True)
        sets = {path.stem: read_json(path) for path in paths}
        if not sets and self.metrics.is_file():
            sets["latest"] = read_json(self.metrics)
        return sets

    @property
    def plots(self) -> Path:
        return self.root / "plots"

    @property
    def index(self) -> Path:
        return self.root / "index"

    def fingerprints(self) -> dict[str, str]:
        """The sha256 of each exported model its card names, by precision (float32, and int8 where exported)."""
        card = read_json(self.model_card)
        card = card if isinstance(card, dict) else {}
        int8 = card.get("int8") if isinstance(card.get("int8"), dict) else {}
        found = {"float32": card.get("sha256"), "int8": int8.get("sha256")}
        return {precision: str(digest) for precision, digest in found.items() if digest}

    def holds_run(self) -> bool:
        """Whether the folder holds a run (its training log, a checkpoint or an exported model): its plots and
        pictures are not images of a collection, wherever the run was put."""
        return (
            self.train_log.is_file()
            or self.last_checkpoint.is_file()
            or (self.model.is_file() and self.model_card.is_file())
        )

    def _require_run_folder(self) -> None:
        """Says so where the run given is a file (a CSV, an image), an index's folder or a folder of images: what
        to give instead, not to export or train "there" (`serve photos` said to run `retrieval export photos`); and
        to train one where the folder is not there."""
        if self.root.exists() and not self.root.is_dir():
            raise RetrievalError(
                f"{self.root}: a file, not a run directory; give the folder `retrieval train DATA --run RUN` made"
            )
        if self.holds_run() or self.config.is_file():
            return
        if holds_index(self.root):
            owner = self.root.parent if RunDir(self.root.parent).holds_run() else "the run directory that made it"
            raise RetrievalError(f"{self.root}: an index, not a run; give its run ({owner})")
        if holds_images(self.root):
            raise RetrievalError(
                f"{self.root}: a folder of images, not a run; give the run directory, or make one with "
                f"`retrieval train {shell_path(self.root)} --run runs/NAME`"
            )
        if not self.root.is_dir():
            raise RetrievalError(
                f"{self.root}: no such run directory; "
                f"train one with `retrieval train DATA --run {shell_path(self.root)}`"
            )

    @property
    def trained_checkpoint(self) -> Path | None:
        """The checkpoint an export reads: the best (when training validated), else the last; None before any."""
        return next((path for path in (self.best_checkpoint, self.last_checkpoint) if path.is_file()), None)

    def require_checkpoint(self) -> Path:
        """Returns the best checkpoint (when training validated) or the last one, or says to train first."""
        self._require_run_folder()
        checkpoint = self.trained_checkpoint
        if checkpoint is None:
            raise RetrievalError(
                f"{self.root}: no trained checkpoint ({self.last_checkpoint.name}); "
                f"run `retrieval train DATA --run {shell_path(self.root)}` first"
            )
        return checkpoint

    def require_model(self) -> Path:
        """Returns the exported ONNX model, or says to export first."""
        self._require_run_folder()
        if not self.model.is_file() or not self.model_card.is_file():
            trained = self.trained_checkpoint is not None
            step = "export" if trained else "train DATA --run"  # a folder that is no run must be trained first
            raise RetrievalError(
                f"{self.root}: no exported model (model.onnx + model.json){'' if trained else ' and no checkpoint'}; "
                f"run `retrieval {step} {shell_path(self.root)}` first"
            )
        return self.model


def holds_images(folder: Path, looked_at: int = 200) -> bool:
    """Whether folder or one of its folders holds image files (the first entries of each looked at)."""
    if not folder.is_dir():
        return False
    entries = list(islice(folder.iterdir(), looked_at))
    inside = [entry for part in entries if part.is_dir() for entry in islice(part.iterdir(), looked_at)]
    return any(entry.suffix.lower() in IMAGE_SUFFIXES and entry.is_file() for entry in entries + inside)


def shell_path(path: Path | str) -> str:
    """path as a command to copy would hold it: quoted where it has spaces or characters a shell reads."""
    return shlex.quote(str(path))


def metric_set_name(text: str) -> str:
    """A name for an evaluated set that is safe as a file name: letters, digits, dot, dash and underscore."""
    return re.sub(r"[^\w.-]+", "-", text).strip(".-") or "set"


_FILE_SUFFIXES = frozenset({".csv", ".tsv", ".json", ".jsonl", ".txt", ".png", ".html"})  # a folder is not named so


def writable_folder(path: Path, what: str, make: bool = True) -> Path:
    """path as a folder to write in, or one line naming it and why it cannot be one (a file is there; no folder
    can be made there). make: made now, with its parents; else only checked (its nearest existing parent is a
    folder this process may write in), so that a job refused later leaves nothing behind."""
    path = Path(path).expanduser()
    if path.exists() and not path.is_dir():
        raise RetrievalError(f"{what} {path}: a file is there, not a folder; give a folder (a new one is made)")
    if not path.exists() and path.suffix.lower() in _FILE_SUFFIXES:  # `--csv audit.csv`: a folder of that name
        raise RetrievalError(
            f"{what} {path}: a file's name ({path.suffix}), but {what} is the folder the files are written into; "
            f"give a folder, e.g. {path.with_suffix('')}"
        )

    def refused(reason: object) -> RetrievalError:
        return RetrievalError(f"{what} {path}: cannot be made ({reason}); give a folder where you can write")

    if not make:
        nearest = next(folder for folder in (path, *path.absolute().parents) if folder.exists())
        if not nearest.is_dir() or not os.access(nearest, os.W_OK | os.X_OK):
            kind = "a file" if not nearest.is_dir() else "a folder this user cannot write in"
            raise refused(f"{nearest} is {kind}")
        return path
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise refused(error.strerror or error) from None
    return path


@contextmanager
def folder_lock(directory: Path, what: str, busy: str, wait: float = 0.0) -> Iterator[None]:
    """Holds an exclusive lock on directory for one process at a time (an flock on the sibling file .NAME.lock, so
    that the folder itself may be swapped or not yet exist), waiting up to wait s for another holder; then one line:
    busy. what names the folder in the line said when the lock file cannot be made."""
    folder = Path(os.path.abspath(directory))  # `--run .` and `runs/x/..` name their folder too
    if not folder.name:
        raise RetrievalError(f"{what} {directory}: the file system's root; give a folder inside it")
    path = folder.with_name(f".{folder.name}.lock")
    deadline = time.monotonic() + wait
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path, "a")  # closed by the with below, after the lock is released
    except OSError as error:
        raise RetrievalError(
            f"{what} {directory}: its lock file {path} cannot be made ({error.strerror or error}); give a folder "
            "inside one you can write in"
        ) from None
    with handle:
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise RetrievalError(busy) from None
                time.sleep(0.05)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


UMASK = os.umask(0o022)  # the process's file-creation mask, read once (reading it sets it; it is put back at once)
os.umask(UMASK)


FREE_SPACE = "free space on its disk (or give a folder on another one) and run it again"


def disk_full(error: OSError | sqlite3.Error) -> bool:
    """Whether a refused write ran out of room: ENOSPC or a quota, or SQLite's "database or disk is full"."""
    if isinstance(error, sqlite3.Error):
        return "disk is full" in str(error)
    return error.errno in (errno.ENOSPC, errno.EDQUOT)


def write_refused(path: Path, error: OSError | sqlite3.Error, what: str = "") -> RetrievalError:
    """The one line for a write the system refused (disk full, quota, a read-only file system; SQLite's "database or
    disk is full"): what could not be written, why, that the previous version is kept, and on a full disk what to do."""
    reason = getattr(error, "strerror", None) or str(error)
    advice = f"; {FREE_SPACE}" if disk_full(error) else ""
    what = f"{what} " if what else ""
    return RetrievalError(f"{path}: {what}cannot be written ({reason}); the previous version is kept{advice}")


def write_atomic(path: Path, data: bytes, durable: bool = True) -> None:
    """Writes a file so that readers see the old or the new content, never a partial one.

    durable: also fsync the file and its folder, so that it survives a power cut (not needed for caches).
    """
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as error:
        raise write_refused(path, error) from None
    try:
        with suppress(OSError):  # the mode open() gives (mkstemp's 0600: a service user could not read the file)
            os.fchmod(handle, 0o666 & ~UMASK)
        with os.fdopen(handle, "wb") as file:
            file.write(data)
            if durable:
                file.flush()
                os.fsync(file.fileno())
        os.replace(temporary, path)
        if durable:
            fsync_dir(path.parent)
    except BaseException as error:
        Path(temporary).unlink(missing_ok=True)
        if isinstance(error, OSError):  # disk full, quota, read-only file system
            raise write_refused(path, error) from None
        raise


CHECKSUM = "checksum"  # key of a sealed JSON object: the sha256 of the object's other keys


def write_json(path: Path, value: Any, sealed: bool = False) -> None:
    """Writes pretty JSON atomically; sealed (an object): with a checksum that read_json verifies."""
    if sealed:
        value = {**value, CHECKSUM: _json_digest(value)}
    write_atomic(path, (json.dumps(value, indent=2, sort_keys=False) + "\n").encode())


def read_json(path: Path, remedy: str = "recreate it") -> Any:
    """Reads JSON, naming the file when it is missing, malformed or (sealed) does not match its checksum, and the
    remedy for the last two."""
    try:
        value = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise RetrievalError(f"{path}: missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise RetrievalError(f"{path}: not valid JSON ({error}); the file is damaged, {remedy}") from None
    if isinstance(value, dict) and CHECKSUM in value:
        expected = value.pop(CHECKSUM)
        if expected != _json_digest(value):
            raise RetrievalError(
                f"{path}: its content does not match its checksum (the file was damaged or edited by hand); {remedy}"
            )
    return value


def _json_digest(value: dict) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def file_sha256(path: Path) -> str:
    """The sha256 of a file's bytes, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def fsync_dir(directory: Path) -> None:
    """Makes a rename in a directory durable."""
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
