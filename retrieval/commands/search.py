"""`retrieval search`: the nearest gallery images to a query image or an indexed item, through index.search."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from retrieval.commands.output import IndexOption, RunArg, console
from retrieval.errors import RetrievalError
from retrieval.runs import RunDir

IMAGE_HELP = "Query image file (or give --id)."
ID_HELP = "Query with an item already in the index, by its id (itself left out)."
DEPTH_HELP = "nprobe (IVF) or efSearch (HNSW) for this search (default: the value tuned at build time)."
MMAP_HELP = "Leave the index's vectors on disk, memory-mapped (galleries larger than memory)."


def search(
    run: RunArg,
    image: Annotated[Path | None, typer.Argument(help=IMAGE_HELP, show_default=False)] = None,
    item_id: Annotated[int | None, typer.Option("--id", help=ID_HELP, show_default=False)] = None,
    k: Annotated[int, typer.Option("-k", "--k", help="Number of neighbours.")] = 10,
    index_dir: IndexOption = None,
    depth: Annotated[int | None, typer.Option("--depth", help=DEPTH_HELP, show_default=False)] = None,
    mmap: Annotated[bool, typer.Option("--mmap", help=MMAP_HELP)] = False,
    label: Annotated[
        str | None, typer.Option("--label", help="Only gallery items with this label.", show_default=False)
    ] = None,
) -> None:
    """Print the k nearest gallery images to a query image, or to an indexed item (--id)."""
    from index.backends import open_index
    from index.search import Query, search_images, search_item
    from retrieval.embedders import OnnxEmbedder

    if (image is None) == (item_id is None):
        raise RetrievalError("give a query IMAGE or --id of an indexed item (one of the two)")
    run_dir = RunDir(run)
    embedder = OnnxEmbedder.from_run(run_dir, spinning=False)
    gallery = open_index(index_dir or run_dir.index, embedder.fingerprint, embedder.dim, mmap=mmap)
    query = Query(k, depth, label)
    if image is not None:
        result = search_images(gallery, embedder, [image], [query])[0]
    else:
        result = search_item(gallery, int(item_id), query)  # type: ignore[arg-type]
    if result.error is not None:
        raise RetrievalError(result.error)
    table = Table(title=f"nearest to {image if image is not None else f'item {item_id}'}")
    for column in ("rank", "similarity", "label", "path"):
        table.add_column(column)
    for rank, hit in enumerate(result.hits, 1):
        table.add_row(str(rank), f"{hit.score:.4f}", hit.label, hit.path)
    console.print(table)
