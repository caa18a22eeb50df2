"""Embedders (images -> L2-normalised float32 rows) and batch embedding of a collection."""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
from PIL import Image

from retrieval.data import Collection, Item, Skipped, as_items, decode_image, read_image_bytes
from retrieval.errors import ImageError, RetrievalError, require_whole
from retrieval.extras import require
from retrieval.preprocess import Preprocessing, require_images
from retrieval.progress import progress as progress_bar
from retrieval.runs import RunDir, read_json, shell_path


class Embedder(Protocol):
    """Maps RGB images to L2-normalised embeddings; `fingerprint` names the exact encoder.

    `prepare` (resizing, normalising) is thread-safe and runs in the decoding threads of a batch job;
    `embed_prepared` runs the model. `embed(images)` is the two in one call. `input_size`: the shorter side
    the model sees, so that JPEGs can be decoded at a reduced scale that still covers it (0: full size).
    """

    dim: int
    fingerprint: str
    batch_size: int
    input_size: int

    def prepare(self, images: Sequence[Image.Image]) -> np.ndarray:
        """Returns the model's input batch for RGB images."""
        ...

    def embed_prepared(self, batch: np.ndarray) -> np.ndarray:
        """Returns float32 [N, dim] with unit-norm rows for a prepared batch."""
        ...

    def embed(self, images: Sequence[Image.Image]) -> np.ndarray:
        """Returns float32 [N, dim] with unit-norm rows."""
        return self.embed_prepared(self.prepare(images))

    def one_core(self) -> Embedder:
        """The same encoder running on the calling thread alone, safe to call from several threads at once: a batch
        job runs one copy of decode-then-embed per core, which keeps every core busy without oversubscribing."""
        ...


_EMBEDDER_PARTS = ("dim", "fingerprint", "batch_size", "input_size", "prepare", "embed_prepared", "one_core")


def require_embedder(embedder: object) -> Embedder:
    """embedder, where it is one; a run, its path or None given in its place (a run may be given by its path where a
    RunDir goes, so the mistake is easy) is refused with the line that loads the run's encoder, not an AttributeError
    from the first use."""
    if all(hasattr(embedder, part) for part in _EMBEDDER_PARTS):
        return embedder  # type: ignore[return-value]
    root = embedder.root if isinstance(embedder, RunDir) else embedder
    if isinstance(root, (str, os.PathLike)):
        if Path(root).is_dir():
            raise RetrievalError(
                f"embedder: {str(root)!r} is a run, not its encoder; load it first: "
                f"OnnxEmbedder.from_run({str(root)!r})"
            )
        given = repr(str(root))
    else:
        given = "None" if embedder is None else f"a value of type {type(embedder).__name__}"
    raise RetrievalError(f"embedder: {given} is not an encoder; give an Embedder, e.g. OnnxEmbedder.from_run(RUN)")


def l2_normalise(vectors: np.ndarray) -> np.ndarray:
    """Returns float32 rows scaled to unit length (zero rows stay zero)."""
    vectors = np.asarray(vectors, dtype=np.float32)
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    return vectors / np.maximum(norms, 1e-12)


MODELS = ("float32", "int8")  # the exported models of a run that serving can load
AUTO = "auto"  # the model an index was built with; without one, int8 where the run has it (it passed its gate)


def chosen_model(run: RunDir, model: str, built_with: str | None = None) -> str:
    """The model that `auto` stands for: the one whose sha256 built_with names (an index's encoder), else int8
    where the run has model.int8.onnx (`export --int8` writes it only after its quality gate), else float32.
    Any other value is returned as given."""
    if model != AUTO:
        return model
    run.require_model()
    int8 = run.fingerprints().get("int8")
    if built_with is not None:
        return "int8" if built_with == int8 else "float32"
    return "int8" if int8 and run.int8_model.is_file() else "float32"


