"""The Gradio search app over a SearchService, one builder per tab, and its launch settings.

API (gradio_client, endpoint names and parameter names are stable):
  /search         (image, k, label, depth, only) -> (results, summary)   batched: concurrent queries share one
                  embedding call; label marks hits, only=True keeps items of that label alone
  /search_id      (item_id, k, depth)  -> (results, summary)
  /labels         ()                   -> table of label, count
  /browse         (label)              -> gallery of that label's items
  /evaluate       ()                   -> (metrics table, plots)
  /embedding_map  (projection)         -> map image
  /add            (files, label)       -> message   (only with --allow-write)
  /remove         (ids)                -> message   (only with --allow-write)
Results are a gallery of (image, caption); a caption reads "HIT · #1 · 0.912 · label · file · id 42".
"""

from __future__ import annotations

import ctypes
import ctypes.util
import html
import inspect
import ipaddress
import json
import logging
import os
import re
import shutil
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gradio as gr

from app.service import BROWSE_LIMIT, SearchResult, SearchService
from retrieval.errors import RetrievalError
from retrieval.rerank import NO_RERANK, Rerank
from retrieval.runs import RunDir

log = logging.getLogger("retrieval.app")
MAX_BATCH = 16  # concurrent search requests embedded in one call
AUTH_VARIABLE = "RETRIEVAL_AUTH"  # user:password, instead of --auth on the command line
CAPTION_ID = re.compile(r"· id (\d+)$")
ANALYTICS_EVENTS = (
    500  # Gradio keeps this many finished events for its monitoring page (its default, 10,000, is ~10 MiB of dicts)
)
TRIM_VARIABLE = "RETRIEVAL_TRIM_SECONDS"  # how often freed heap memory is handed back to the system (0: never)
TRIM_SECONDS = 10.0
_trimmer: threading.Thread | None = None  # one per process, however many apps it launches


# Captions wrap instead of being cut; a hit is framed green, a miss red; a result clicked (searched with) is not left
# highlighted in the results it brings; the map names the point under the pointer.
CSS = """
#results .caption-label {
    white-space: normal !important; overflow: visible !important; text-overflow: clip !important;
    max-width: 100% !important;
}
#results .thumbnail-item.selected {
    --ring-color: transparent !important; border-color: var(--border-color-primary) !important;
}
.thumbnail-item.result-hit { outline: 4px solid #16a34a; outline-offset: -4px; }
.thumbnail-item.result-miss { outline: 4px solid #dc2626; outline-offset: -4px; }
#map-tooltip { position: fixed; z-index: 1000; pointer-events: none; background: #111827; color: white;
    padding: 2px 6px; border-radius: 4px; font-size: 12px; display: none; }
"""
HEAD = """
<script>
(() => {
  const mark = () => document.querySelectorAll("#results .thumbnail-item").forEach((item) => {
    const caption = (item.querySelector(".caption-label") || {}).textContent || "";
    item.classList.toggle("result-hit", caption.startsWith("HIT"));
    item.classList.toggle("result-miss", caption.startsWith("miss"));
  });
  new MutationObserver(mark).observe(document.documentElement, {subtree: true, childList: true, characterData: true});
  document.addEventListener("mousemove", (event) => {
    let tip = document.getElementById("map-tooltip");
    if (!tip) { tip = document.createElement("div"); tip.id = "map-tooltip"; document.body.appendChild(tip); }
    const image = event.target.closest ? event.target.closest("#map img") : null;
    const data = document.getElementById("map-points");
    if (!image || !data || !image.naturalWidth) { tip.style.display = "none"; return; }
    const box = image.getBoundingClientRect();
    const x = (event.clientX - box.left) * image.naturalWidth / box.width;
    const y = (event.clientY - box.top) * image.naturalHeight / box.height;
    let best = null, distance = 144;
    for (const [px, py, text] of JSON.parse(data.dataset.points)) {
      const gap = (px - x) ** 2 + (py - y) ** 2;
      if (gap < distance) { distance = gap; best = text; }
    }
    tip.textContent = best || "";
    tip.style.display = best ? "block" : "none";
    tip.style.left = `${event.clientX + 12}px`;
    tip.style.top = `${event.clientY + 12}px`;
    image.title = best || "";
  });
})();
</script>
"""


STYLE = {"css": CSS, "head": HEAD}
STYLE_AT_LAUNCH = "css" in inspect.signature(gr.Blocks.launch).parameters  # Gradio 6 takes them there, 5 in Blocks()


