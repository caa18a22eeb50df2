"""`retrieval index` and `retrieval index-stats`: embed a gallery into its index; show what an index holds."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, NoReturn

import typer
from rich.table import Table

from retrieval.commands.output import (
    AutoModelOption,
    IndexOption,
    RunArg,
    console,
    format_value,
    report_skipped,
    stopped_by_ctrl_c,
)
from retrieval.data import load_collection
from retrieval.errors import RetrievalError
from retrieval.extras import require
from retrieval.runs import INDEX_MANIFEST, RunDir
from retrieval.wording import counted

if TYPE_CHECKING:
    from index.build import IndexReport
    from index.stats import IndexStats

IMAGES_HELP = (
    "Images to index: a folder (labels from ROOT/<label>/ when present), a CSV path,label, or a .txt list of paths."
)
FAISS_HELP = (
    'FAISS factory string for a new index, e.g. "HNSW32", "IVF4096,Flat", "OPQ32,IVF4096,PQ32" '
    "(default: chosen from the size and --memory)."
)
MEMORY_HELP = "Memory budget of a new index, e.g. 4GB or 512MiB (default: half of this machine's memory)."
ENGINE_HELP = "Where to embed: local (this process) or ray (Ray Data: CPU decoding tasks, an actor pool of encoders)."
BACKEND_HELP = "Where a new index lives: faiss (files in the index directory) or milvus (a collection at --uri)."
URI_HELP = "With --backend milvus: http://host:19530, or a file for Milvus Lite (e.g. gallery.db)."
MILVUS_INDEX_HELP = (
    "With --backend milvus: force a Milvus index type (FLAT, IVF_FLAT, IVF_SQ8, IVF_PQ, HNSW, GPU_CAGRA)."
)
NO_DEFAULT = {"show_default": False}


def index(
    run: RunArg,
    images: Annotated[Path, typer.Argument(help=IMAGES_HELP, show_default=False)],
    index_dir: IndexOption = None,
    sync: Annotated[
        bool,
        typer.Option(
            "--sync", help="Also remove entries whose files are no longer in IMAGES or can no longer be read."
        ),
    ] = False,
    rebuild: Annotated[bool, typer.Option("--rebuild", help="Ignore the existing index and build it anew.")] = False,
    batch_size: Annotated[
        int | None, typer.Option(help="Images per encoder call (default: 64 on CPU, 256 on CUDA).", min=1)
    ] = None,
    threads: Annotated[
        int | None, typer.Option(help="ONNX Runtime intra-op threads (default: all cores).", min=1)
    ] = None,
    faiss_type: Annotated[str | None, typer.Option("--faiss", help=FAISS_HELP, **NO_DEFAULT)] = None,
    memory: Annotated[str | None, typer.Option("--memory", help=MEMORY_HELP, **NO_DEFAULT)] = None,
    engine: Annotated[str, typer.Option(help=ENGINE_HELP)] = "local",
    address: Annotated[
        str | None,
        typer.Option(help="With --engine ray: the cluster's address (default: start a local Ray).", **NO_DEFAULT),
    ] = None,
    workers: Annotated[
        int | None,
        typer.Option(
            min=1, help="With --engine ray: encoder actors (default: one per GPU, else one per two CPUs).", **NO_DEFAULT
        ),
    ] = None,
    backend: Annotated[str, typer.Option(help=BACKEND_HELP)] = "faiss",
    uri: Annotated[str | None, typer.Option(help=URI_HELP, **NO_DEFAULT)] = None,
    milvus_index: Annotated[str | None, typer.Option("--milvus-index", help=MILVUS_INDEX_HELP, **NO_DEFAULT)] = None,
    model: AutoModelOption = "auto",
) -> None:
    """Embed a gallery with the run's ONNX model and add it to its FAISS index (incremental and resumable).

    A new index is exact (Flat) up to 100,000 images, then an HNSW graph (HNSW64 for a gallery of high
    intrinsic dimension) where it fits the memory budget, else IVF-Flat, IVF-SQ8 or OPQ+IVF-PQ, with its
    search depth tuned to recall@10 >= 0.95 (see `retrieval index-stats`).
    """
    from index.backends import built_with
    from index.build import build_index
    from index.choice import parse_memory
    from retrieval.embedders import OnnxEmbedder

    run_dir = RunDir(run)
    budget = parse_memory(memory) if memory else None
    target = index_dir or run_dir.index
    embedder = OnnxEmbedder.from_run(run_dir, threads, model=model, built_with=None if rebuild else built_with(target))
    ray, milvus = _engine_and_backend(engine, address, workers, backend, uri, milvus_index)
    options = {"sync": sync, "rebuild": rebuild, "batch_size": batch_size, "factory": faiss_type, "memory": budget}
    try:
        report = build_index(embedder, load_collection(images), target, ray=ray, milvus=milvus, **options)
    except KeyboardInterrupt:
        _interrupted(target)
    _report(report, target)


def _report(report: IndexReport, target: Path) -> None:
    """The files skipped, the job's counts in one line, and the indexed files that can no longer be read."""
    report_skipped(report.skipped, target / "skipped.json")
    console.print(
        f"index {target}: {len(report.index)} images · embedded {report.embedded} · resumed {report.resumed} · "
        f"unchanged {report.unchanged} · removed {report.removed} · skipped {len(report.skipped)}"
    )
    if report.stale:
        one = len(report.stale) == 1
        console.print(
            f"note: {counted(len(report.stale), 'indexed file')} can no longer be read (e.g. {report.stale[0]}): "
            f"{'its entry keeps what the file' if one else 'their entries keep what the files'} held when indexed; "
            f"--sync removes {'it' if one else 'them'}",
            highlight=False,
            soft_wrap=True,
        )


