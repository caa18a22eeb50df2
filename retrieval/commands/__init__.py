"""The `retrieval` command line: a thin dispatcher over the stages (nothing imports it).

One module per command or group; each imports its stage inside the command, so that `retrieval
search` and `retrieval serve` run without torch installed. Our own errors become one line on
stderr and exit status 2.
"""

from __future__ import annotations

import sys

import typer

from retrieval.commands import demo, evaluate, export, indexing, search, serve, train
from retrieval.commands.output import errors
from retrieval.errors import RetrievalError

HELP = (
    "Train image embeddings with contrastive losses, export them to "
    "ONNX, index a gallery with FAISS, search it in the browser."
)

app = typer.Typer(
    name="retrieval", help=HELP, no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False
)
app.command()(train.train)
app.command()(train.analyze)
app.command()(export.export)
app.command()(indexing.index)
app.command()(search.search)
app.command("index-stats")(indexing.index_stats)
app.command()(evaluate.evaluate)
app.command()(serve.serve)
app.command()(demo.demo)


def main(argv: list[str] | None = None) -> int:
    """Runs the command line and returns its exit status; our own errors become one line on stderr and status 2."""
    for stream in (sys.stdout, sys.stderr):  # file names that are not valid UTF-8 are printed escaped, not a crash
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    try:
        app(args=argv, prog_name="retrieval")
    except RetrievalError as error:
        errors.print(f"error: {error}", highlight=False, soft_wrap=True, markup=False)
        return 2
    except SystemExit as exit_:  # the command line parser exits by itself, with 0 after --help
        return exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    return 0
