"""The app's event handlers over one search service, and how they show what it returns.

Each gallery of the app comes with the list of what its tiles show (`Shown`, in gallery order) as
data beside it (an app.components.PageData, kept in the page: unlike a gr.State it can be an output
of the batched search, whose requests come from several sessions at once): a click on a tile picks
the item at the tile's position (SelectData.index), and the page script marks hits and misses and
names each tile's file from the same data (`marks`); captions are only a rendering of it.
"""

from __future__ import annotations

import hashlib
import html
import json
import re
import shutil
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from pathlib import Path

import gradio as gr

from app.components import refused
from app.service import LOST_TILE, SearchResult, SearchService, as_text, worded
from index.search import ImageQuery, Query, QueryResult
from index.types import Hit
from retrieval.data import read_image_bytes
from retrieval.errors import ErrorKind, Failure, ImageError, RetrievalError
from retrieval.evaluation import TRAINED
from retrieval.wording import counted

NO_QUERY = "Upload or paste an image, or click one in a gallery."
MISSED_POINT = "No gallery item there: click on a point of the map."
CLASS_VIEW = 30  # queries shown for a class opened in the Metrics tab, each beside its first hit


@dataclass(frozen=True)
class Shown:
    """One tile of a gallery: the indexed item it shows, how the page marks it, and what hovering it says."""

    id: int
    mark: str = ""  # "hit" or "miss" when the query's label is known, else ""
    title: str = ""
    match: bool | None = None  # a result's: whether it reaches the match threshold (None: no threshold, or no result)


Tiles = list[tuple[str, str]]  # a gallery's value: (thumbnail file, caption) per tile


def hit_mark(hit: Hit, label: str) -> str:
    """hit, miss, or "" when the query's label is not known."""
    return "" if not label else "hit" if hit.label == label else "miss"


def caption(rank: int, hit: Hit, mark: str) -> str:
    """A result's caption, short enough for a tile: its mark, rank, similarity, label and whether it is a match (file
    and id on hover)."""
    prefix = {"hit": "HIT · ", "miss": "miss · "}.get(mark, "")
    return f"{prefix}#{rank} · {hit.score:.3f} · {hit.label}" + (" · match" if hit.match else "")


def result_tiles(service: SearchService, result: SearchResult) -> tuple[Tiles, list[Shown]]:
    """The results as gallery tiles, and what each shows, in the same order."""
    shown = [
        Shown(hit.id, hit_mark(hit, result.label), f"{Path(hit.path).name} · id {hit.id}", hit.match)
        for hit in result.hits
    ]
    tiles = [
        (str(service.thumbnail(hit.path, hit.sha256)), caption(rank, hit, tile.mark))
        for rank, (hit, tile) in enumerate(zip(result.hits, shown), 1)
    ]
    return tiles, shown


def lost_note(tiles: Tiles, hits: list[Hit]) -> str:
    """A line under the summary where hits are grey tiles: their files cannot be read (moved or deleted since they
    were indexed), said once, not left to be guessed."""
    lost = [hit.path for hit, (tile, _) in zip(hits, tiles) if Path(tile).name == LOST_TILE]
    if not lost:
        return ""
    one = len(lost) == 1
    return (
        f"\n\n⚠️ {counted(len(lost), 'hit')} shown grey: {'its file' if one else 'their files'} cannot be read (e.g. "
        f"{as_text(str(lost[0]))}); moved or deleted since {'it was' if one else 'they were'} indexed? Put "
        f"{'it' if one else 'them'} back, or index their folder again with `--sync`"
    )


def item_tiles(service: SearchService, ids: list[int], labelled: bool = True) -> tuple[Tiles, list[Shown]]:
    """Indexed items as gallery tiles (label, file name and id; without the label where they share one), and what
    each shows."""
    items = service.items

    def named(i: int) -> str:
        return f"{items[i].label} · {items[i].path.name} · id {i}" if labelled else f"{items[i].path.name} · id {i}"

    tiles = [(str(thumbnail), named(i)) for i, thumbnail in zip(ids, service.thumbnails(ids))]
    return tiles, [Shown(i, "", named(i)) for i in ids]


