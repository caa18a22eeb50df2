"""`retrieval audit`: suspected wrong labels, copies, leaks into another collection and outliers of a collection,
read through the run's exported encoder."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from retrieval.commands.output import ModelOption, RunArg, console, errors, option_named
from retrieval.data import (
    COLLECTION_HINT,
    VARIANTS,
    Collection,
    describe_variants,
    label_variants,
    load_collection,
    require_source,
    same_images,
    shared_paths,
)
from retrieval.errors import RetrievalError
from retrieval.runs import RunDir, writable_folder
from retrieval.wording import counted

if TYPE_CHECKING:
    from retrieval.audit import Audit, AuditedCollection

DATA_HELP = f"The collection to audit: {COLLECTION_HINT}."
AGAINST_HELP = "A second collection (e.g. the training folder against a test folder): DATA's copies of its images."
FOLDS_HELP = (
    "Judge each label with a model that did not train on the image: K short runs with the run's recipe, each on "
    "the other folds (for auditing the run's own training images; needs torch)."
)
FOLD_EPOCHS_HELP = "Epochs of each --folds run."
FOLD_EPOCHS = 10
JSON_HELP = "Print one JSON object (labels, duplicates, leaks, outliers; absolute paths) instead of tables."
CSV_HELP = "Also write labels.csv, duplicates.csv, leaks.csv and outliers.csv into this folder."
SHOWN_HELP = "Rows shown per table (--json and --csv hold them all)."
MISSING = "listed in the CSV but not found"


def audit(
    run: RunArg,
    data: Annotated[Path, typer.Argument(help=DATA_HELP, show_default=False)],
    against: Annotated[Path | None, typer.Option("--against", help=AGAINST_HELP, show_default=False)] = None,
    folds: Annotated[int, typer.Option("--folds", help=FOLDS_HELP)] = 0,
    fold_epochs: Annotated[int, typer.Option(help=FOLD_EPOCHS_HELP)] = FOLD_EPOCHS,
    as_json: Annotated[bool, typer.Option("--json", help=JSON_HELP)] = False,
    csv_dir: Annotated[Path | None, typer.Option("--csv", help=CSV_HELP, show_default=False)] = None,
    shown: Annotated[int, typer.Option(help=SHOWN_HELP, min=0)] = 15,
    model: ModelOption = "float32",
) -> None:
    """Audit a collection: images whose closest images agree on another label (with the label they suggest),
    copies (identical bytes, or re-encoded, resized, cropped a little, grey), with --against the copies of
    another collection's images (leaks between splits), and images far from every other or unreadable.

    On the images the run trained on, a model has learnt their labels, wrong ones too: give --folds K
    there. The method and its measured figures: docs/trust.md.
    """
    collection = _collection(data)
    other = _collection(against, "--against") if against is not None else None
    shared = shared_paths(collection.items, other.items) if other is not None else []
    if other is not None and same_images(collection.items, other.items):
        raise RetrievalError(
            f"--against {against}: the same images as DATA ({data}); give another collection, e.g. the training "
            "images when DATA is a test split"
        )
    run_dir = RunDir(run)
    run_dir.require_model()
    if csv_dir is not None:  # said before the audit runs, not after (write_csvs checks it again)
        from retrieval.audit import require_csv_folder

        _refuse_csv_in_data(csv_dir, data, against)
        writable_folder(csv_dir, "--csv")
        require_csv_folder(csv_dir)
    if folds:
        _check_folds(collection, folds, fold_epochs)
    elif fold_epochs != FOLD_EPOCHS:  # it was ignored: no fold was trained
        raise RetrievalError(f"--fold-epochs {fold_epochs} sets the length of each --folds run: add --folds K")
    if not as_json:  # a script's --json is left quiet
        _say_before(run_dir, collection, shared, folds)
    from retrieval.audit import audit as run_audit
    from retrieval.audit import embed_collection, write_csvs
    from retrieval.embedders import OnnxEmbedder

    embedder = OnnxEmbedder.from_run(run_dir, model=model)
    embedded = embed_collection(embedder, collection, not as_json)
    spaces = _fold_spaces(run_dir, embedded, folds, fold_epochs, model, not as_json) if folds else []
    with option_named("--against"):
        against_embedded = embed_collection(embedder, other, not as_json) if other is not None else None
    found = run_audit(embedded, against_embedded, spaces, shown=not as_json)
    if csv_dir is not None:
        written = write_csvs(found, csv_dir)
        if not as_json:
            console.print(f"wrote {', '.join(path.name for path in written)} in {csv_dir}")
    if as_json:
        print(json.dumps(found.to_dict(), indent=2))
    else:
        _print(found, shown, against is not None)


def _refuse_csv_in_data(csv_dir: Path, data: Path, against: Path | None) -> None:
    """--csv inside an audited image folder: the next audit of it read the CSVs as files that are not images."""
    folder = csv_dir.expanduser().resolve()
    for option, images in (("DATA", data), ("--against", against)):
        if images is not None and images.is_dir() and folder.is_relative_to(images.expanduser().resolve()):
            raise RetrievalError(
                f"--csv {csv_dir}: inside the images audited ({option} {images}), where its CSVs would be read as "
                "files of the collection; give a folder outside them, e.g. runs/audit"
            )


def _say_before(run: RunDir, collection: Collection, shared: list[Path], folds: int) -> None:
    """The notes worth reading before the audit's wait: images the run trained on (without --folds), files in both
    collections, labels written alike but for case."""
    if not folds:
        _say_if_trained_on(run, collection)
    if shared:
        errors.print(
            f"note: {counted(len(shared), 'file')} {'is' if len(shared) == 1 else 'are'} in DATA and in --against "
            f"alike (e.g. {shared[0]}): each is listed as a leak of itself; a file belongs in one split",
            highlight=False,
            soft_wrap=True,
        )
    variants = label_variants(collection.items)
    if variants:
        errors.print(
            f"note: {VARIANTS}: {describe_variants(variants)}; the audit judges them so (each may suggest the other)",
            highlight=False,
            soft_wrap=True,
        )


def _collection(source: Path, option: str = "") -> Collection:
    """The collection at source, or one line (after the option that gave it): not there, no image in it, or a CSV
    naming files that are gone."""
    with option_named(option):
        collection = load_collection(require_source(source, option))
        missing = [entry for entry in collection.skipped if entry.reason == MISSING]
        if missing:
            one = len(missing) == 1
            raise RetrievalError(
                f"{source}: names {counted(len(missing), 'file')} that {'is' if one else 'are'} not there (first: "
                f"{missing[0].path}); restore {'it or remove its row' if one else 'them or remove their rows'}"
            )
    return collection


def _say_if_trained_on(run: RunDir, collection: Collection) -> None:
    """One line (on stderr, beside the progress) where DATA holds the run's training images: there its model has learnt
    their labels, wrong ones too, which --folds is for."""
    from retrieval.evaluation import share_text, trained_share

    trained = trained_share(run, [collection])
    if trained is not None and trained.counts[0]:
        share = share_text(trained.counts[0], len(collection.items))
        errors.print(
            f"note: {share} images are images {run.root} trained on "
            f"({trained.data}): its model has learnt their labels, wrong ones too, so wrong ones hide among them; "
            "give --folds K to judge each image by a model that did not train on it (docs/trust.md)",
            highlight=False,
            soft_wrap=True,
        )


def _check_folds(collection: Collection, folds: int, epochs: int) -> None:
    """--folds: labels on every image, a fold count the smallest label allows, epochs >= 1, torch there."""
    from retrieval.extras import require

    if any(not item.label for item in collection.items):
        raise RetrievalError(f"--folds {folds}: {collection.source} has images without a label; --folds needs labels")
    if epochs < 1:
        raise RetrievalError(f"--fold-epochs {epochs}: give 1 or more")
    from retrieval.audit import check_folds

    check_folds([item.label for item in collection.items], folds)
    require("torch", "train")


def _fold_spaces(
    run: RunDir, embedded: AuditedCollection, folds: int, epochs: int, model: str, progress: bool
) -> list[tuple[object, object]]:
    """Per fold: every image embedded by the model trained without that fold, and the fold's rows."""
    import numpy as np

    from retrieval.embedders import OnnxEmbedder, embed_items
    from training.folds import fold_models, fold_of

    fold = fold_of(embedded.items, folds)
    said = console.print if progress else (lambda line: None)
    with tempfile.TemporaryDirectory(prefix="retrieval-folds-") as work:
        spaces = []
        for number, fold_run in enumerate(fold_models(run, embedded.items, fold, epochs, Path(work), said)):
            vectors = embed_items(
                OnnxEmbedder.from_run(fold_run, model="float32"), embedded.items, progress=False
            ).vectors
            spaces.append((vectors, np.flatnonzero(fold == number)))
    return spaces