class OnnxEmbedder(Embedder):
    """Runs an exported encoder (model.onnx + model.json) with ONNX Runtime, on CUDA when available."""

    def __init__(self, model_path: Path, card: dict, threads: int | None = None, spinning: bool = True) -> None:
        """spinning: ONNX Runtime's threads keep spinning between calls (faster back-to-back batches); a server
        turns it off, so that the cores go to the web server between its short calls."""
        ort = require("onnxruntime", "cpu")  # imported here so that metrics and data need no runtime

        self.model_path = Path(model_path)
        self.card = card
        self.threads = require_whole("threads", threads, 0) if threads else (os.cpu_count() or 1)  # 0: every core
        self._one_core: OnnxEmbedder | None = None
        self.preprocessing = Preprocessing.from_dict(card["preprocessing"])
        self.dim = int(card["embedding_dim"])
        self.input_size = self.preprocessing.image_size
        self.fingerprint = str(card["sha256"])
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.intra_op_num_threads = self.threads
        options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
        available = ort.get_available_providers()
        providers = [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in available]
        try:
            self.session = ort.InferenceSession(str(model_path), options, providers=providers)
        except Exception as error:  # onnxruntime raises its own untyped errors for bad files
            raise RetrievalError(
                f"{model_path}: ONNX Runtime cannot load it ({error}); re-export with `retrieval export`"
            ) from None
        self.input_name = self.session.get_inputs()[0].name
        self.batch_size = 256 if "CUDAExecutionProvider" in self.session.get_providers() else 64

    @classmethod
    def from_run(
        cls,
        run: RunDir | str | Path,
        threads: int | None = None,
        spinning: bool = True,
        model: str = "float32",
        built_with: str | None = None,
    ) -> OnnxEmbedder:
        """Loads the run's exported model (model: float32, int8 for model.int8.onnx, or auto: see chosen_model, with
        built_with an index's encoder sha256), checked against the sha256 in its model card; the fingerprint is
        that file's, so an index built with one refuses the other."""
        run = RunDir.of(run)
        model_path = run.require_model()
        model = chosen_model(run, model, built_with)
        card = read_json(run.model_card)
        if model not in MODELS:
            raise RetrievalError(f"--model must be one of {', '.join((*MODELS, AUTO))}, got {model!r}")
        if model == "int8":
            if "int8" not in card or not run.int8_model.is_file():
                raise RetrievalError(
                    f"{run.root}: no int8 model (model.int8.onnx); "
                    f"make it with `retrieval export {shell_path(run.root)} --int8`"
                )
            model_path = run.int8_model
            card = {**card, "precision": "int8", "sha256": card["int8"]["sha256"]}
        digest = hashlib.sha256(model_path.read_bytes()).hexdigest()
        if digest != card.get("sha256"):
            raise RetrievalError(
                f"{model_path}: sha256 {digest[:12]}… does not match model.json "
                f"({str(card.get('sha256'))[:12]}…); re-export with `retrieval export {shell_path(run.root)}`"
            )
        return cls(model_path, card, threads, spinning)

    def prepare(self, images: Sequence[Image.Image]) -> np.ndarray:
        return self.preprocessing(images)

    def one_core(self) -> OnnxEmbedder:
        """A second session of the same model with one intra-op thread (made once); on CUDA the session itself."""
        if self.threads == 1 or "CUDAExecutionProvider" in self.session.get_providers():
            return self
        if self._one_core is None:
            self._one_core = OnnxEmbedder(self.model_path, self.card, threads=1, spinning=False)
        return self._one_core

    def embed_prepared(self, batch: np.ndarray) -> np.ndarray:
        if len(batch) == 0:
            return np.zeros((0, self.dim), np.float32)
        (output,) = self.session.run(None, {self.input_name: batch})
        return l2_normalise(output)


class PixelEmbedder(Embedder):
    """The raw-pixel baseline: each image shrunk to size x size grayscale and flattened, compared by cosine."""

    def __init__(self, size: int = 16) -> None:
        self.size = size
        self.dim = size * size
        self.input_size = size
        self.fingerprint = f"raw-pixels-{size}x{size}-grayscale"
        self.batch_size = 256

    def prepare(self, images: Sequence[Image.Image]) -> np.ndarray:
        rows = [
            np.asarray(image.convert("L").resize((self.size, self.size), Image.Resampling.BILINEAR), np.float32).ravel()
            for image in require_images(images)
        ]
        return np.stack(rows) if rows else np.zeros((0, self.dim), np.float32)

    def embed_prepared(self, batch: np.ndarray) -> np.ndarray:
        return l2_normalise(batch)

    def one_core(self) -> PixelEmbedder:
        return self


@dataclass
class EmbeddedBatch:
    """One batch of a job: vectors of the readable new items, the files skipped and how many were unchanged."""

    vectors: np.ndarray
    items: list[Item]
    hashes: list[str]
    skipped: list[Skipped]
    unchanged: int = 0
    thumbnails: list[np.ndarray] | None = None  # with thumbnail=S: each item's picture as S x S x 3 uint8


_Decoded = tuple[list[Image.Image], EmbeddedBatch]  # a batch's pictures, and the batch with its items


