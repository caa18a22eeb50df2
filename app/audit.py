"""The Audit tab's work: the served gallery's suspected wrong labels, from its stored vectors, and the decisions on
them, kept in RUN/labels.csv (retrieval.decisions; writing only with --allow-write).

The audit is retrieval.audit's, on the gallery as served, each accepted suggestion applied and each
decided image left off the list. A suspect is shown as its image, then the closest images of the
label it is suggested, in one gallery.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import gradio as gr
import numpy as np

from app.components import PageData, endpoint, refused, tile_gallery
from app.service import SearchService, as_text
from retrieval.audit import DEPTH, LABELED_HINT, Suspect, agreement, describe_agreement, suspects
from retrieval.decisions import LABELS_CSV, Decision, LabelDecision, decide, decided_labels, read_decisions
from retrieval.errors import RetrievalError
from retrieval.knn import Neighbours
from retrieval.runs import shell_path
from retrieval.wording import counted

SUSPECTS_SHOWN = 200  # rows of the suspects table at most


@dataclass(frozen=True)
class ShownSuspect:
    """A row of the suspects table: the image (its gallery id), its label, the suggested one and the score."""

    id: int
    file: str  # the image's path (a "path" key in the page's data made gradio_client's /audit fetch it as a file: 403)
    label: str
    suggested: str
    score: float
    neighbours: tuple[int, ...]  # gallery ids of the suggested label's closest images


@dataclass(frozen=True)
class GallerySuspects:
    """What the Audit tab shows: the most suspect images first (at most SUSPECTS_SHOWN) and how many were found."""

    shown: list[ShownSuspect]
    total: int
    agreement: float | None = None  # retrieval.audit.agreement of the gallery, decisions applied


def labels_csv(service: SearchService) -> Path:
    """Where the app keeps the decisions: beside the run's other files."""
    return service.run.root / LABELS_CSV


def gallery_suspects(service: SearchService) -> GallerySuspects:
    """The gallery's suspects, decisions applied and decided images left out, the most suspect first."""
    items = service.items
    ids = sorted(items)
    if not ids:
        return GallerySuspects([], 0)
    decisions = read_decisions(labels_csv(service))
    gallery = decided_labels([items[i] for i in ids], decisions)
    vectors = np.asarray(service.index.vectors_of(ids), np.float32)
    id_of = {item.path: item_id for item_id, item in zip(ids, gallery, strict=True)}
    shared = Neighbours.of(vectors, DEPTH) if len(ids) > 1 else None  # one search for both
    found: list[Suspect] = [s for s in suspects(gallery, vectors, neighbours=shared) if s.path not in decisions]
    shown = [
        ShownSuspect(
            id_of[s.path],
            str(s.path),
            s.label,
            s.suggested,
            s.score,
            tuple(id_of[p] for p in s.neighbours if p in id_of),
        )
        for s in found[:SUSPECTS_SHOWN]
    ]
    return GallerySuspects(shown, len(found), agreement(gallery, vectors, shared) if shared is not None else None)


def as_rows(found: list[ShownSuspect]) -> list[list]:
    """The suspects as table rows: file, label, suggested label, score."""
    return [[Path(s.file).name, s.label, s.suggested, round(s.score, 3)] for s in found]


def as_data(found: list[ShownSuspect]) -> list[dict]:
    return [asdict(s) for s in found]


def from_data(row: dict) -> ShownSuspect:
    """A suspect back from the page's data (JSON: its neighbours a list)."""
    return ShownSuspect(**{**row, "neighbours": tuple(row["neighbours"])})


def record(service: SearchService, shown: ShownSuspect, accept: bool) -> str:
    """Writes one decision (accept the suggestion, or keep the label) to RUN/labels.csv; says what was written."""
    if not service.allow_write:
        raise RetrievalError(
            "this app is read-only; start it with `retrieval serve RUN --allow-write` to decide on labels"
        )
    items = service.items
    target = labels_csv(service)
    path = Path(shown.file)
    label = shown.suggested if accept else shown.label
    decision = LabelDecision(path, label, shown.label, Decision.ACCEPTED if accept else Decision.KEPT)
    decisions = decide(target, [items[i] for i in sorted(items)], decision)  # decide applies the earlier ones
    done = f"**{as_text(path.name)}**: " + as_text(f"{shown.label} → {label}" if accept else f"kept as {label}")
    kept = f"{counted(len(decisions), 'decision')} in `{target}`"
    return f"{done}; {kept} (train on it: `retrieval train {shell_path(target)}`)"


def closed() -> tuple:
    """No suspect opened: no view, no proposal, the deciding buttons disabled."""
    return [], "", None, gr.update(interactive=False), gr.update(interactive=False)


