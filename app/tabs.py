"""The Gradio interface over a SearchService: one builder per tab, wired to app.handlers.

API (gradio_client, endpoint names and parameter names are stable):
  /search         (image, k, label, depth, only) -> (results, summary)   batched: concurrent queries share one
                  embedding call (app.batching); label marks hits, only=True keeps items of that label alone
  /search_id      (item_id, k, depth)  -> (results, summary)
  /labels         ()                   -> table of label, count
  /browse         (label)              -> gallery of that label's items
  /evaluate       ()                   -> (metrics table, plots)
  /embedding_map  (projection)         -> map image
  /audit          ()                   -> (suspects table, its rows' data, summary): the gallery's suspected wrong
                  labels (app.audit); accepting or keeping one is the page's only (--allow-write), not the API's
  /add            (files, label)       -> message   (only with --allow-write)
  /remove         (ids)                -> message   (only with --allow-write)
Results are a gallery of (image, caption); a caption reads "HIT · #1 · 0.912 · label" (file and id on hover).
Each gallery has the items it shows beside it, in gallery order (app.handlers.Shown in an app.components.PageData,
not part of the API), which clicks read.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import gradio as gr

from app.audit import audit_tab
from app.components import (
    Blocks,
    BoundedNumber,
    BoundedSlider,
    PageData,
    PageHTML,
    QueryImage,
    endpoint,
    tile_gallery,
)
from app.handlers import Handlers, as_data, item_tiles, metrics_rows, run_plots
from app.service import BROWSE_LIMIT, SearchService
from index.types import Manifest

# Clicks on tiles that search run side by side, each waiting on the batcher (their queries share its next embedding
# call); the search button's requests come in Gradio's batches instead. Few: every thread that decodes and makes
# thumbnails keeps memory of its own (16 such threads grew the server by 28 MiB in 20 s of mixed uploads where 4 grew
# by 10; bench/app_load.py --mixed).
PICKS = 4


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
    shown: PageData  # what the result tiles show, in gallery order
    marks: PageHTML  # their hit/miss marks and hover texts, for the page script
    picker: gr.Gallery  # one image per label
    picker_shown: PageData

    @property
    def inputs(self) -> list:
        return [self.query, self.k, self.query_label, self.depth, self.only_label]

    @property
    def outputs(self) -> list:
        return [self.results, self.summary, self.shown, self.marks]


def build_app(service: SearchService, style: dict | None = None) -> gr.Blocks:
    """The Gradio interface over a search service (style: head and theme for Gradio versions that take them here)."""
    labels = sorted(label for label, _ in service.label_counts() if label)
    on = Handlers(service)
    searching = {  # queued searches answered together (and embedded with the API's queries that arrive meanwhile)
        "batch": True,
        "max_batch_size": service.batcher.max_batch,
        "concurrency_limit": max(1, (os.cpu_count() or 1) // service.threads),
        "concurrency_id": "search",
    }
    picking = {"concurrency_limit": PICKS, "concurrency_id": "pick"}
    with Blocks(title="retrieval · image search", **(style or {})) as demo:
        gr.Markdown(
            f"# Image search\nRun `{service.run.root}` · {len(service.index):,} gallery images · {len(labels)} labels"
            f" · {service.index.manifest.index_type} index" + ("" if service.allow_write else " · read-only")
        )
        with gr.Tabs() as tabs:
            with gr.Tab("Search", id="search"):
                tab = search_tab(on, labels, searching)
            with gr.Tab("Browse", id="browse"):
                browsed, browsed_shown = browse_tab(on, labels)
            with gr.Tab("Metrics", id="metrics"):
                metrics_tab(on)
            with gr.Tab("Embedding map", id="map"):
                map_image, shown_map = map_tab(on, labels)
            with gr.Tab("Audit", id="audit"):
                audit_tab(service)
        picked = [tab.query, tab.query_label, tabs, *tab.outputs]
        settings = [tab.k, tab.depth, tab.only_label]
        for gallery, shown in ((tab.results, tab.shown), (tab.picker, tab.picker_shown), (browsed, browsed_shown)):
            gallery.select(on.pick, [shown, *settings], picked, api_name=False, **picking)
        map_image.select(on.pick_on_map, [*shown_map, *settings], picked, api_name=False, **picking)
    return demo


def search_tab(on: Handlers, labels: list[str], searching: dict) -> SearchTab:
    """The query (image, label, k, depth), the results, and one image per label to start from."""
    service = on.service
    with gr.Row():
        with gr.Column(scale=1):
            query, query_label, only_label, k, depth = query_fields(labels, service.index.manifest)
            button = gr.Button("Search", variant="primary", elem_id="search")
        with gr.Column(scale=2):
            summary = gr.Markdown(label="summary", elem_id="summary")  # the label names it in the API
            results = tile_gallery("results", "Nearest neighbours (click one to search with it)", 5)
            tile_marks = PageHTML(elem_id="result-marks")
    tiles, shown = item_tiles(service, service.samples())
    picker = tile_gallery("picker", "One image per label (click to search with it)", 10, tiles)
    shown_results, shown_picker = PageData([], visible=False), PageData(as_data(shown), visible=False)
    tab = SearchTab(
        query, query_label, only_label, k, depth, results, summary, shown_results, tile_marks, picker, shown_picker
    )
    unreadable = gr.State(False)
    searched = button.click(on.search_batch, tab.inputs, [*tab.outputs, unreadable], **endpoint("search"), **searching)
    searched.then(on.clear_unreadable, unreadable, query, api_name=False, show_progress="hidden")
    item_id = gr.Number(visible=False, precision=0, label="item id")
    gr.Button(visible=False).click(on.search_id, [item_id, k, depth], tab.outputs, **endpoint("search_id"))
    return tab


def query_fields(
    labels: list[str], manifest: Manifest
) -> tuple[gr.Image, gr.Dropdown, gr.Checkbox, gr.Slider, gr.Number]:
    """The fields of a query: its image, its label (marks hits), only that label, k, and the search depth."""
    depth_name = manifest.depth_name or "depth"
    tuned = f"0: the tuned {manifest.depth}" if manifest.depth is not None else "0: as tuned when the index was built"
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
    depth = BoundedNumber(
        value=0, precision=0, minimum=0, label=f"{depth_name} ({tuned})", visible=manifest.kind != "flat"
    )
    return query, query_label, only_label, k, depth


def browse_tab(on: Handlers, labels: list[str]) -> tuple[gr.Gallery, PageData]:
    """Labels with their counts, one label's items, add and remove (--allow-write); returns the gallery and the items
    it shows."""
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
            tiles, shown = on.browse(first) if first else ([], [])
            browsed = tile_gallery("browsed", "Items", 8, tiles)
            browsed_shown = PageData(shown, visible=False)
    with gr.Group(visible=service.allow_write):
        gr.Markdown("### Add and remove (started with `--allow-write`)")
        with gr.Row():
            uploads = gr.File(file_count="multiple", file_types=["image"], label="Images to add")
            with gr.Column():
                new_label = gr.Textbox(label="Their label")
                add_button = gr.Button("Add to the index")
                remove_ids = gr.Textbox(label="Ids to remove (from the captions)", placeholder="3, 7, 12")
                remove_button = gr.Button("Remove from the index", variant="stop")
        write_message = gr.Markdown(label="message")
    gr.Button(visible=False).click(on.label_table, None, counts, **endpoint("labels"))
    one = {"concurrency_limit": 1, "concurrency_id": "write"}  # one change at a time, from the page or the API
    browse_label.change(on.browse, browse_label, [browsed, browsed_shown], **endpoint("browse"))
    counts.select(on.label_of_row, None, browse_label, api_name=False)
    if service.allow_write:  # the page's buttons say a refusal beside them; the API's /add and /remove fail with it
        add_button.click(on.add_on_page, [uploads, new_label], [write_message, counts], api_name=False, **one)
        remove_button.click(on.remove_on_page, remove_ids, [write_message, counts], api_name=False, **one)
        gr.Button(visible=False).click(on.add, [uploads, new_label], [write_message, counts], **endpoint("add"), **one)
        gr.Button(visible=False).click(on.remove, remove_ids, [write_message, counts], **endpoint("remove"), **one)
    return browsed, browsed_shown


def metrics_tab(on: Handlers) -> None:
    """The metrics of each set the run was evaluated on (one to choose, beside the raw-pixel baseline where the demo
    scored one), the run's plots at full width, and the index evaluated now."""
    service = on.service
    names = list(service.metric_sets) or ["(none)"]
    with gr.Row():
        with gr.Column():
            chosen = gr.Dropdown(names, value=names[0], label="Evaluated set (retrieval evaluate RUN IMAGES adds one)")
            source = gr.Markdown(on.metric_source(names[0]))
        table = gr.Dataframe(
            metrics_rows(service.metric_sets.get(names[0])),
            headers=["metric", "value"],
            interactive=False,
            wrap=True,
            column_widths=["40%", "60%"],
        )
    mistakes_view(on, chosen, names[0])
    gr.Gallery(
        value=run_plots(service),
        label="Plots of the run (its latest evaluation)",
        columns=1,
        height="auto",
        object_fit="contain",
        elem_id="run-plots",
    )
    chosen.change(on.metric_set, chosen, [table, source], api_name=False)
    evaluate_button = gr.Button("Evaluate the index's items now (labeled: leave-one-out; else augmented copies)")
    with gr.Row():
        evaluated = gr.Dataframe(
            headers=["metric", "value"], interactive=False, label="Evaluation of the index", wrap=True
        )
        evaluated_plots = gr.Gallery(label="Its plots", columns=2, height="auto", object_fit="contain")
    evaluate_button.click(on.evaluate, None, [evaluated, evaluated_plots], **endpoint("evaluate"), concurrency_limit=1)


