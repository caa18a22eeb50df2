"""`retrieval search`: the nearest gallery images to a query image or an indexed item, through index.search."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from retrieval.calibration import require_threshold
from retrieval.commands.output import AutoModelOption, IndexOption, RunArg, console, errors
from retrieval.data import require_source
from retrieval.errors import RetrievalError
from retrieval.rerank import SPEC_HELP as RERANK_HELP
from retrieval.rerank import parse_rerank
from retrieval.runs import RunDir, shell_path
from retrieval.wording import counted

if TYPE_CHECKING:
    from index.search import QueryResult

IMAGE_HELP = (
    "Query image files (or give --id); a gallery file with the same bytes is the query itself, left out. Several "
    "(a shell glob) are embedded together; one that cannot be read is reported and the others answered."
)
ID_HELP = "Query with an item already in the index, by its id (itself left out)."
DEPTH_HELP = "nprobe (IVF) or efSearch (HNSW) for this search (default: the value tuned at build time)."
MMAP_HELP = "Leave the index's vectors on disk, memory-mapped (galleries larger than memory)."
JSON_HELP = (
    "Print the hits as JSON (rank, id, score, label, full path, match) for scripts: one object per query, a list of "
    "them for several images."
)
THRESHOLD_HELP = (
    "The similarity a hit must reach to be a match (default: the one `retrieval evaluate --calibrate` stored in the "
    "model card; without either, hits are not marked)."
)
NO_MATCH = "no confident match"
NO_DEFAULT = {"show_default": False}


def search(
    run: RunArg,
    images: Annotated[list[Path] | None, typer.Argument(help=IMAGE_HELP, **NO_DEFAULT)] = None,
    item_id: Annotated[int | None, typer.Option("--id", help=ID_HELP, **NO_DEFAULT)] = None,
    k: Annotated[int, typer.Option("-k", "--k", help="Number of neighbours.")] = 10,
    index_dir: IndexOption = None,
    depth: Annotated[int | None, typer.Option("--depth", help=DEPTH_HELP, **NO_DEFAULT)] = None,
    mmap: Annotated[bool, typer.Option("--mmap", help=MMAP_HELP)] = False,
    label: Annotated[
        str | None, typer.Option("--label", help="Only gallery items with this label.", **NO_DEFAULT)
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help=JSON_HELP)] = False,
    rerank: Annotated[str, typer.Option(help=RERANK_HELP)] = "none",
    model: AutoModelOption = "auto",
    threshold: Annotated[float | None, typer.Option(help=THRESHOLD_HELP, **NO_DEFAULT)] = None,
) -> None:
    """Print the k nearest gallery images to each query image, or to an indexed item (--id).

    On a terminal, a table per query with paths under the folder all hits share; piped or redirected, per query a
    "# nearest to" line, then one tab-separated line per hit with full paths (a tab, newline or backslash in a
    label or path written \\t, \\n or \\\\); with --json, JSON.
    Where the run has a match threshold (or --threshold), each hit says whether it is a match, and
    "no confident match" is said when the best hit is not.
    """
    from index.backends import built_with, open_index
    from index.search import Query, search_images, search_item
    from retrieval.calibration import match_similarity
    from retrieval.embedders import OnnxEmbedder

    if bool(images) == (item_id is not None):
        raise RetrievalError("give a query IMAGE or --id of an indexed item (one of the two)")
    for image in images or []:
        require_source(image, hint="an image file")
    if images and len(images) == 1 and images[0].is_dir():
        raise RetrievalError(
            f"{images[0]}: a folder, not an image file; give an image file, or the folder's images as "
            f"{shell_path(images[0])}/*"
        )
    require_threshold(threshold)
    run_dir = RunDir(run)
    directory = index_dir or run_dir.index
    embedder = OnnxEmbedder.from_run(run_dir, spinning=False, model=model, built_with=built_with(directory))
    gallery = open_index(directory, embedder.fingerprint, embedder.dim, mmap=mmap)
    reranker = parse_rerank(rerank)
    query = Query(k, depth, label, reranker, match_similarity(embedder.card, reranker.describe(), threshold))
    if images:
        answered = list(zip(map(str, images), search_images(gallery, embedder, images, query)))
    else:
        answered = [(item_id, search_item(gallery, int(item_id), query))]  # type: ignore[list-item, arg-type]
    if len(answered) == 1 and answered[0][1].error is not None:
        raise answered[0][1].error.error()  # its kind and message: one line, exit status 2
    _print(answered, query.threshold, as_json)


def _print(answered: list[tuple[str | int | None, QueryResult]], threshold: float | None, as_json: bool) -> None:
    """Each query's hits, or why it failed (on stderr; in JSON, its error), as JSON, tables on a terminal or
    tab-separated lines; a query that failed among several does not stop the others, but when none was answered
    the command fails (exit status 2)."""
    failed = [result.error for _, result in answered if result.error is not None]
    if as_json:
        shown = [_as_json(query, result, threshold) for query, result in answered]
        print(json.dumps(shown[0] if len(shown) == 1 else shown, indent=2))
    for query, result in answered:
        if result.error is not None:
            errors.print(f"error: {result.error.message}", soft_wrap=True, highlight=False, markup=False)
        elif not as_json:
            _print_hits(result, query, threshold)
    gone = sorted({hit.path for _, result in answered for hit in result.hits if not os.path.exists(hit.path)})
    if gone:  # a gallery moved or deleted since it was indexed: the paths printed lead nowhere
        one = len(gone) == 1
        errors.print(
            f"note: the {'file' if one else 'files'} of {counted(len(gone), 'hit')} {'is' if one else 'are'} no longer "
            f"there (e.g. {gone[0]}); moved or deleted since {'it was' if one else 'they were'} indexed? Put "
            f"{'it' if one else 'them'} back, or index their folder again with --sync",
            soft_wrap=True,
            highlight=False,
            markup=False,
        )
    if failed and len(failed) == len(answered):
        raise RetrievalError(f"none of the {len(answered)} query images could be read (above); give image files")
    if failed:
        errors.print(f"{len(failed):,} of {len(answered):,} query images skipped (above)", highlight=False)


def _rows(result: QueryResult) -> list[dict]:
    """The hits as rows: rank, id, score, label, path, match."""
    return [
        {"rank": rank, "id": hit.id, "score": hit.score, "label": hit.label, "path": hit.path, "match": hit.match}
        for rank, hit in enumerate(result.hits, 1)
    ]


def _as_json(query: str | int | None, result: QueryResult, threshold: float | None) -> dict:
    """One query's JSON object: its hits, the gallery item it is (left out) and notes; or, for a query image that
    could not be read, its error (kind and message)."""
    if result.error is not None:
        return {"query": query, "error": {"kind": result.error.kind.value, "message": result.error.message}}
    itself = result.itself.id if result.itself is not None else None
    return {"query": query, "threshold": threshold, "hits": _rows(result), "itself": itself, "notes": result.notes}


def _print_hits(result: QueryResult, query: str | int | None, threshold: float | None) -> None:
    """The hits as a table on a terminal, or tab-separated lines; the match column only with a threshold; the
    result's notes (e.g. the gallery item the query is, left out of its hits)."""
    rows = _rows(result)
    title = f"nearest to {query if isinstance(query, str) else f'item {query}'}"
    unsure = threshold is not None and not (rows and rows[0]["match"])
    if console.is_terminal:
        console.print(_table(rows, title + (f" ({NO_MATCH}: below {threshold:.4f})" if unsure else ""), threshold))
        for note in result.notes:
            console.print(f"note: {note}", highlight=False, soft_wrap=True)
        return
    print(f"# {_escaped(title)}" + (f"\n# {NO_MATCH}: the best hit is below {threshold:.4f}" if unsure else ""))
    print("".join(f"# note: {_escaped(note)}\n" for note in result.notes), end="")
    columns = ("rank", "id", "similarity", "label", "path") + (("match",) if threshold is not None else ())
    print("\t".join(columns))
    for row in rows:
        shown = (row["rank"], row["id"], f"{row['score']:.4f}", row["label"], row["path"], _yes(row["match"]))
        print("\t".join(_escaped(str(value)) for value in shown[: len(columns)]))


def _escaped(text: str) -> str:
    """A field of the tab-separated lines as one field on one line: backslash, tab, newline and carriage return in
    a label or path written \\\\, \\t, \\n and \\r (as PostgreSQL's text format and other TSV readers write them)."""
    return text.replace("\\", "\\\\").replace("\t", "\\t").replace("\n", "\\n").replace("\r", "\\r")


def _yes(match: bool | None) -> str:
    return "" if match is None else "yes" if match else "no"


def _table(rows: list[dict], title: str, threshold: float | None) -> Table:
    """The hits as a table, paths shown under the folder they all share (named in the caption)."""
    root = os.path.commonpath([str(Path(row["path"]).parent) for row in rows]) if rows else ""
    table = Table(title=title, caption=f"paths under {root}" if root else None)
    columns = ("rank", "id", "similarity", "label", "path") + (("match",) if threshold is not None else ())
    for column in columns:
        table.add_column(column, overflow="fold")
    for row in rows:
        shown = os.path.relpath(row["path"], root) if root else row["path"]
        values = (str(row["rank"]), str(row["id"]), f"{row['score']:.4f}", row["label"], shown, _yes(row["match"]))
        table.add_row(*values[: len(columns)])
    return table