def as_data(shown: list[Shown]) -> list[dict]:
    """What the tiles show, as the page keeps it (JSON)."""
    return [asdict(tile) for tile in shown]


def shown_at(data: list[dict], position: int) -> Shown:
    """The tile at a gallery position, from the data kept beside the gallery."""
    return Shown(**data[position])


def marks(shown: list[Shown]) -> str:
    """The data the page script marks the result tiles with (hit or miss, hover text), in gallery order."""
    data = html.escape(json.dumps(as_data(shown)), quote=True)
    return f'<div id="result-data" data-tiles="{data}" style="display:none"></div>'


def metrics_rows(metrics: dict | None) -> list[list[str]]:
    """Returns a metrics dict (metrics.json) as rows of (metric, value) for a table."""
    if not metrics:
        return [["(no metrics yet)", "run `retrieval evaluate RUN IMAGES`, or press Evaluate"]]
    return [[key, metric_text(key, value)] for key, value in metrics.items() if not isinstance(value, (dict, list))]


def metric_text(key: str, value: object) -> str:
    """One metric's value as the table shows it: floats to four places, and the count of images the run trained on
    with what it means."""
    if key == TRAINED:
        return f"{value:,}: these figures flatter the model"
    if isinstance(value, float):
        return f"{value:.4f}"
    return str(value)


def run_plots(service: SearchService) -> list[tuple[str, str]]:
    """The run's plots (training curves, evaluation plots), copied into the app's cache: the only folder it serves."""
    sources = (
        [service.run.loss_plot, *sorted(service.run.plots.glob("*.png"))]
        if service.run.plots.is_dir()
        else [service.run.loss_plot]
    )
    shown = []
    for source in sources:
        if source.is_file():
            target = service.cache / "run-plots" / source.name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, target)
            shown.append((str(target), source.stem.replace("_", " ")))
    return shown


def confusion_rows(metrics: dict | None) -> list[list]:
    """A metric set's class pairs most often confused (retrieval.mistakes) as table rows."""
    return [
        [pair["label"], pair["confused_with"], pair["count"], pair["queries"]]
        for pair in (metrics or {}).get("confusions", [])
    ]


def class_rows(metrics: dict | None) -> list[list]:
    """A metric set's per-class table (retrieval.mistakes) as rows: label, queries, recall@1, MAP@R, confused with."""
    return [
        [row["label"], row["queries"], round(row["recall@1"], 3), round(row["map@r"], 3), row["confused_with"] or ""]
        for row in (metrics or {}).get("classes", [])
    ]


def _key(path: str) -> str:
    """A thumbnail's cache name for a file named in a metric set (whose content digest is not kept there)."""
    return hashlib.sha256(f"path:{path}".encode()).hexdigest()


def parse_ids(text: str) -> list[int]:
    """Item ids from text such as "3, 7 12"."""
    words = re.split(r"[\s,;]+", str(text).strip())
    if not words or not all(word.isdigit() for word in words):
        raise RetrievalError(
            f"{text!r}: give item ids as numbers separated by commas or spaces (ids are shown in the captions)"
        )
    return [int(word) for word in words]


# what a search shows: the result tiles, the summary, what each tile shows (data) and its marks for the page script
Searched = tuple[Tiles, str, list[dict], str]
Picked = tuple[str, str, gr.Tabs, Tiles, str, list[dict], str]  # a pick: the query, its label, the tab, its search


