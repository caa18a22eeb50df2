"""`retrieval search`: the nearest gallery images to a query image or an indexed item, through index.search."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from retrieval.commands.output import IndexOption, ModelOption, RunArg, console
from retrieval.errors import RetrievalError
from retrieval.rerank import SPEC_HELP as RERANK_HELP
from retrieval.rerank import parse_rerank
from retrieval.runs import RunDir

IMAGE_HELP = "Query image file (or give --id)."
ID_HELP = "Query with an item already in the index, by its id (itself left out)."
DEPTH_HELP = "nprobe (IVF) or efSearch (HNSW) for this search (default: the value tuned at build time)."
MMAP_HELP = "Leave the index's vectors on disk, memory-mapped (galleries larger than memory)."
JSON_HELP = "Print the hits as JSON (rank, id, score, label, full path) for scripts."
NO_DEFAULT = {"show_default": False}


def search(
    run: RunArg,
    image: Annotated[Path | None, typer.Argument(help=IMAGE_HELP, **NO_DEFAULT)] = None,
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
    model: ModelOption = "float32",
) -> None:
    """Print the k nearest gallery images to a query image, or to an indexed item (--id).

    On a terminal, a table with paths under the folder all hits share; piped or redirected, a
    "# nearest to" line, then one tab-separated line per hit with full paths; with --json, JSON.
    """
    from index.backends import open_index
    from index.search import Query, search_images, search_item
    from retrieval.embedders import OnnxEmbedder

    if (image is None) == (item_id is None):
        raise RetrievalError("give a query IMAGE or --id of an indexed item (one of the two)")
    run_dir = RunDir(run)
    embedder = OnnxEmbedder.from_run(run_dir, spinning=False, model=model)
    gallery = open_index(index_dir or run_dir.index, embedder.fingerprint, embedder.dim, mmap=mmap)
    query = Query(k, depth, label, parse_rerank(rerank))
    if image is not None:
        result = search_images(gallery, embedder, [image], [query])[0]
    else:
        result = search_item(gallery, int(item_id), query)  # type: ignore[arg-type]
    if result.error is not None:
        raise result.error.error()  # its kind and message: one line, exit status 2
    rows = [
        {"rank": rank, "id": hit.id, "score": hit.score, "label": hit.label, "path": hit.path}
        for rank, hit in enumerate(result.hits, 1)
    ]
    if as_json:
        print(json.dumps({"query": str(image) if image is not None else item_id, "hits": rows}, indent=2))
    elif console.is_terminal:
        console.print(_table(rows, f"nearest to {image if image is not None else f'item {item_id}'}"))
    else:
        print(f"# nearest to {image if image is not None else f'item {item_id}'}")
        print("\t".join(("rank", "id", "similarity", "label", "path")))
        for row in rows:
            print(f"{row['rank']}\t{row['id']}\t{row['score']:.4f}\t{row['label']}\t{row['path']}")


def _table(rows: list[dict], title: str) -> Table:
    """The hits as a table, paths shown under the folder they all share (named in the caption)."""
    root = os.path.commonpath([str(Path(row["path"]).parent) for row in rows]) if rows else ""
    table = Table(title=title, caption=f"paths under {root}" if root else None)
    for column in ("rank", "id", "similarity", "label", "path"):
        table.add_column(column, overflow="fold")
    for row in rows:
        shown = os.path.relpath(row["path"], root) if root else row["path"]
        table.add_row(str(row["rank"]), str(row["id"]), f"{row['score']:.4f}", row["label"], shown)
    return table
