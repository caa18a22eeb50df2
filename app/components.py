"""Gradio components of the app, adjusted so that a bad request ends in one line of the log, not a traceback.

Gradio writes a type stub next to a module that defines component subclasses (app/*.pyi, ignored by git).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import gradio as gr
from pydantic import ValidationError

log = logging.getLogger("retrieval.app")
SESSIONS_KEPT = 1_000  # Gradio sessions whose state a server keeps (Gradio: 10,000), the ones used last


ENDPOINTS = {  # what each gradio_client endpoint takes and gives, as the app's "Use via API" page and view_api() say it
    "search": (
        "Search the gallery with an image. image: the query file (handle_file('query.jpg')); k: how many hits (1-50); "
        "label: the query's label, which marks each hit HIT or miss (optional); depth: nprobe or efSearch (0: the "
        "depth tuned when the index was built); only: search only the items with that label. Returns the hits, "
        "best first (a list of {image, caption}; the caption holds the rank, the similarity, the label and, where the "
        "hit reaches the run's match threshold, match), and a summary line."
    ),
    "search_id": (
        "Search with an item of the gallery, by its id (shown in the captions), left out of its own hits: item_id, "
        "k, depth as for /search. Returns the hits and a summary line, as /search does."
    ),
    "labels": "The gallery's labels. Returns a table of rows [label, items]: each label and how many items it has.",
    "browse": (
        "The items of one label (up to 200). Returns a list of {image, caption}, the caption holding the item's id."
    ),
    "add": (
        "Add image files to the index (the app started with --allow-write): files, and the label they all get "
        "(optional). Returns a line saying what was added, and the labels table."
    ),
    "remove": (
        "Remove items from the index by id (the app started with --allow-write): ids as text, separated by commas or "
        "spaces. Returns a line saying what was removed, and the labels table."
    ),
    "evaluate": (
        "Evaluate the index now: each labeled item searches the others, through the index and exactly. Returns the "
        "metrics table (recall@k, MAP@R, ...) and its plots."
    ),
    "embedding_map": (
        "The gallery's embeddings drawn in 2-D, coloured by label: projection pca or tsne. Returns the image."
    ),
    "audit": (
        "Suspected wrong labels of the gallery: images whose closest images agree on another label. Returns the "
        "table of rows [image, label, suggested, score], most suspect first, and a summary line."
    ),
}


def endpoint(name: str) -> dict[str, str]:
    """An event's API name and the description its API page shows (the handler's docstring is for the code's reader)."""
    return {"api_name": name, "api_description": ENDPOINTS[name]}


def refused(message: str) -> gr.Error:
    """The error a refused request gets: its message to the user, and one line (not a traceback) in the server's log."""
    log.warning("refused a request: %s", message)
    return gr.Error(message, print_exception=False)


def tile_gallery(elem_id: str, label: str, columns: int, value: object = None) -> gr.Gallery:
    """A gallery of thumbnails, each shown whole above its caption, the first row below the gallery's name (the
    class "tiles" of app/static/app.css); a click on a tile is an event of the page, not a preview."""
    return gr.Gallery(
        value,
        label=label,
        columns=columns,
        height="auto",
        object_fit="contain",
        allow_preview=False,
        elem_id=elem_id,
        elem_classes=["tiles"],
    )


class Blocks(gr.Blocks):
    """gr.Blocks whose requests with a value of the wrong shape for a component (an API call with one file where the
    component takes a list, a number for an image) are refused in one log line, not a traceback, and which keeps the
    state of the SESSIONS_KEPT sessions used last.

    Gradio keeps, per session, a copy of every component's settings (about 160 KiB for this app), and each call of the
    Gradio route without a session (curl, a script's POST to /gradio_api/call/search) opens a new one: with Gradio's
    10,000 a server grew by 190 KiB a call, up to about 1.9 GB more. A browser session pushed out starts afresh at its
    next event (its search still works; an opened audit suspect has to be clicked again)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.state_session_capacity = SESSIONS_KEPT  # read when the app is mounted (gr.Blocks.launch's setting)

    async def preprocess_data(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().preprocess_data(*args, **kwargs)
        except ValidationError as error:
            raise refused(_wrong_shape(error)) from None


def _wrong_shape(error: ValidationError) -> str:
    """The line for a request value of the wrong shape; a file given as its path in text (gradio_client's
    `image="query.jpg"`) says how to send the file."""
    first = error.errors()[0]
    if error.title in ("ImageData", "FileData") and isinstance(first.get("input"), str):
        return (
            f"a file given as the text {first['input'][:200]!r}: send the file itself, e.g. "
            f"image=handle_file({first['input'][:200]!r}) (from gradio_client import handle_file)"
        )
    return f"the request's {error.title} value: {first['msg']}"


class QueryImage(gr.Image):
    """gr.Image that hands over the uploaded file untouched instead of opening it with Pillow first.

    The search decodes it with retrieval.data.decode (size limits, 16-bit, CMYK, animation), so a bad
    upload ends in that readable message for its own query only; Gradio's own check would raise and
    fail the request with a traceback in the log.
    """

    is_template = True  # drawn by the frontend's Image component

    def preprocess(self, payload: object) -> str | None:
        if payload is None or getattr(payload, "path", None) is None:
            return super().preprocess(payload)  # type: ignore[arg-type]  # None, or a base64 data URL
        return str(payload.path)  # type: ignore[attr-defined]


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


class PageData(gr.JSON):
    """Data kept in the page beside a gallery (what each tile shows), handed back to the events that read it, and
    left out of the API (gradio_client's results are those of the visible outputs)."""

    is_template = True  # drawn (when visible) by the frontend's JSON component

    @property
    def skip_api(self) -> bool:
        return True


class PageHTML(gr.HTML):
    """HTML for the page script only (data attributes it reads), left out of the API."""

    is_template = True  # drawn by the frontend's HTML component

    @property
    def skip_api(self) -> bool:
        return True