def _shared_folder(paths: list[Path]) -> tuple[Path, Callable[[Path], str]]:
    """The folder that paths share, and a path written relative to it (as given where there are no paths)."""
    if not paths:
        return Path(), str
    root = Path(os.path.commonpath([str(path.parent) for path in paths]))
    return root, lambda path: os.path.relpath(path, root)


def _print(found: Audit, shown: int, leaks: bool) -> None:
    """The tables (the first `shown` rows of each; leaks only when there was --against), paths relative to the folder
    they share (the leaks' copies to the one those share); a table with no row is one line saying none."""
    from retrieval.audit import LABELED_HINT, OutlierKind, describe_agreement

    every = [s.path for s in found.labels] + [p for d in found.duplicates for p in d.paths]
    every += [leak.path for leak in found.leaks] + [o.path for o in found.outliers]
    root, short = _shared_folder(every)
    other_root, other = _shared_folder([leak.other for leak in found.leaks])
    caption = f"paths under {root}" if every else None
    tables = [
        (f"suspected wrong labels (of {found.labeled} labeled images, most suspect first)",
         ["path", "label", "suggested", "score"], found.labels,
         lambda s: [short(s.path), s.label, s.suggested, f"{s.score:.3f}"], caption),
        ("copies", ["images", "kind", "score"], found.duplicates,
         lambda d: ["\n".join(short(p) for p in d.paths), d.kind.value, f"{d.score:.3f}"], caption),
        *([("leaks (copies in --against)", ["path", "copy of", "kind", "score"], found.leaks,
            lambda leak: [short(leak.path), other(leak.other), leak.kind.value, f"{leak.score:.3f}"],
            f"{caption}; copies under {other_root}")] if leaks else []),
        ("outliers", ["path", "why", "closeness"], found.outliers,
         lambda o: [short(o.path), o.reason or o.kind.value, "" if o.score is None else f"{o.score:.3f}"], caption),
    ]  # fmt: skip
    if not found.labeled:
        console.print(f"suspected wrong labels: not judged, no image has a label ({LABELED_HINT})", highlight=False)
        tables = tables[1:]
    for title, columns, rows, cells, under in tables:
        if not rows:
            console.print(f"{title}: none")
            continue
        table = Table(title=f"{title}: {len(rows)}", caption=under)
        for column in columns:
            table.add_column(column, overflow="fold")
        for row in rows[:shown]:
            table.add_row(*cells(row))
        if len(rows) > shown:
            table.add_row(f"… and {len(rows) - shown} more (--json or --csv: all)", *[""] * (len(columns) - 1))
        console.print(table)
    unread = sum(outlier.kind is OutlierKind.UNREADABLE for outlier in found.outliers)
    read = found.images - unread
    line = f"audited {read:,} image{'s' * (read != 1)}"
    if unread:
        line += f" ({unread:,} more file{'s' * (unread != 1)} could not be read: the outliers above)"
    agreement = describe_agreement(found.agreement)
    console.print(line + (f"; {agreement}" if agreement else ""), soft_wrap=True)
