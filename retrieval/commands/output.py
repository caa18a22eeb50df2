"""What the commands print: tables of metrics, the files skipped, the common arguments and parsing of k."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, NoReturn

import typer
from rich.console import Console
from rich.table import Table

from retrieval.data import COLLECTION_HINT, Skipped
from retrieval.errors import RetrievalError
from retrieval.wording import counted

console = Console(soft_wrap=True)  # lines of text keep their paths whole; tables still fit the width
errors = Console(stderr=True, soft_wrap=True)


def stopped_by_ctrl_c(line: str) -> NoReturn:
    """Ends a command that Ctrl+C stopped: the line that says what is kept and what to run next, exit status 130."""
    errors.print(line, soft_wrap=True, highlight=False, markup=False)
    raise typer.Exit(130)


@contextmanager
def option_named(option: str) -> Iterator[None]:
    """Puts option before a one-line error about the collection it gave (`--against tests.csv: no usable images`),
    where the line does not already start with it, so that the errors of two collections a command reads (DATA and
    --against, --query and --gallery) read apart."""
    try:
        yield
    except RetrievalError as error:
        if not option or str(error).startswith(option):
            raise
        raise RetrievalError(f"{option} {error}", error.kind) from None


RUN_HELP = "Run directory (holds config, checkpoints, model.onnx, index/)."
DATA_HELP = (
    f"{COLLECTION_HINT[0].upper()}{COLLECTION_HINT[1:]}; images without a label (a flat folder, files at ROOT, empty "
    "CSV labels, a list) train without labels. With --benchmark: the extracted archive."
)
BENCHMARK_HELP = "Read {} as a standard benchmark's extracted archive: cub, cars196, sop or inshop, and {}."
INDEX_HELP = "Index directory (default: RUN/index)."

RunArg = Annotated[Path, typer.Argument(help=RUN_HELP, show_default=False)]
BenchmarkOption = Annotated[
    str | None, typer.Option(help=BENCHMARK_HELP.format("IMAGES", "score its test protocol"), show_default=False)
]
IndexOption = Annotated[Path | None, typer.Option("--index", help=INDEX_HELP)]
MODEL_HELP = "The exported model that embeds: float32 (model.onnx) or int8 (model.int8.onnx, from `export --int8`)."
AUTO_MODEL_HELP = (
    "The exported model that embeds: float32 (model.onnx), int8 (model.int8.onnx, from `export --int8`), or auto: "
    "the model the index was built with; for a new index, int8 where the run has it (it passed its quality gate)."
)
AutoModelOption = Annotated[str, typer.Option("--model", help=AUTO_MODEL_HELP)]
ModelOption = Annotated[str, typer.Option("--model", help=MODEL_HELP)]


def parse_ks(text: str) -> list[int]:
    """Parses "1,5,10" into [1, 5, 10]."""
    try:
        ks = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise RetrievalError(f"-k {text!r}: give whole numbers separated by commas, e.g. 1,5,10") from None
    if not ks or ks[0] < 1:
        raise RetrievalError(f"-k {text!r}: every k must be at least 1")
    return ks


def metrics_table(columns: dict[str, dict]) -> Table:
    """Returns a table with one row per metric and one column per evaluated model."""
    table = Table(title="retrieval metrics")
    table.add_column("metric")
    for name in columns:
        table.add_column(name, justify="right")
    first = next(iter(columns.values()))
    for key, value in first.items():
        if isinstance(value, (int, float)):
            table.add_row(key, *(format_value(metrics.get(key)) for metrics in columns.values()))
    return table


def confusion_table(confusions: list[dict], shown: int = 10) -> Table | str:
    """The class pairs most often confused (retrieval.mistakes): queries of a class whose top-1 hit has another; one
    line where there is none."""
    if not confusions:
        return "most confused classes: none (every query's top-1 hit has its own label)"
    table = Table(title="most confused classes (a query's top-1 hit has the other label)")
    for column, justify in (("label", "left"), ("top-1 label", "left"), ("queries", "right"), ("share", "right")):
        table.add_column(column, justify=justify, overflow="fold")  # type: ignore[arg-type]
    for pair in confusions[:shown]:
        share = f"{pair['count'] / pair['queries']:.2f}"
        table.add_row(pair["label"], pair["confused_with"], f"{pair['count']} of {pair['queries']}", share)
    return table


def class_changes_table(changes: dict, other: str, shown: int = 10) -> Table | str:
    """The classes whose recall@1 changed most from this run to the other (retrieval.mistakes.compare_classes); one
    line where none changed."""
    if not changes["better"] and not changes["worse"]:
        return f"recall@1 per class, this run -> {other}: the same in all {changes['classes']} classes"
    table = Table(
        title=f"recall@1 per class, this run -> {other}",
        caption=f"{changes['unchanged']} of {changes['classes']} classes unchanged",
    )
    for column in ("", "label", "queries", "this run", other, "change"):
        table.add_column(column, overflow="fold")
    for kind in ("better", "worse"):
        for row in changes[kind][:shown]:
            before, after, change = f"{row['before']:.3f}", f"{row['after']:.3f}", f"{row['change']:+.3f}"
            table.add_row(kind, row["label"], str(row["queries"]), before, after, change)
    return table


def format_value(value: object) -> str:
    """A metric's value as a table shows it: three decimals for floats."""
    return f"{value:.3f}" if isinstance(value, float) else "" if value is None else str(value)


def report_skipped(skipped: list[Skipped], report: Path | None) -> None:
    """Tells how many files were skipped and where the list is (or prints the first few)."""
    if not skipped:
        return
    where = f"; the list is in {report}" if report else ""
    errors.print(f"skipped {counted(len(skipped), 'file')}{where}", soft_wrap=True)
    for entry in skipped[:5]:
        errors.print(f"  {entry.path}: {entry.reason}", highlight=False, soft_wrap=True, markup=False)
    if len(skipped) > 5:
        errors.print(f"  … and {len(skipped) - 5} more")