def mistakes_view(on: Handlers, chosen: gr.Dropdown, first: str) -> None:
    """What the chosen set's model gets wrong: the class pairs most often confused (click a pair to see its queries
    beside the hits they were taken for), and a table of every class (sort it by a column's header; click a row to
    see that class's queries beside their first hits)."""
    pairs, classes = on.mistakes(first)
    with gr.Row():
        confused = gr.Dataframe(
            pairs,
            headers=["label", "top-1 label", "confused", "of"],
            column_widths=["35%", "35%", "18%", "12%"],  # "confused" whole on one line
            interactive=False,
            wrap=True,
            label="Class pairs most often confused (a query's top-1 hit has the other label; click a pair to see them)",
            elem_id="confusions",
        )
        table = gr.Dataframe(
            classes,
            headers=["label", "queries", "recall@1", "MAP@R", "confused with"],
            column_widths=["31%", "15%", "16%", "13%", "25%"],  # each header whole on one line
            interactive=False,
            wrap=True,
            max_height=420,
            label="Classes, lowest recall@1 first (sort by a header; click a row to open it)",
            elem_id="classes",
        )
    opened = gr.Markdown()
    view = tile_gallery("class-view", "The class's queries, each followed by its first hit", 8)
    chosen.change(on.mistakes, chosen, [confused, table], api_name=False)
    table.select(on.class_view, chosen, [view, opened], api_name=False)
    confused.select(on.confusion_view, chosen, [view, opened], api_name=False)


def map_tab(on: Handlers, labels: list[str]) -> tuple[gr.Image, list]:
    """The gallery's embeddings in 2-D, the label and file under the pointer, one label to highlight; returns the
    map (a click on it searches) and the inputs that say which map is shown."""
    with gr.Row():
        projection = gr.Radio(["pca", "tsne"], value="pca", label="Projection")
        highlight = gr.Dropdown(
            labels, value=None, label="Highlight a label (type to find it)", allow_custom_value=False
        )
    draw = gr.Button("Draw the map")
    gr.Markdown("Gallery embeddings: point at a dot to see its label and file; click it to search with it.")
    map_image = gr.Image(label="map", show_label=False, interactive=False, type="filepath", elem_id="map")
    points = gr.HTML(elem_id="map-points-holder")
    drawn = draw.click(on.embedding_map, projection, map_image, **endpoint("embedding_map"), concurrency_limit=1)
    drawn.then(on.map_view, [projection, highlight], [map_image, points], api_name=False, concurrency_limit=1)
    highlight.change(on.map_view, [projection, highlight], [map_image, points], api_name=False, concurrency_limit=1)
    return map_image, [projection, highlight]
