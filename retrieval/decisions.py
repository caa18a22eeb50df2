"""Decisions on suspected wrong labels (the app's Audit tab), kept in a labels CSV beside the run.

RUN/labels.csv lists every audited image with its label — the suggested one where a suggestion was
accepted — so that `retrieval train RUN/labels.csv` trains on the corrected labels; the columns `was`
and `decision` keep what each decision changed. Nothing is written to the images or to the original
collection. Each decision rereads the file, adds itself and replaces the file atomically under a
lock: a decision already made is never lost, even when two arrive together.
"""

from __future__ import annotations

import csv
import io
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from retrieval.data import Item
from retrieval.errors import RetrievalError
from retrieval.runs import write_atomic

LABELS_CSV = "labels.csv"  # in the run folder
COLUMNS = ("path", "label", "was", "decision")
_writing = threading.Lock()


class Decision(Enum):
    """What was decided about a suspect."""

    ACCEPTED = "accepted"  # the suggested label replaces the image's label
    KEPT = "kept"  # the image's label is right; the audit stops listing it


@dataclass(frozen=True)
class LabelDecision:
    """One image's decision: its label now, the label it had, and which decision."""

    path: Path
    label: str
    was: str
    decision: Decision


def read_decisions(path: Path) -> dict[Path, LabelDecision]:
    """The decisions kept in a labels CSV (none when it is not there), by image path."""
    if not path.is_file():
        return {}
    try:
        rows = list(csv.DictReader(path.read_text(encoding="utf-8-sig").splitlines()))  # saved again by Excel: a BOM
    except (OSError, UnicodeDecodeError, csv.Error) as error:
        raise RetrievalError(
            f"{path}: cannot be read as a labels CSV ({error}); move it away to start afresh"
        ) from None
    decided = {}
    for row in rows:
        if row.get("decision") in {decision.value for decision in Decision}:
            image = Path(row["path"])
            decided[image] = LabelDecision(image, row.get("label", ""), row.get("was", ""), Decision(row["decision"]))
    return decided


def decided_labels(items: Sequence[Item], decisions: dict[Path, LabelDecision]) -> list[Item]:
    """The items with every accepted suggestion applied."""
    return [
        Item(item.path, decisions[item.path].label)
        if item.path in decisions and decisions[item.path].decision is Decision.ACCEPTED
        else item
        for item in items
    ]


def decide(path: Path, items: Sequence[Item], decision: LabelDecision) -> dict[Path, LabelDecision]:
    """Adds a decision to the labels CSV at path (every item listed, decisions applied), atomically; returns all the
    decisions."""
    if decision.path not in {item.path for item in items}:
        raise RetrievalError(f"{decision.path}: not among the audited images; audit again and decide from the list")
    with _writing:
        decisions = {**read_decisions(path), decision.path: decision}
        text = io.StringIO()
        writer = csv.writer(text, lineterminator="\n")
        writer.writerow(COLUMNS)
        for item in decided_labels(items, decisions):
            made = decisions.get(item.path)
            writer.writerow([str(item.path), item.label, made.was if made else "", made.decision.value if made else ""])
        write_atomic(path, text.getvalue().encode("utf-8"))
    return decisions
