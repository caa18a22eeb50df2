"""The app's state, without the interface: the encoder, a snapshot of the index, the cache folder.

Searching, adding and removing are index/'s (index.search, index.edit); this module only keeps the
snapshot they run on up to date and words their results for people (`SearchResult`). Everything the app shows as an
image is a file in its own cache folder (thumbnails of gallery items,
plots, the embedding map), so that this folder is the only one the web server needs to read from.
The index is reloaded when a writer (this app, or a `retrieval index` job) has replaced it on disk.
"""

from __future__ import annotations

import hashlib
import html
import io
import shutil
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
from PIL import Image

from app.batching import Batcher
from index.backends import built_with, open_index
from index.edit import Added, add_images, remove_items
from index.search import (
    ImageQuery,
    Query,
    QueryResult,
    closest_labels,
    search_image_bytes,
    search_images,
    search_item,
    unknown_id,
)
from index.stats import exact_and_deployed
from index.types import MANIFEST, GalleryBackend, Hit, item_ids
from retrieval.calibration import match_similarity
from retrieval.copies import CopyEvaluation, copy_figures
from retrieval.data import Collection, Item, decode_image, read_image_bytes
from retrieval.embedders import AUTO, OnnxEmbedder
from retrieval.errors import Failure, ImageError, RetrievalError
from retrieval.evaluation import TRAINED, Evaluation, trained_share, write_plots
from retrieval.rerank import NO_RERANK, Rerank
from retrieval.runs import RunDir, read_json, write_atomic

THUMBNAIL = 256  # longest side of the thumbnails the app serves, in pixels
LOST_TILE, GREY = "lost.jpg", (200, 200, 200)  # the tile of an indexed file that can no longer be read
BROWSE_LIMIT = 200  # thumbnails shown for one label
EXACT_SHOWN = ("recall@1", "recall@5", "map@r")  # "evaluate now" shows these of exact search beside the index's
MAP_POINTS = 5_000  # gallery items drawn on the embedding map (a seeded sample above this)
PICK_RADIUS = 12.0  # pixels around a point of the map that a click picks it from


MAX_BATCH = 4  # concurrent image queries embedded in one call: larger batches make the queries behind them wait (p95)
NO_MATCH = "no confident match"  # said above results whose best hit is below the match threshold


@dataclass
class SearchResult:
    """The hits of one query and a one-line summary for people (the failure's message when the query failed)."""

    hits: list[Hit]
    summary: str
    label: str = ""  # the query's label, when known: marks hits and misses
    failure: Failure | None = None

    @property
    def error(self) -> bool:
        """Whether the query failed."""
        return self.failure is not None


@dataclass(frozen=True)
class EvaluatedNow:
    """What the Evaluate button shows: the deployed index's metrics (or, without labels, the augmented copies'
    figures) and the plots drawn of them."""

    evaluation: Evaluation | CopyEvaluation
    plots: list[Path]


@dataclass
class Snapshot:
    """One version of the index and its items, read together so that they always agree."""

    index: GalleryBackend
    items: dict[int, Item]
    stamp: tuple[int, int]

    @cached_property
    def labels(self) -> frozenset[str]:
        """The labels of the items (read once per version, when a search first asks)."""
        return frozenset(item.label for item in self.items.values())


@dataclass
class EmbeddingMap:
    """A 2-D projection of gallery items drawn to a PNG, with each item's position in the image's pixels."""

    image: Path
    ids: np.ndarray
    pixels: np.ndarray  # [N, 2]: x to the right, y down, as a click on the image reports them

    def pick(self, x: float, y: float, radius: float = PICK_RADIUS) -> int | None:
        """The id of the item drawn nearest to pixel (x, y), if one lies within radius."""
        if not len(self.ids):
            return None
        distances = np.hypot(self.pixels[:, 0] - x, self.pixels[:, 1] - y)
        nearest = int(np.argmin(distances))
        return int(self.ids[nearest]) if distances[nearest] <= radius else None