class QueryImage(gr.Image):
    """gr.Image that hands over the uploaded file untouched instead of opening it with Pillow first.

    The search decodes it with retrieval.data.decode_image (size limits, 16-bit, CMYK, animation), so
    a bad upload ends in that readable message for its own query only; Gradio's own check would raise
    and fail every query batched with it.
    """

    is_template = True  # drawn by the frontend's Image component

    def preprocess(self, payload: object) -> str | None:
        if payload is None or getattr(payload, "path", None) is None:
            return super().preprocess(payload)  # type: ignore[arg-type]  # None, or a base64 data URL
        return str(payload.path)  # type: ignore[attr-defined]


def refused(message: str) -> gr.Error:
    """The error a refused request gets: its message to the user, and one line (not a traceback) in the server's log."""
    log.warning("refused a request: %s", message)
    return gr.Error(message, print_exception=False)


# Two classes, not one mixin: Gradio finds the frontend of a template component through its first base class.
class BoundedSlider(gr.Slider):
    """gr.Slider whose out-of-range values (an API call with k=0) are refused in one log line, not a traceback."""

    is_template = True  # drawn by the frontend's Slider component

    def preprocess(self, payload: float) -> float:
        return quietly(super().preprocess, payload)


class BoundedNumber(gr.Number):
    """gr.Number whose out-of-range values are refused in one log line, not a traceback."""

    is_template = True  # drawn by the frontend's Number component

    def preprocess(self, payload: float | None) -> float | int | None:
        return quietly(super().preprocess, payload)


def quietly(preprocess: Callable[[Any], Any], payload: Any) -> Any:
    """A component's preprocessing, with its range error refused in one log line."""
    try:
        return preprocess(payload)
    except gr.Error as error:
        raise refused(error.message) from None


def result_gallery(service: SearchService, result: SearchResult) -> list[tuple[str, str]]:
    """Gallery entries (thumbnail, caption): hit/miss when the label is known, rank, score, label, file, id."""
    entries = []
    for rank, hit in enumerate(result.hits, 1):
        mark = "" if not result.label else ("HIT · " if hit.label == result.label else "miss · ")
        entries.append(
            (
                str(service.thumbnail(hit.path, hit.sha256)),
                f"{mark}#{rank} · {hit.score:.3f} · {hit.label} · {Path(hit.path).name} · id {hit.id}",
            )
        )
    return entries


def item_gallery(service: SearchService, ids: list[int]) -> list[tuple[str, str]]:
    """Gallery entries (thumbnail, caption) of indexed items: label, file name, id."""
    items = service.items
    return [
        (str(thumbnail), f"{items[i].label} · {items[i].path.name} · id {i}")
        for i, thumbnail in zip(ids, service.thumbnails(ids))
    ]


def metrics_rows(metrics: dict | None) -> list[list[str]]:
    """Returns a metrics dict (metrics.json) as rows of (metric, value) for a table."""
    if not metrics:
        return [["(no metrics yet)", "run `retrieval evaluate RUN IMAGES`, or press Evaluate"]]
    return [
        [key, f"{value:.4f}" if isinstance(value, float) else str(value)]
        for key, value in metrics.items()
        if not isinstance(value, (dict, list))
    ]


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


def caption_id(caption: str | None) -> int:
    """The item id at the end of a gallery caption."""
    match = CAPTION_ID.search(caption or "")
    if match is None:
        raise refused("this image is not an indexed item")
    return int(match.group(1))


def parse_ids(text: str) -> list[int]:
    """Item ids from text such as "3, 7 12"."""
    words = re.split(r"[\s,;]+", str(text).strip())
    if not words or not all(word.isdigit() for word in words):
        raise RetrievalError(
            f"{text!r}: give item ids as numbers separated by commas or spaces (ids are shown in the captions)"
        )
    return [int(word) for word in words]


@dataclass
class SearchTab:
    """The Search tab's components, which the other tabs send their picks to."""

    query: gr.Image
    query_label: gr.Dropdown
    only_label: gr.Checkbox
    k: gr.Slider
    depth: gr.Number
    results: gr.Gallery
    summary: gr.Markdown
    picker: gr.Gallery

    @property
    def inputs(self) -> list:
        return [self.query, self.k, self.query_label, self.depth, self.only_label]

    @property
    def outputs(self) -> list:
        return [self.results, self.summary]