class AuditHandlers:
    """The Audit tab's event handlers."""

    def __init__(self, service: SearchService) -> None:
        self.service = service

    def audit(self) -> tuple[list[list], list[dict], str]:
        """The suspects table, its rows' data, and a line saying how many (and what to do)."""
        labeled = sum(bool(item.label) for item in self.service.items.values())
        if not labeled:
            return [], [], f"No label is judged: no image of the gallery has a label ({as_text(LABELED_HINT)})."
        found = gallery_suspects(self.service)
        if not found.total:
            return [], [], "No suspected wrong label: every image's closest images agree with its label."
        more = f" (the first {len(found.shown)} shown)" if found.total > len(found.shown) else ""
        line = (
            f"**{found.total}** suspected wrong {'label' if found.total == 1 else 'labels'} of {labeled} labeled images"
        )
        line += f"{more}: click one to see it."
        said = describe_agreement(found.agreement)
        line += f" {said[:1].upper()}{said[1:]}." if said else ""
        return as_rows(found.shown), as_data(found.shown), line

    def open(self, data: list[dict], event: gr.SelectData) -> tuple:
        """A clicked suspect: its image, then the closest images of the suggested label, what is proposed, and the
        buttons that decide on it, enabled."""
        row = event.index[0] if isinstance(event.index, (list, tuple)) else event.index
        if not data or row is None or int(row) >= len(data):
            return closed()
        shown = from_data(data[int(row)])
        ids = [shown.id, *shown.neighbours]
        pictures = self.service.thumbnails(ids)
        tiles = [(str(pictures[0]), f"labeled {shown.label}")]
        tiles += [
            (str(p), f"{self.service.items[i].label} · {Path(self.service.items[i].path).name}")
            for i, p in zip(ids[1:], pictures[1:])
        ]
        line = (
            f"**{as_text(Path(shown.file).name)}** is labeled **{as_text(shown.label)}**; its closest images suggest "
            f"**{as_text(shown.suggested)}** (score {shown.score:.3f})"
        )
        return tiles, line, asdict(shown), gr.update(interactive=True), gr.update(interactive=True)

    def decide(self, opened: dict | None, accept: bool) -> str:
        if not opened:
            raise refused("click a suspect in the table first")
        try:
            return record(self.service, from_data(opened), accept)
        except RetrievalError as error:
            raise refused(str(error)) from None

    def accept(self, opened: dict | None) -> tuple:
        """Accepts the opened suspect's suggestion; the table is audited again and the suspect closed (the buttons
        wait for the next one: a second click wrote the decision again, or turned it over unseen)."""
        message = self.decide(opened, True)
        return (message, *self.audit(), *closed())

    def keep(self, opened: dict | None) -> tuple:
        """Keeps the opened suspect's label; the table is audited again and the suspect closed."""
        message = self.decide(opened, False)
        return (message, *self.audit(), *closed())


def audit_tab(service: SearchService) -> None:
    """The Audit tab: the gallery's suspected wrong labels in a table; a click shows the image beside the closest images
    of the label suggested; with --allow-write, accept the suggestion or keep the label (RUN/labels.csv)."""
    on = AuditHandlers(service)
    run_button = gr.Button("Audit the gallery's labels")
    said = gr.Markdown("Finds images whose closest images agree on another label (docs/trust.md).", label="summary")
    with gr.Row():
        table = gr.Dataframe(
            headers=["image", "label", "suggested", "score"],
            column_widths=["34%", "27%", "27%", "12%"],
            interactive=False,
            wrap=True,
            max_height=480,
            label="Suspected wrong labels, most suspect first (click one)",
            elem_id="suspects",
        )
        with gr.Column():
            proposed = gr.Markdown(elem_id="suspect-line")
            view = tile_gallery("suspect-view", "The image, then the closest images of the suggested label", 4)
            with gr.Row(visible=service.allow_write):
                accept_button = gr.Button(
                    "Accept the suggestion", variant="primary", elem_id="accept", interactive=False
                )
                keep_button = gr.Button("Keep the label", elem_id="keep", interactive=False)
            written = gr.Markdown(elem_id="decision")
    data = PageData([], visible=False)
    opened = gr.State(None)
    run_button.click(on.audit, None, [table, data, said], **endpoint("audit"), concurrency_limit=1)
    suspect = [view, proposed, opened, accept_button, keep_button]
    table.select(on.open, data, suspect, api_name=False)
    if service.allow_write:
        outputs = [written, table, data, said, *suspect]
        accept_button.click(on.accept, opened, outputs, api_name=False, concurrency_limit=1)
        keep_button.click(on.keep, opened, outputs, api_name=False, concurrency_limit=1)