class SearchService:
    """An ONNX encoder and the gallery index it built, ready to answer image queries."""

    def __init__(
        self,
        run: RunDir | str | Path,
        index_dir: Path | None = None,
        mmap: bool = False,
        allow_write: bool = False,
        threads: int | None = None,
        cache: Path | None = None,
        rerank: Rerank = NO_RERANK,
        model: str = AUTO,
        max_batch: int = MAX_BATCH,
        threshold: float | None = None,
    ) -> None:
        run = self.run = RunDir.of(run)
        self.rerank = rerank  # the re-ranking of every search and of "evaluate now" (retrieval.rerank)
        Query(rerank=rerank, threshold=threshold)  # refused here, not at the first search: "qe", a threshold of 5
        self.threshold = threshold  # the match threshold given to serve (--threshold), over the model card's
        self.index_dir = Path(index_dir or run.index)
        self.mmap = mmap
        self.allow_write = allow_write
        built = built_with(self.index_dir)  # auto: the model the index was built with
        self.embedder = OnnxEmbedder.from_run(run, threads, spinning=False, model=model, built_with=built)
        self.threads = int(self.embedder.session.get_session_options().intra_op_num_threads)
        self._cache = cache
        self._making_cache = threading.Lock()
        self.uploads = self.index_dir.parent / "uploads"  # where images added through the app are kept
        self.metric_sets = run.saved_metrics()  # every evaluated set, the latest first
        baseline = run.root / "baseline_metrics.json"  # the raw-pixel baseline of `retrieval demo`
        self.baseline = read_json(baseline) if baseline.is_file() else None
        self._reload = threading.Lock()
        self._snapshot = self._load()
        self._maps: dict[tuple[tuple[int, int], str, str | None], EmbeddingMap] = {}
        self._projections: dict[tuple[tuple[int, int], str], np.ndarray] = {}  # a t-SNE is drawn, highlighted, again
        self.batcher = Batcher(self.answer, max_batch)  # the image queries of the app and its API, batched together

    @property
    def cache(self) -> Path:
        """The app's own folder (thumbnails, plots, query copies), made on first use; the server reads no other."""
        with self._making_cache:
            if self._cache is None:
                self._cache = Path(tempfile.mkdtemp(prefix="retrieval-app-"))
        return self._cache

    def _load(self) -> Snapshot:
        stamp = _stamp(self.index_dir)
        index = open_index(self.index_dir, self.embedder.fingerprint, self.embedder.dim, mmap=self.mmap)
        return Snapshot(index, index.items(), stamp or (0, 0))

    @property
    def snapshot(self) -> Snapshot:
        """The current index and items, reloaded first when the index on disk has been replaced."""
        stamp = _stamp(self.index_dir)
        if stamp is not None and stamp != self._snapshot.stamp:
            with self._reload:
                if stamp != self._snapshot.stamp:
                    try:
                        self._snapshot = self._load()
                    except RetrievalError:
                        pass  # caught between a writer's two renames: the previous version serves until the next call
        return self._snapshot

    @property
    def index(self) -> GalleryBackend:
        return self.snapshot.index

    @property
    def items(self) -> dict[int, Item]:
        return self.snapshot.items

    # searching (index.search), worded for people

    def query(
        self, k: int = 10, depth: int | None = None, label: str | None = None, rerank: Rerank | None = None
    ) -> Query:
        """A query as this app answers it: re-ranked as the server was started (unless rerank is given), its hits
        marked by the match threshold that applies (--threshold, or the model card's fitted for that re-ranking)."""
        reranker = self.rerank if rerank is None else rerank
        return Query(
            k, depth, label, reranker, match_similarity(self.embedder.card, reranker.describe(), self.threshold)
        )

    def search(
        self,
        image_path: str | Path,
        k: int = 10,
        query_label: str = "",
        depth: int | None = None,
        only: str | None = None,
    ) -> SearchResult:
        """The k nearest gallery items to an image file (depth: nprobe/efSearch; only: this label only)."""
        return self.search_images([image_path], [k], [query_label], [depth], [only])[0]

    def search_images(
        self,
        paths: Sequence[str | Path],
        ks: Sequence[int],
        labels: Sequence[str],
        depths: Sequence[int | None],
        only: Sequence[str | None] | None = None,
    ) -> list[SearchResult]:
        """Answers a batch of image queries with one embedding call (index.search.search_images); labels mark hits."""
        only = list(only) if only is not None else [None] * len(paths)
        given = {"ks": len(ks), "labels": len(labels), "depths": len(depths), "only": len(only)}
        wrong = [f"{count} {name}" for name, count in given.items() if count != len(paths)]
        if wrong:  # zip answered the shortest and dropped the rest without a word
            raise RetrievalError(f"{len(paths)} images for {', '.join(wrong)}: give one of each per image")
        queries = [self.query(int(k), depth, label) for k, depth, label in zip(ks, depths, only)]
        snapshot = self.snapshot  # one version for the search and its wording (each look is a stat of the index)
        found = search_images(snapshot.index, self.embedder, paths, queries)
        return [worded(result, label, snapshot.labels) for result, label in zip(found, labels)]

    def answer(self, images: Sequence[ImageQuery | Failure], queries: Sequence[Query]) -> list[QueryResult]:
        """A batch of image queries on the current index (what the batcher calls)."""
        return search_image_bytes(self.snapshot.index, self.embedder, images, queries)

    def search_item(self, item_id: int, k: int = 10, depth: int | None = None, only: str | None = None) -> SearchResult:
        """The k nearest gallery items to an indexed item (itself left out), marked by its label; an unknown id is
        the result's failure, as it is for index.search.search_item."""
        (item_id,) = item_ids([item_id])  # "abc" failed in int()
        snapshot = self.snapshot
        item = snapshot.items.get(item_id)
        if item is None:
            return worded(QueryResult(error=unknown_id(snapshot.index, item_id)), "")
        result = worded(search_item(snapshot.index, item_id, self.query(k, depth, only)), item.label)
        result.summary = f"item {item_id} ({as_text(item.path.name)}): {result.summary}"
        return result

    # browsing

    def label_counts(self) -> list[tuple[str, int]]:
        """Every label of the index with its number of items, the largest first ("" for unlabeled)."""
        return Counter(item.label for item in self.items.values()).most_common()

    def browse(self, label: str | None = None, limit: int = BROWSE_LIMIT) -> list[int]:
        """Ids of up to limit items with the label (any label when None), in id order."""
        return [item_id for item_id, item in sorted(self.items.items()) if label is None or item.label == label][:limit]

    def samples(self) -> list[int]:
        """One item id per label (up to BROWSE_LIMIT), to pick queries from."""
        first: dict[str, int] = {}
        for item_id, item in sorted(self.items.items()):
            first.setdefault(item.label, item_id)
        return list(first.values())[:BROWSE_LIMIT]

    def thumbnails(self, ids: Sequence[int]) -> list[Path]:
        """Small copies of indexed items' images in the cache (made on first use; grey for a lost file)."""
        rows = self.snapshot.index.rows(list(ids))
        missing = [item_id for item_id in ids if item_id not in rows]
        if missing:
            raise RetrievalError(f"no item with id {', '.join(map(str, missing))} in {self.index_dir}")
        return [self.thumbnail(rows[item_id].path, rows[item_id].sha256) for item_id in ids]

    def thumbnail(self, path: str | Path, digest: str) -> Path:
        """The thumbnail of the image at path whose content has sha256 digest (a hit's path and sha256); the grey
        LOST_TILE where the file cannot be read, not kept as its thumbnail (a file moved back is shown again)."""
        target = self.cache / "thumbnails" / f"{digest}.jpg"
        if target.is_file():
            return target
        try:
            # a large JPEG decoded at the reduced scale a thumbnail needs
            image = decode_image(read_image_bytes(Path(path)).data, path, THUMBNAIL)
        except ImageError:
            target, image = self.cache / "thumbnails" / LOST_TILE, Image.new("RGB", (THUMBNAIL, THUMBNAIL), GREY)
            if target.is_file():
                return target
        image.thumbnail((THUMBNAIL, THUMBNAIL))
        buffer = io.BytesIO()
        image.save(buffer, format="JPEG", quality=88)
        write_atomic(target, buffer.getvalue(), durable=False)  # a cache: rebuilt when lost
        return target

    # writing (only when started with allow_write)

    def add_images(self, paths: Sequence[str | Path], label: str = "") -> Added:
        """Adds readable images with a label, copies kept in uploads/ (index.edit.add_images)."""
        self._require_write()
        return add_images(self.index_dir, self.embedder, paths, label, self.uploads)

    def remove_items(self, ids: Sequence[int]) -> int:
        """Removes items from the index (copies this app made in its uploads folder are deleted too)."""
        self._require_write()
        return remove_items(self.index_dir, self.embedder, ids, self.uploads)

    def _require_write(self) -> None:
        if not self.allow_write:
            raise RetrievalError(
                "this app is read-only; start it with `retrieval serve RUN --allow-write` to add or remove images"
            )

    # evaluation and the embedding map

    def evaluate_now(self, progress: Callable[[float, str], None] = lambda fraction, text: None) -> EvaluatedNow:
        """Leave-one-out retrieval over the index's labeled items, as the index searches them and exactly, and the
        plots of the exact one; the metrics are the deployed index's, with each headline's exact value beside it.
        An index without two labels gets the figures of augmented copies of its images instead (no plots)."""
        snapshot = self.snapshot
        index = snapshot.index
        if len({item.label for item in snapshot.items.values() if item.label}) < 2:
            progress(0.1, "no labels: searching with augmented copies of the images")
            return EvaluatedNow(copy_figures(self.embedder, list(snapshot.items.values()), progress=False), [])
        progress(0.1, f"scoring {len(index):,} stored vectors with the index's search and exactly")
        evaluated = exact_and_deployed(index, self.rerank)
        exact, deployed = evaluated.exact, evaluated.deployed
        for key in EXACT_SHOWN:
            deployed.metrics[f"{key} (exact search)"] = exact.metrics[key]
        gallery = Collection(self.index_dir, list(snapshot.items.values()))
        trained = trained_share(self.run, [gallery])
        if trained is not None and trained.counts[0]:  # the figures of a gallery of training images flatter the model
            deployed.metrics[TRAINED] = trained.counts[0]
        progress(0.8, "drawing the plots")
        folder = self.cache / "evaluations" / str(time.time_ns())
        return EvaluatedNow(deployed, write_plots(exact, folder))

    def embedding_map(self, method: str = "pca", highlight: str | None = None) -> EmbeddingMap:
        """The gallery (a seeded sample above MAP_POINTS) in 2-D by PCA or t-SNE, coloured by label.

        highlight: one label drawn large in red over the others in grey.
        """
        from retrieval.plots import plot_embedding_map

        snapshot = self.snapshot
        key = (snapshot.stamp, method, highlight)
        if key not in self._maps:
            ids = np.array(sorted(snapshot.items), dtype=np.int64)
            if len(ids) > MAP_POINTS:
                ids = np.sort(np.random.default_rng(0).choice(ids, MAP_POINTS, replace=False))
            points = self._projections.get((snapshot.stamp, method))
            if points is None:
                points = self._projections[(snapshot.stamp, method)] = project_2d(
                    snapshot.index.vectors_of(ids.tolist()), method
                )
            name = f"{snapshot.stamp[0]}-{snapshot.stamp[1]}-{method}-{_folder_safe(highlight)}.png"
            labels = [snapshot.items[int(i)].label for i in ids]
            title = f"{method.upper()} of {len(ids):,} gallery items"
            pixels = plot_embedding_map(points, labels, self.cache / "maps" / name, title, highlight=highlight)
            self._maps[key] = EmbeddingMap(self.cache / "maps" / name, ids, pixels)
        return self._maps[key]

    def close(self) -> None:
        """Stops the batcher and removes the app's cache folder."""
        self.batcher.close()
        if self._cache is not None:
            shutil.rmtree(self._cache, ignore_errors=True)