def _interrupted(target: Path) -> NoReturn:
    """Ctrl+C: one line saying how many embedded images the journal keeps and that the same command goes on from
    them; exit status 130."""
    from index.build import journal_path
    from index.journal import pending_rows

    journal = journal_path(target)
    kept = pending_rows(journal)
    if kept:
        line = (
            f"interrupted: {counted(kept, 'embedded image')} {'is' if kept == 1 else 'are'} kept in {journal}; run the "
            f"same command again to go on from {'it' if kept == 1 else 'them'} (the index is not changed until a job "
            "ends)"
        )
    else:
        line = "interrupted before any image was embedded; nothing was kept and the index is not changed"
    stopped_by_ctrl_c(line)


def directory_of_run(path: Path) -> bool:
    """Whether path is a run directory: one holding an index (index/manifest.json), or a run's config or exported model
    (a run not indexed yet, whose index is then named as RUN/index)."""
    run = RunDir(path)
    return (run.index / INDEX_MANIFEST).is_file() or run.config.is_file() or run.model_card.is_file()


def _engine_and_backend(
    engine: str, address: str | None, workers: int | None, backend: str, uri: str | None, milvus_index: str | None
) -> tuple[object | None, object | None]:
    """The Ray and Milvus options of `retrieval index`, checked (None: this process, FAISS files)."""
    from index.milvus import MilvusOptions
    from index.ray_engine import RayOptions

    if engine not in ("local", "ray"):
        raise RetrievalError(f"--engine {engine!r}: use local or ray")
    if engine == "ray":
        require("ray", "ray")
    ray_only = [name for name, value in (("--address", address), ("--workers", workers)) if value is not None]
    if engine != "ray" and ray_only:  # they were ignored: this process embedded, as without them
        raise RetrievalError(
            f"{ray_only[0]} sets how --engine ray embeds: add --engine ray, or leave {ray_only[0]} out"
        )
    if uri is None and milvus_index is not None:
        raise RetrievalError("--milvus-index sets a Milvus collection's index: add --backend milvus --uri URI")
    if backend == "faiss" and uri is not None:
        raise RetrievalError(
            f"--uri {uri} is where a Milvus collection lives: add --backend milvus, or leave --uri out"
        )
    if backend not in ("faiss", "milvus") or (backend == "milvus") != (uri is not None):
        raise RetrievalError(
            f"--backend {backend!r}: use faiss, or milvus with --uri (a Milvus address, or a file for Milvus Lite)"
        )
    if uri is not None:
        require("pymilvus", "milvus")
    ray = RayOptions(address, workers) if engine == "ray" else None
    return ray, (MilvusOptions(uri, milvus_index) if uri is not None else None)


def index_stats(
    index_dir: Annotated[
        Path, typer.Argument(help="An index directory, or a run directory holding index/.", show_default=False)
    ],
    sample: Annotated[
        int, typer.Option(help="Own vectors used as queries to measure recall@10 against exact search.", min=1)
    ] = 1000,
    mmap: Annotated[bool, typer.Option("--mmap", help="Open the index memory-mapped.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object (facts, measured figures).")] = False,
) -> None:
    """Show an index's size, type, parameters and memory, and measure its recall@10 against exact search."""
    from index.stats import index_stats as measure

    run = RunDir(index_dir if directory_of_run(index_dir) else index_dir.parent)
    directory = run.index if directory_of_run(index_dir) else index_dir
    embedder = None
    if run.model.is_file() and run.model_card.is_file():  # its encoder: figures of augmented copies without labels
        from retrieval.embedders import OnnxEmbedder

        embedder = OnnxEmbedder.from_run(run, spinning=False)
    stats = measure(directory, sample, mmap, embedder=embedder)
    if as_json:
        print(json.dumps({"index": str(directory), **stats.to_dict()}, indent=2))
        return
    table = Table(title=f"index {directory}")
    table.add_column("", no_wrap=True)
    table.add_column("", overflow="fold")
    for name, value in stat_rows(stats):
        shown = (
            (", ".join(f"{key}={setting}" for key, setting in value.items()) or "none")
            if isinstance(value, dict)
            else format_value(value)
        )
        table.add_row(name, shown)
    console.print(table)


def stat_rows(stats: IndexStats) -> list[tuple[str, object]]:
    """The rows of the index-stats table: each fact and figure with its name, those not measured or not of this
    backend left out."""
    facts = stats.facts
    rows = [
        ("count", facts.count),
        ("backend", facts.server),
        ("type", facts.index_type),
        ("parameters", facts.parameters if facts.server else None),
        ("chosen because", facts.choice),
        ("search depth", facts.search),
        ("dimension", facts.dim),
        ("vectors.faiss MiB", facts.vectors_mib),
        ("items.sqlite MiB", facts.items_mib),
        ("bytes per vector", facts.bytes_per_vector),
        ("encoder sha256", facts.encoder_sha256),
        ("updated", facts.updated),
        ("recall@10 (at build, held-out sample)", facts.recall_at_build),
        ("re-ranked candidates per result", facts.rerank),
        (f"recall@10 (now, {stats.recall_queries:,} own vectors left out)", stats.recall_now),
        ("uniformity (stored vectors)", stats.uniformity),
        ("copy recall@1 (augmented copies)", stats.copy_recall_at_1),
        ("alignment (augmented copies)", stats.copy_alignment),
    ]
    return [(name, value) for name, value in rows if value is not None]