def iter_embedded(
    embedder: Embedder,
    items: Sequence[Item],
    batch_size: int | None = None,
    unchanged: Callable[[Item, str], bool] | None = None,
    workers: int | None = None,
    progress: bool = True,
    thumbnail: int = 0,
) -> Iterator[EmbeddedBatch]:
    """Embeds items batch by batch, in order: one thread per core (workers: default the machine's cores) reads,
    decodes and embeds a batch of its own with the encoder on that core (Embedder.one_core).

    A model spread over every core would share them with the decoding threads and wait on the slowest;
    one pipeline per core keeps the cores on the model and the decoding in its gaps, taking turns at it while
    it is the shorter part (see _Turns). Files that cannot be read or decoded are skipped with their reason;
    items for which unchanged(item, sha256) is true are counted but not decoded. At most workers + 1 batches are
    in memory at once, whatever the number of items. thumbnail=S also keeps each picture squashed to S x S
    pixels (the audit compares pictures from them without decoding the files again).
    """
    embedder = require_embedder(embedder)
    size = embedder.batch_size if batch_size is None else require_whole("batch_size", batch_size, 1)
    thumbnail = require_whole("thumbnail", thumbnail, 0)
    chunks = [items[start : start + size] for start in range(0, len(items), size)]
    workers = (os.cpu_count() or 1) if workers is None else require_whole("workers", workers, 1)
    model = embedder.one_core() if workers > 1 else embedder
    turns = _Turns()

    def work(chunk: Sequence[Item]) -> EmbeddedBatch:
        images, batch = turns.decode(lambda: _decoded(chunk, embedder.input_size, unchanged, thumbnail))
        started = time.perf_counter()
        batch.vectors = (
            model.embed_prepared(model.prepare(images)) if images else np.zeros((0, embedder.dim), np.float32)
        )
        turns.embedded(time.perf_counter() - started)
        return batch

    with (
        ThreadPoolExecutor(max_workers=workers, thread_name_prefix="embed") as pool,
        progress_bar(total=len(items), desc="embedding", unit="img", enabled=progress) as bar,
    ):
        pending = deque(pool.submit(work, chunk) for chunk in chunks[: workers + 1])
        following = len(pending)
        while pending:
            batch = pending.popleft().result()
            if following < len(chunks):
                pending.append(pool.submit(work, chunks[following]))
                following += 1
            bar.update(len(batch.items) + len(batch.skipped) + batch.unchanged)
            yield batch


class _Turns:
    """Whether the pipelines of iter_embedded take turns decoding: while a batch's decoding takes less time than
    its embedding, as with small pictures.

    Their decoding is then mostly Python, which holds the interpreter lock: pipelines that decode together wait
    for each other, and, started together, stay in step, every core decoding at once and then every core
    embedding. Taking turns puts them a decoding apart, so that one decodes while the others embed. Large
    photos are decoded in C, without the interpreter lock, for longer than they take to embed: there the
    pipelines decode at once.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._decoding = 0.0  # seconds: the latest decoding of a batch, and the latest embedding of one
        self._embedding = 0.0

    def decode(self, decode: Callable[[], _Decoded]) -> _Decoded:
        """decode()'s result, run in turn with the other pipelines while decoding is the shorter part (at once
        until a batch has been embedded)."""
        if self._decoding >= self._embedding:
            return self._timed(decode)
        with self._lock:
            return self._timed(decode)

    def embedded(self, seconds: float) -> None:
        """Records how long the batch last decoded took to embed."""
        self._embedding = seconds

    def _timed(self, decode: Callable[[], _Decoded]) -> _Decoded:
        started = time.perf_counter()
        result = decode()
        self._decoding = time.perf_counter() - started
        return result


def _decoded(
    chunk: Sequence[Item], min_size: int, unchanged: Callable[[Item, str], bool] | None, thumbnail: int
) -> _Decoded:
    """Reads and decodes one batch's files: the pictures, and the batch with its items, hashes and skips."""
    images: list[Image.Image] = []
    batch = EmbeddedBatch(np.zeros((0, 0), np.float32), [], [], [], thumbnails=[] if thumbnail else None)
    for item in chunk:
        try:
            read = read_image_bytes(item.path)
            if unchanged is not None and unchanged(item, read.sha256):
                batch.unchanged += 1
                continue
            images.append(decode_image(read.data, item.path, min_size))
        except ImageError as error:
            batch.skipped.append(Skipped(item.path, error.reason))
            continue
        batch.items.append(item)
        batch.hashes.append(read.sha256)
        if batch.thumbnails is not None:
            batch.thumbnails.append(np.asarray(images[-1].resize((thumbnail, thumbnail), Image.BILINEAR)))
    return images, batch


@dataclass
class Embedded:
    """The result of embedding a list of items: vectors for the good ones, reasons for the rest."""

    vectors: np.ndarray
    items: list[Item]
    hashes: list[str]
    skipped: list[Skipped]
    thumbnails: np.ndarray | None = None  # with thumbnail=S: [N, S, S, 3] uint8, row i the picture of items[i]


def embed_items(
    embedder: Embedder,
    items: Sequence[Item | str | Path] | Collection | str | Path,
    batch_size: int | None = None,
    progress: bool = True,
    thumbnail: int = 0,
) -> Embedded:
    """Embeds all items (Items, image paths, or a collection or its path) into one matrix; files that cannot be
    decoded are skipped and reported (thumbnail: see iter_embedded)."""
    batches = list(iter_embedded(embedder, as_items(items), batch_size, progress=progress, thumbnail=thumbnail))
    vectors = [batch.vectors for batch in batches if len(batch.vectors)]
    matrix = np.concatenate(vectors) if vectors else np.zeros((0, embedder.dim), np.float32)
    pictures = [picture for batch in batches for picture in batch.thumbnails or []]
    return Embedded(
        matrix,
        [item for batch in batches for item in batch.items],
        [digest for batch in batches for digest in batch.hashes],
        [entry for batch in batches for entry in batch.skipped],
        (np.stack(pictures) if pictures else np.zeros((0, thumbnail, thumbnail, 3), np.uint8)) if thumbnail else None,
    )