class Handlers:
    """The app's event handlers over one search service: each formats what the service (and index/ beneath it) returns.

    Bound methods, so that Gradio reads their parameters (and SelectData, Progress) from their signatures.
    """

    def __init__(self, service: SearchService) -> None:
        self.service = service

    def search_batch(
        self,
        image: list[str | None],
        k: list[float],
        label: list[str | None],
        depth: list[float | None],
        only: list[bool],
    ) -> tuple[list, list, list, list, list]:
        """Batched: Gradio hands over the requests that queued up together, one list per input (the API's names); their
        queries go to the batcher together (with the API's that arrive meanwhile). Beside each search's parts, whether
        its query image was unreadable (clear_unreadable takes it out of the query box)."""
        pending = [
            self._submit(path, self._query(n, d, (name or None) if alone else None)) if path else None
            for path, n, name, d, alone in zip(image, k, label, depth, only)
        ]
        results = [future.result() if future else None for future in pending]
        answers = [
            self._shown(result, name or "") if result else ([], NO_QUERY, [], marks([]))
            for result, name in zip(results, label)
        ]
        unreadable = [
            bool(result and result.error and result.error.kind is ErrorKind.UNREADABLE_IMAGE) for result in results
        ]
        return (*([answer[part] for answer in answers] for part in range(4)), unreadable)  # type: ignore[return-value]

    @staticmethod
    def clear_unreadable(unreadable: bool) -> object:
        """Empties the query box after a search whose image could not be read (it showed a broken image beside the
        message), and leaves it as it is otherwise."""
        return None if unreadable else gr.skip()

    def search(self, image: str | None, k: float, label: str | None, depth: float | None, only: bool) -> Searched:
        """One image query, as the batched event answers it."""
        galleries, summaries, data, shown, _ = self.search_batch([image], [k], [label], [depth], [only])
        return galleries[0], summaries[0], data[0], shown[0]

    def _query(self, k: float, depth: float | None, only: str | None = None) -> Query:
        """A query as the app's fields give it (k, depth 0: the tuned one), re-ranked as the server was started."""
        return self.service.query(int(k or 10), int(depth) if depth else None, only)

    def _submit(self, path: str, query: Query) -> Future:
        try:
            read = read_image_bytes(Path(path))
            image: ImageQuery | Failure = ImageQuery(Path(path).name, read.data, read.sha256)
        except ImageError as error:
            image = Failure.of(error)
        return self.service.batcher.submit(image, query)

    def _shown(self, result: QueryResult, label: str) -> Searched:
        worded_result = worded(result, label, self.service.snapshot.labels)
        tiles, shown = result_tiles(self.service, worded_result)
        return tiles, worded_result.summary + lost_note(tiles, worded_result.hits), as_data(shown), marks(shown)

    def search_id(self, item_id: float, k: float, depth: float | None) -> Searched:
        result = self.service.search_item(int(item_id), int(k), int(depth) if depth else None)
        if result.failure is not None:
            raise refused(result.failure.message)
        tiles, shown = result_tiles(self.service, result)
        return tiles, result.summary + lost_note(tiles, result.hits), as_data(shown), marks(shown)

    def choose(self, item_id: int) -> tuple[str, str]:
        """The item's file (a copy in the cache: same bytes, so the search leaves it out) and its label."""
        item = self.service.items[item_id]
        target = self.service.cache / "queries" / f"{item_id}{item.path.suffix.lower()}"
        if not target.is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                shutil.copyfile(item.path, target)
            except OSError as error:
                raise refused(f"{item.path}: cannot be read ({error.strerror or error})") from None
        return str(target), item.label

    def pick(self, data: list[dict], k: float, depth: float | None, only: bool, event: gr.SelectData) -> Picked:
        """A tile clicked: its item becomes the query (with its label) and is searched with."""
        return self._picked(shown_at(data, int(event.index)).id, k, depth, only)

    def pick_on_map(
        self, projection: str, highlight: str | None, k: float, depth: float | None, only: bool, event: gr.SelectData
    ) -> Picked:
        """A point of the map clicked: its item is searched with; a click between points only says so."""
        x, y = event.index
        item_id = self.service.embedding_map(projection, highlight or None).pick(float(x), float(y))
        if item_id is None:
            gr.Info(MISSED_POINT)
            return tuple(gr.skip() for _ in range(7))  # type: ignore[return-value]  # nothing changes anywhere
        return self._picked(item_id, k, depth, only)

    def _picked(self, item_id: int, k: float, depth: float | None, only: bool) -> Picked:
        path, label = self.choose(item_id)
        future = self._submit(path, self._query(k, depth, label if only and label else None))
        tiles, summary, data, page = self._shown(future.result(), label)
        fresh = gr.Gallery(value=tiles, selected_index=None)  # the tile clicked is not left selected in the new results
        return path, label, gr.Tabs(selected="search"), fresh, summary, data, page  # type: ignore[return-value]

    def label_table(self) -> list[list]:
        return [[label or "(unlabeled)", count] for label, count in self.service.label_counts()]

    def browse(self, label: str | None) -> tuple[Tiles, list[dict]]:
        tiles, shown = item_tiles(self.service, self.service.browse(label or None), labelled=not label)
        return tiles, as_data(shown)

    def evaluate(self, progress: gr.Progress = gr.Progress()) -> tuple[list[list[str]], list[tuple[str, str]]]:
        try:
            evaluated = self.service.evaluate_now(lambda fraction, text: progress(fraction, desc=text))
        except RetrievalError as error:
            raise refused(str(error)) from None
        plots = [(str(path), path.stem.replace("_", " ")) for path in evaluated.plots]
        return metrics_rows(evaluated.evaluation.metrics), plots

    def metric_set(self, name: str) -> tuple[list[list[str]], str]:
        """One evaluated set's metrics as table rows, and where they come from."""
        return metrics_rows(self.service.metric_sets.get(name)), self.metric_source(name)

    def mistakes(self, name: str) -> tuple[list[list], list[list]]:
        """One evaluated set's confused class pairs and per-class table as rows (empty for sets evaluated before
        they were kept)."""
        return confusion_rows(self.service.metric_sets.get(name)), class_rows(self.service.metric_sets.get(name))

    def class_view(self, name: str, event: gr.SelectData) -> tuple[Tiles, str]:
        """The queries of the class whose row was clicked, each beside its first hit."""
        metrics = self.service.metric_sets.get(name) or {}
        label = str(event.row_value[0]) if event.row_value else ""
        found = [hit for hit in metrics.get("first_hits", []) if hit["label"] == label]
        right = sum(hit["hit_label"] == label for hit in found)
        return (
            self._first_hit_tiles(found[:CLASS_VIEW], label),
            f"**{as_text(label)}**: {counted(len(found), 'query', 'queries')}, {right} with a first hit of their class "
            "(query, then its first hit)",
        )

    def confusion_view(self, name: str, event: gr.SelectData) -> tuple[Tiles, str]:
        """The queries of the class pair whose row was clicked: those of its label whose first hit has the other
        label, each beside that hit."""
        metrics = self.service.metric_sets.get(name) or {}
        label, other = (str(value) for value in event.row_value[:2]) if event.row_value else ("", "")
        queries = [hit for hit in metrics.get("first_hits", []) if hit["label"] == label]
        found = [hit for hit in queries if hit["hit_label"] == other]
        return (
            self._first_hit_tiles(found[:CLASS_VIEW], label),
            f"**{as_text(label)}** taken for **{as_text(other)}**: {len(found)} of its "
            f"{counted(len(queries), 'query', 'queries')} (query, then the hit it was taken for)",
        )

    def _first_hit_tiles(self, found: list[dict], label: str) -> Tiles:
        """Each query of found (a metric set's first_hits) beside its first hit, marked HIT or miss against label."""
        tiles: Tiles = []
        for hit in found:
            tiles.append(
                (str(self.service.thumbnail(hit["query"], _key(hit["query"]))), f"query · {Path(hit['query']).name}")
            )
            if hit["hit"] is not None:
                mark = "HIT" if hit["hit_label"] == label else "miss"
                caption = f"{mark} · {hit['score']:.3f} · {hit['hit_label']}"
                tiles.append((str(self.service.thumbnail(hit["hit"], _key(hit["hit"]))), caption))
        return tiles

    def metric_source(self, name: str) -> str:
        """A line saying what a set of metrics was measured on: protocol, images, query count."""
        metrics = self.service.metric_sets.get(name)
        if not metrics:
            return "No evaluation yet: run `retrieval evaluate RUN IMAGES`, or evaluate the index below."
        where = metrics.get("images") or f"{metrics.get('queries', '')} against {metrics.get('gallery', '')}"
        line = f"**{as_text(name)}**: {as_text(str(metrics.get('protocol', '')))} over `{where}`, "
        line += f"{metrics.get('num_queries', '?')} queries"
        if metrics.get(TRAINED):  # its figures flatter the model, as `retrieval evaluate` said
            trained = f"{metrics[TRAINED]:,} of these images are images the run trained on"
            line += f"  \n**{trained}**: its figures there flatter it"
        baseline = self.service.baseline
        if baseline and baseline.get("images") == metrics.get("images"):
            figures = ", ".join(f"{key} {baseline[key]:.3f}" for key in ("recall@1", "recall@5", "map@r"))
            line += f"  \nRaw pixels (16×16 grey, the demo's baseline) on the same images: {figures}"
        return line

    def embedding_map(self, projection: str) -> str:
        return str(self.service.embedding_map(projection).image)

    def map_view(self, projection: str, highlight: str | None) -> tuple[str, str]:
        """The map with its label highlighted, and each point's pixel, label and file for the pointer's tooltip."""
        shown = self.service.embedding_map(projection, highlight or None)
        items = self.service.items
        points = [
            [round(float(x), 1), round(float(y), 1), f"{items[int(i)].label} · {items[int(i)].path.name} · id {int(i)}"]
            for i, (x, y) in zip(shown.ids, shown.pixels)
            if int(i) in items
        ]
        data = html.escape(json.dumps(points), quote=True)
        return str(shown.image), f'<div id="map-points" data-points="{data}" style="display:none"></div>'

    def label_of_row(self, event: gr.SelectData) -> str:
        """The label of the row clicked in the labels table (the Browse tab then shows its items)."""
        row = event.index[0] if isinstance(event.index, (list, tuple)) else event.index
        label = self.label_table()[int(row)][0]
        return "" if label == "(unlabeled)" else label

    def add(self, files: list[str] | None, label: str | None) -> tuple[str, list[list]]:
        if not files:
            raise refused("choose one or more image files to add")
        try:
            added = self.service.add_images(files, label or "")
        except RetrievalError as error:
            raise refused(str(error)) from None
        ids = added.ids
        message = f"added {counted(len(ids), 'image')}" + (f" (ids {ids[0]}–{ids[-1]})" if ids else "")
        if added.skipped:
            message += "; left out: " + "; ".join(f"{s.path.name}: {s.reason}" for s in added.skipped)
        return message, self.label_table()

    def remove(self, ids: str) -> tuple[str, list[list]]:
        try:
            removed = self.service.remove_items(parse_ids(ids))
        except RetrievalError as error:
            raise refused(str(error)) from None
        return f"removed {counted(removed, 'item')}", self.label_table()

    def add_on_page(self, files: list[str] | None, label: str | None) -> tuple[str, object]:
        """add, for the page's button: a refusal is said beside the button and the labels table stays (an error
        replaced it with the word "Error" until the next change); the API's /add still fails with the message."""
        return _said_on_page(lambda: self.add(files, label))

    def remove_on_page(self, ids: str) -> tuple[str, object]:
        """remove, for the page's button: a refusal said beside it, the labels table kept."""
        return _said_on_page(lambda: self.remove(ids))


def _said_on_page(change: Callable[[], tuple[str, list[list]]]) -> tuple[str, object]:
    """A change's message and labels table, or its refusal (in bold) and the table left as it is."""
    try:
        return change()
    except gr.Error as error:
        return f"**not done:** {as_text(str(error.message))}", gr.skip()