def build_app(service: SearchService, max_batch: int = MAX_BATCH) -> gr.Blocks:
    """Returns the Gradio interface over a search service; up to max_batch queued searches share one embedding call."""
    labels = sorted(label for label, _ in service.label_counts() if label)
    concurrency = max(1, (os.cpu_count() or 1) // service.threads)  # embedding calls that fit the cores side by side
    on = Handlers(service)
    searching = {
        "batch": True,
        "max_batch_size": max_batch,
        "concurrency_limit": concurrency,
        "concurrency_id": "embed",
    }
    with gr.Blocks(title="retrieval · image search", **({} if STYLE_AT_LAUNCH else STYLE)) as demo:
        gr.Markdown(
            "# Image search\nRun "
            f"`{service.run.root}` · "
            f"{len(service.index):,} gallery "
            f"images · {len(labels)} labels · "
            f"{service.index.manifest.get('index_type', 'Flat')} index"
            + ("" if service.allow_write else " · read-only")
        )
        with gr.Tabs() as tabs:
            with gr.Tab("Search", id="search"):
                tab = search_tab(on, labels, searching)
            with gr.Tab("Browse", id="browse"):
                browsed = browse_tab(on, labels)
            with gr.Tab("Metrics", id="metrics"):
                metrics_tab(on)
            with gr.Tab("Embedding map", id="map"):
                map_image, shown_map = map_tab(on, labels)
        for gallery in (tab.results, tab.picker, browsed):
            picked = gallery.select(on.pick, None, [tab.query, tab.query_label, tabs], api_name=False)
            picked.then(on.search_batch, tab.inputs, tab.outputs, api_name=False, **searching)
        picked = map_image.select(on.pick_on_map, shown_map, [tab.query, tab.query_label, tabs], api_name=False)
        picked.then(on.search_batch, tab.inputs, tab.outputs, api_name=False, **searching)
    return demo


def search_tab(on: Handlers, labels: list[str], searching: dict) -> SearchTab:
    """The query (image, label, k, depth), the results, and one image per label to start from."""
    service = on.service
    kind = service.index.kind
    depth_name = {"ivf": "nprobe", "hnsw": "efSearch"}.get(kind, "depth")
    tuned = service.index.manifest.get("search", {}).get(depth_name, "")
    with gr.Row():
        with gr.Column(scale=1):
            query = QueryImage(
                label="Query image",
                type="filepath",
                sources=["upload", "clipboard"],
                image_mode=None,
                height=256,
                elem_id="query",
            )
            query_label = gr.Dropdown(
                labels, value="", label="Query label (optional: marks hits and misses)", allow_custom_value=True
            )
            only_label = gr.Checkbox(False, label="Only gallery items with the query label")
            k = BoundedSlider(1, 50, value=10, step=1, label="k")
            tuned_text = f"0: the tuned {tuned}" if tuned != "" else "0: as tuned when the index was built"
            depth = BoundedNumber(
                value=0, precision=0, minimum=0, label=f"{depth_name} ({tuned_text})", visible=kind != "flat"
            )
            button = gr.Button("Search", variant="primary", elem_id="search")
        with gr.Column(scale=2):
            summary = gr.Markdown(elem_id="summary")
            results = gr.Gallery(
                label="Nearest neighbours (click one to search with it)",
                columns=5,
                height=480,
                object_fit="contain",
                allow_preview=False,
                elem_id="results",
            )
    picker = gr.Gallery(
        value=item_gallery(service, service.samples()),
        label="One image per label (click to search with it)",
        elem_id="picker",
        columns=10,
        height=300,
        allow_preview=False,
    )
    tab = SearchTab(query, query_label, only_label, k, depth, results, summary, picker)
    button.click(on.search_batch, tab.inputs, tab.outputs, api_name="search", **searching)
    item_id = gr.Number(visible=False, precision=0)
    gr.Button(visible=False).click(on.search_id, [item_id, k, depth], tab.outputs, api_name="search_id")
    return tab


def browse_tab(on: Handlers, labels: list[str]) -> gr.Gallery:
    """Labels with their counts, one label's items, add and remove (--allow-write); returns the gallery."""
    service = on.service
    with gr.Row():
        with gr.Column(scale=1):
            counts = gr.Dataframe(
                on.label_table(),
                headers=["label", "items"],
                interactive=False,
                label="Labels (click one to browse it)",
                column_widths=["75%", "25%"],
                elem_id="labels",
            )
        with gr.Column(scale=2):
            first = next((label for label, _ in service.label_counts() if label), None)  # the table's first row
            browse_label = gr.Dropdown(
                labels, value=first, label=f"Label (up to {BROWSE_LIMIT} shown; click an image to search with it)"
            )
            browsed = gr.Gallery(
                on.browse(first) if first else None,
                label="Items",
                columns=8,
                height=420,
                allow_preview=False,
                elem_id="browsed",
            )
    with gr.Group(visible=service.allow_write):
        gr.Markdown("### Add and remove (started with `--allow-write`)")
        with gr.Row():
            uploads = gr.File(file_count="multiple", file_types=["image"], label="Images to add")
            with gr.Column():
                new_label = gr.Textbox(label="Their label")
                add_button = gr.Button("Add to the index")
                remove_ids = gr.Textbox(label="Ids to remove (from the captions)", placeholder="3, 7, 12")
                remove_button = gr.Button("Remove from the index", variant="stop")
        write_message = gr.Markdown()
    gr.Button(visible=False).click(on.label_table, None, counts, api_name="labels")
    browse_label.change(on.browse, browse_label, browsed, api_name="browse")
    counts.select(on.label_of_row, None, browse_label, api_name=False)
    if service.allow_write:
        add_button.click(on.add, [uploads, new_label], [write_message, counts], api_name="add", concurrency_limit=1)
        remove_button.click(on.remove, remove_ids, [write_message, counts], api_name="remove", concurrency_limit=1)
    return browsed


def metrics_tab(on: Handlers) -> None:
    """The metrics of each set the run was evaluated on (one to choose), its plots, and the index evaluated now."""
    service = on.service
    names = list(service.metric_sets) or ["(none)"]
    with gr.Row():
        with gr.Column():
            chosen = gr.Dropdown(
                names, value=names[0], label="Evaluated set (`retrieval evaluate RUN IMAGES` adds one)"
            )
            source = gr.Markdown(on.metric_source(names[0]))
            table = gr.Dataframe(
                metrics_rows(service.metric_sets.get(names[0])), headers=["metric", "value"], interactive=False
            )
        gr.Gallery(
            value=run_plots(service),
            label="Plots of the run (its latest evaluation)",
            columns=2,
            height="auto",
            object_fit="contain",
            elem_id="run-plots",
        )
    chosen.change(on.metric_set, chosen, [table, source], api_name=False)
    evaluate_button = gr.Button("Evaluate the index's labeled items now (leave-one-out)")
    with gr.Row():
        evaluated = gr.Dataframe(headers=["metric", "value"], interactive=False, label="Evaluation of the index")
        evaluated_plots = gr.Gallery(label="Its plots", columns=2, height="auto", object_fit="contain")
    evaluate_button.click(on.evaluate, None, [evaluated, evaluated_plots], api_name="evaluate", concurrency_limit=1)


def map_tab(on: Handlers, labels: list[str]) -> tuple[gr.Image, list]:
    """The gallery's embeddings in 2-D, the label and file under the pointer, one label to highlight; returns the
    map (a click on it searches) and the inputs that say which map is shown."""
    with gr.Row():
        projection = gr.Radio(["pca", "tsne"], value="pca", label="Projection")
        highlight = gr.Dropdown(
            labels, value=None, label="Highlight a label (type to find it)", allow_custom_value=False
        )
    draw = gr.Button("Draw the map")
    map_image = gr.Image(
        label="Gallery embeddings (point at a dot to see its label and file; click it to search with it)",
        interactive=False,
        type="filepath",
        elem_id="map",
    )
    points = gr.HTML(elem_id="map-points-holder")
    drawn = draw.click(on.embedding_map, projection, map_image, api_name="embedding_map", concurrency_limit=1)
    drawn.then(on.map_view, [projection, highlight], [map_image, points], api_name=False, concurrency_limit=1)
    highlight.change(on.map_view, [projection, highlight], [map_image, points], api_name=False, concurrency_limit=1)
    return map_image, [projection, highlight]


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
    ) -> tuple[list, list]:
        """Batched: Gradio hands over the requests that queued up together, one list per input (the API's names)."""
        given = [position for position, path in enumerate(image) if path]
        results = self.service.search_images(
            [image[p] for p in given],  # type: ignore[misc]
            [int(k[p] or 10) for p in given],
            [label[p] or "" for p in given],
            [int(depth[p]) if depth[p] else None for p in given],  # type: ignore[arg-type]
            [(label[p] or None) if only[p] else None for p in given],
        )
        answers: list[tuple[list, str]] = [([], "Upload or paste an image, or click one in a gallery.")] * len(image)
        for position, result in zip(given, results):
            answers[position] = (result_gallery(self.service, result), result.summary)
        return [gallery for gallery, _ in answers], [summary for _, summary in answers]

    def search_id(self, item_id: float, k: float, depth: float | None) -> tuple[list, str]:
        try:
            result = self.service.search_item(int(item_id), int(k), int(depth) if depth else None)
        except RetrievalError as error:
            raise refused(str(error)) from None
        return result_gallery(self.service, result), result.summary

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

    def pick(self, event: gr.SelectData) -> tuple[str, str, gr.Tabs]:
        path, label = self.choose(caption_id((event.value or {}).get("caption")))
        return path, label, gr.Tabs(selected="search")

    def pick_on_map(self, projection: str, highlight: str | None, event: gr.SelectData) -> tuple[str, str, gr.Tabs]:
        x, y = event.index
        item_id = self.service.embedding_map(projection, highlight or None).pick(float(x), float(y))
        if item_id is None:
            raise refused("no gallery item there: click on a point")
        path, label = self.choose(item_id)
        return path, label, gr.Tabs(selected="search")

    def label_table(self) -> list[list]:
        return [[label or "(unlabeled)", count] for label, count in self.service.label_counts()]

    def browse(self, label: str | None) -> list[tuple[str, str]]:
        return item_gallery(self.service, self.service.browse(label or None))

    def evaluate(self, progress: gr.Progress = gr.Progress()) -> tuple[list[list[str]], list[tuple[str, str]]]:
        try:
            evaluation, plots = self.service.evaluate_now(lambda fraction, text: progress(fraction, desc=text))
        except RetrievalError as error:
            raise refused(str(error)) from None
        return metrics_rows(evaluation.metrics), [(str(path), path.stem.replace("_", " ")) for path in plots]

    def metric_set(self, name: str) -> tuple[list[list[str]], str]:
        """One evaluated set's metrics as table rows, and where they come from."""
        return metrics_rows(self.service.metric_sets.get(name)), self.metric_source(name)

    def metric_source(self, name: str) -> str:
        """A line saying what a set of metrics was measured on: protocol, images, query count."""
        metrics = self.service.metric_sets.get(name)
        if not metrics:
            return "No evaluation yet: run `retrieval evaluate RUN IMAGES`, or evaluate the index below."
        where = metrics.get("images") or f"{metrics.get('queries', '')} against {metrics.get('gallery', '')}"
        return f"**{name}**: {metrics.get('protocol', '')} over `{where}`, {metrics.get('num_queries', '?')} queries"

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
            ids, skipped = self.service.add_images(files, label or "")
        except RetrievalError as error:
            raise refused(str(error)) from None
        message = f"added {len(ids)} image(s)" + (f" (ids {ids[0]}–{ids[-1]})" if ids else "")
        if skipped:
            message += "; left out: " + "; ".join(f"{s.path.name}: {s.reason}" for s in skipped)
        return message, self.label_table()

    def remove(self, ids: str) -> tuple[str, list[list]]:
        try:
            removed = self.service.remove_items(parse_ids(ids))
        except RetrievalError as error:
            raise refused(str(error)) from None
        return f"removed {removed} item(s)", self.label_table()


