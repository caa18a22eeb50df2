"""Batch embedding on Ray Data (`retrieval index --engine ray`), for galleries one machine cannot embed in time.

Per chunk of the listing: files are read, hashed, decoded and resized in CPU tasks; an actor pool
embeds them (one ONNX Runtime session per actor, one GPU each when the cluster has GPUs); the results
(position in the listing, path, label, sha256, reason when skipped, embedding) are written as Parquet
shards, which the driver reads back in listing order; ids are given when they are merged into the index. From there
index.build treats them exactly as the local engine's batches: bad files
are skipped and reported, files whose sha256 is already indexed are not decoded, every batch is
journaled before the next chunk starts, so a killed job resumes and loses at most one chunk, and the
index is committed the same way.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from retrieval.data import Item, Skipped, decode_image, read_image_bytes
from retrieval.embedders import EmbeddedBatch, OnnxEmbedder
from retrieval.errors import ImageError
from retrieval.extras import require
from retrieval.preprocess import Preprocessing
from retrieval.progress import progress as progress_bar

CHUNK = 8192  # items per Ray job: the work a killed job can lose
UNCHANGED = "\x00unchanged"  # the reason of a file whose sha256 is the one already indexed


@dataclass(frozen=True)
class RayOptions:
    """Where and how wide `retrieval index --engine ray` runs."""

    address: str | None = None  # a Ray cluster (ray://host:10001 or auto); None starts a local one
    workers: int | None = None  # embedding actors (default: one per GPU, else one per two CPUs)


def _decode(batch: dict[str, np.ndarray], preprocessing: dict, known: dict[str, str]) -> dict[str, np.ndarray]:
    """CPU task: hashes each file, decodes and prepares the new ones (reason "" when it worked)."""
    prepare = Preprocessing.from_dict(preprocessing)
    digests, reasons, images = [], [], []
    for path in batch["path"]:
        digest, reason = "", ""
        try:
            read = read_image_bytes(Path(path))
            digest = read.sha256
            if known.get(str(path)) == digest:
                reason = UNCHANGED
            else:
                images.append(decode_image(read.data, path, prepare.image_size))
        except ImageError as error:
            reason = error.reason
        digests.append(digest)
        reasons.append(reason)
    shape = prepare([Image.new("RGB", (8, 8))]).shape[1:]
    pixels = np.zeros((len(reasons), *shape), np.float32)
    ok = np.array([reason == "" for reason in reasons], dtype=bool)
    if images:
        pixels[ok] = prepare(images)
    return {
        **{key: batch[key] for key in ("position", "path", "label")},
        "sha256": np.array(digests),
        "reason": np.array(reasons),
        "pixels": pixels,
    }


class _Encoder:
    """Actor: one ONNX Runtime session, embedding the prepared rows of each batch it is given."""

    def __init__(self, model_path: str, card: dict, threads: int) -> None:
        self.embedder = OnnxEmbedder(Path(model_path), card, threads)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        ok = batch["reason"] == ""
        vectors = np.zeros((len(ok), self.embedder.dim), np.float32)
        if ok.any():
            vectors[ok] = self.embedder.embed_prepared(np.ascontiguousarray(batch["pixels"][ok]))
        return {**{key: batch[key] for key in ("position", "path", "label", "sha256", "reason")}, "embedding": vectors}


def connect(address: str | None) -> object:
    """The ray module, connected to the cluster at address (or to a local one started now when None)."""
    ray = require("ray", "ray")
    # one line per dataset otherwise; the job has its own progress bar
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False, log_to_driver=False, configure_logging=False)
    return ray


def iter_embedded_ray(
    embedder: OnnxEmbedder,
    items: Sequence[Item],
    unchanged: Callable[[Item, str], bool],
    known: dict[str, str],
    scratch: Path,
    options: RayOptions,
    batch_size: int | None = None,
    progress: bool = True,
) -> Iterator[EmbeddedBatch]:
    """Embeds items on Ray Data, yielding batches in listing order as index.build's local engine does.

    known maps paths to the sha256 already indexed or journaled (those files are not decoded);
    unchanged(item, sha256) is then called for every readable file, as the local engine calls it.
    Parquet shards go to scratch (removed chunk by chunk); a cluster's scratch must be a folder every
    node can read and write.
    """
    ray = connect(options.address)
    resources = ray.cluster_resources()
    gpus = int(resources.get("GPU", 0))
    pool = options.workers or gpus or max(1, int(resources.get("CPU", 2)) // 2)
    threads = 1 if gpus else max(1, int(resources.get("CPU", 2)) // pool)
    size = batch_size or embedder.batch_size
    context = ray.data.DataContext.get_current()
    context.execution_options.preserve_order = True
    context.enable_progress_bars = False
    encoder = {"model_path": str(embedder.model_path), "card": embedder.card, "threads": threads}
    with progress_bar(total=len(items), desc="embedding (ray)", unit="img", enabled=progress) as bar:
        for start in range(0, len(items), CHUNK):
            rows = [
                {"position": start + offset, "path": str(item.path), "label": item.label}
                for offset, item in enumerate(items[start : start + CHUNK])
            ]
            decoded = ray.data.from_items(rows).map_batches(
                _decode,
                fn_kwargs={"preprocessing": embedder.card["preprocessing"], "known": known},
                batch_size=size,
                batch_format="numpy",
            )
            embedded = decoded.map_batches(
                _Encoder,
                fn_constructor_kwargs=encoder,
                concurrency=pool,
                num_gpus=1 if gpus else 0,
                batch_size=size,
                batch_format="numpy",
            )
            shards = scratch / f"chunk-{start:012d}-{time.time_ns()}"
            embedded.write_parquet(str(shards))
            results = sorted(ray.data.read_parquet(str(shards)).take_all(), key=lambda row: int(row["position"]))
            shutil.rmtree(shards, ignore_errors=True)
            for offset in range(0, len(results), size):
                batch = _batch(results[offset : offset + size], items, unchanged, embedder.dim)
                bar.update(len(batch.items) + len(batch.skipped) + batch.unchanged)
                yield batch


def _batch(rows: list[dict], items: Sequence[Item], unchanged: Callable[[Item, str], bool], dim: int) -> EmbeddedBatch:
    """An embedded batch of the local engine's shape from rows read back from the Parquet shards."""
    batch = EmbeddedBatch(np.zeros((0, dim), np.float32), [], [], [])
    vectors = []
    for row in rows:
        item = items[int(row["position"])]
        reason, digest = str(row["reason"]), str(row["sha256"])
        if reason not in ("", UNCHANGED):
            batch.skipped.append(Skipped(item.path, reason))
        elif unchanged(item, digest) or reason == UNCHANGED:
            batch.unchanged += 1
        else:
            batch.items.append(item)
            batch.hashes.append(digest)
            vectors.append(np.asarray(row["embedding"], np.float32))
    if vectors:
        batch.vectors = np.stack(vectors)
    return batch