def project_2d(vectors: np.ndarray, method: str = "pca") -> np.ndarray:
    """[N, 2] coordinates of vectors: their first two principal components, or a seeded t-SNE."""
    if method not in ("pca", "tsne"):
        raise RetrievalError(f"projection {method!r} is not known; use pca or tsne")
    if len(vectors) < 3:
        return np.zeros((len(vectors), 2), np.float32)
    if method == "tsne":
        from sklearn.manifold import TSNE

        return (
            TSNE(2, perplexity=min(30.0, len(vectors) - 1.0), init="pca", random_state=0)
            .fit_transform(vectors)
            .astype(np.float32)
        )
    centred = vectors - vectors.mean(axis=0)
    _, _, components = np.linalg.svd(centred, full_matrices=False)
    return (centred @ components[:2].T).astype(np.float32)


def worded(result: QueryResult, label: str, known: frozenset[str] | None = None) -> SearchResult:
    """A search result for people: its hits and one line (the failure, or the count, time and hits of the label).
    known: the gallery's labels; a label outside them marks nothing (every hit would be a miss) and says so."""
    if result.error is not None:
        return SearchResult([], f"⚠️ {as_text(result.error.message)}", label, result.error)
    notes = [as_text(note) for note in result.notes]
    if label and known is not None and label not in known:
        closest = closest_labels(label, known)
        notes.append(as_text(f"no gallery item has the label {label!r}, so hits are not marked; closest: {closest}"))
        label = ""
    unsure = bool(result.hits) and result.hits[0].match is False
    summary = f"{len(result.hits)} results in {result.seconds * 1000:.0f} ms" + (
        f" (a batch of {result.batch} queries)" if result.batch > 1 else ""
    )
    if unsure:
        summary = f"**{NO_MATCH}**: the best hit is below the match threshold · {summary}"
    if label:
        first = next((rank for rank, hit in enumerate(result.hits, 1) if hit.label == label), None)
        hits = f"{sum(hit.label == label for hit in result.hits)}/{len(result.hits)} hits"
        summary += f" · label **{as_text(label)}**: {hits}" + (f", first hit at rank {first}" if first else "")
    return SearchResult(result.hits, summary + "".join(f" ({note})" for note in notes), label)


def as_text(text: str) -> str:
    """Plain text (a message, a label, a file name) as the app's Markdown shows it whole: `<`, `>` and `&` as
    entities, or `ROOT/<label>/<image>` lost its parts as unknown HTML tags."""
    return html.escape(text, quote=False)


def _folder_safe(label: str | None) -> str:
    """A label as part of a file name (any label, also one with separators)."""
    return "all" if label is None else hashlib.sha256(label.encode()).hexdigest()[:12]


def _stamp(directory: Path) -> tuple[int, int] | None:
    """Identifies the version of the index on disk (its manifest's inode and mtime); None in the middle of a swap."""
    try:
        status = (directory / MANIFEST).stat()
    except FileNotFoundError:
        return None
    return status.st_ino, status.st_mtime_ns