def loopback(host: str) -> bool:
    """Whether host only accepts connections from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse_auth(auth: str | None) -> tuple[str, str] | None:
    """user:password from --auth or the RETRIEVAL_AUTH variable; None when neither is set."""
    value = auth or os.environ.get(AUTH_VARIABLE)
    if not value:
        return None
    user, colon, password = value.partition(":")
    if not colon or not user or not password:
        raise RetrievalError(f"--auth / {AUTH_VARIABLE}: give user:password (both non-empty)")
    return user, password


def release_memory_periodically(every: float | None = None) -> threading.Thread | None:
    """Hands the memory that concurrent requests freed back to the system every few seconds (glibc's malloc_trim).

    The server's threads decode uploads, embed and answer side by side; glibc keeps what they free in
    per-thread arenas, so without this the resident memory climbs for many minutes under load
    (bench/app_load.py --mixed). Every RETRIEVAL_TRIM_SECONDS seconds (default 10; 0: never). Not
    glibc (macOS, musl): nothing to do, returns None. One thread per process: later calls return it.
    """
    global _trimmer
    if _trimmer is not None:
        return _trimmer
    if every is None:
        try:
            every = float(os.environ.get(TRIM_VARIABLE, TRIM_SECONDS))
        except ValueError:
            raise RetrievalError(
                f"{TRIM_VARIABLE}={os.environ[TRIM_VARIABLE]!r}: give a number of seconds (0: never)"
            ) from None
    if every <= 0:
        return None
    name = ctypes.util.find_library("c")
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    if trim is None:
        return None

    def loop() -> None:
        while True:
            time.sleep(every)
            trim(0)

    _trimmer = threading.Thread(target=loop, name="malloc-trim", daemon=True)
    _trimmer.start()
    return _trimmer


class Server:
    """The app and the JSON API on one uvicorn server, in a thread of this process."""

    def __init__(self, app: object, host: str, port: int) -> None:
        import uvicorn

        self.url = f"http://{host}:{port}"
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False, lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)

    def start(self, port: int, host: str) -> None:
        """Starts serving; refuses a port that was taken between the check and the start."""
        self.server.install_signal_handlers = lambda: None  # type: ignore[method-assign]  # Ctrl+C is the main thread's
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RetrievalError(f"port {port} on {host} is in use; give another with --port")
            time.sleep(0.02)

    def close(self) -> None:
        """Stops the server and waits for it (at most a few seconds)."""
        self.server.should_exit = True
        self.thread.join(timeout=10)


def launch(
    service: SearchService,
    host: str = "127.0.0.1",
    port: int = 7860,
    auth: str | None = None,
    max_upload: str = "20MB",
    block: bool = True,
    max_batch: int = MAX_BATCH,
) -> Server:
    """Starts the app and the JSON API on host:port: auth off loopback, uploads capped, only the app's cache served."""
    from app.api import build_api

    credentials = parse_auth(auth)
    if credentials is None and not loopback(host):
        raise RetrievalError(
            f"--host {host} lets other machines reach the app: give --auth "
            f"user:password (or set {AUTH_VARIABLE}), or bind 127.0.0.1"
        )
    os.environ.setdefault("GRADIO_ANALYTICS_MAX_EVENTS", str(ANALYTICS_EVENTS))  # read when the queue is made
    demo = build_app(service, max_batch)
    release_memory_periodically()
    api = build_api(service, credentials, max_upload, max_batch)
    settings = {"auth": credentials, "allowed_paths": [str(service.cache)], "max_file_size": max_upload.lower()}
    settings.update(STYLE if STYLE_AT_LAUNCH else {})
    demo.queue(default_concurrency_limit=1)
    app = gr.mount_gradio_app(api, demo, path="", show_error=True, **settings)
    server = Server(app, host, port)
    server.start(port, host)
    if block:
        wait_until_stopped(server)
    return server


def wait_until_stopped(server: Server) -> None:
    """Says where the app is and serves until Ctrl+C (or SIGTERM, turned into it), then closes the server."""
    print(f"serving the search app at {server.url}, its JSON API at {server.url}/docs  (Ctrl+C to stop)", flush=True)
    try:
        while True:
            time.sleep(0.5)
    finally:
        server.close()


def stop_like_ctrl_c(signum: int, frame: object) -> None:
    """SIGTERM handler: stops the server the way Ctrl+C does, so that the cleanup after it runs."""
    raise KeyboardInterrupt


def serve(
    run: RunDir,
    host: str = "127.0.0.1",
    port: int = 7860,
    index_dir: Path | None = None,
    allow_write: bool = False,
    auth: str | None = None,
    max_upload: str = "20MB",
    mmap: bool = False,
    max_batch: int = MAX_BATCH,
    rerank: Rerank = NO_RERANK,
    model: str = "float32",
) -> None:
    """Starts the app and blocks until Ctrl+C or SIGTERM (systemd, docker stop); then removes its cache."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, stop_like_ctrl_c)
    service = SearchService(run, index_dir, mmap=mmap, allow_write=allow_write, rerank=rerank, model=model)
    try:
        launch(service, host, port, auth, max_upload, max_batch=max_batch)
    except KeyboardInterrupt:
        pass  # a stop that came before Gradio's own wait loop could catch it: the same normal stop
    finally:
        service.close()
