"""The `retrieval` command line: a thin dispatcher over the stages (nothing imports it).

One module per command or group; each imports its stage inside the command, so that `retrieval
search` and `retrieval serve` run without torch installed. Our own errors become one line on
stderr and exit status 2.
"""

from __future__ import annotations

import atexit
import gc
import inspect
import os
import sqlite3
import sys
from pathlib import Path
from typing import Annotated

import typer
from typer.core import TyperCommand, TyperGroup

from retrieval import __version__
from retrieval.commands import audit, demo, evaluate, export, indexing, search, serve, train
from retrieval.commands.output import errors, stopped_by_ctrl_c
from retrieval.errors import RetrievalError
from retrieval.runs import FREE_SPACE, RunDir, disk_full, shell_path

INTERRUPTED = "interrupted: stopped before it finished; run the same command again to do it whole"
HELP = (
    "Train image embeddings with contrastive losses, export them to "
    "ONNX, index a gallery with FAISS, search it in the browser."
)


class _Flags:
    """Flags show no value placeholder in --help (a bare `--sync`, not `--sync <bool>`), --help itself included."""

    def get_params(self, ctx: object) -> list:
        params = super().get_params(ctx)  # type: ignore[misc]
        for param in params:
            if getattr(param, "is_flag", False) and param.metavar is None:
                param.metavar = ""
        return params


class _Command(_Flags, TyperCommand):
    def parse_args(self, ctx: typer.Context, args: list[str]) -> list[str]:
        _refuse_empty(self, args)
        given = list(args)
        try:
            return super().parse_args(ctx, args)
        except typer.BadParameter as error:  # (click's MissingParameter, which typer does not name)
            named = {token.partition("=")[0] for token in given}
            if error.param is None or error.param.opts != ["--run"] or named & {"--run", "--help"}:
                raise
            opts, extra, _ = self.make_parser(ctx).parse_args(args=given)
            data = [opts["data"]] if opts.get("data") is not None else []
            raise RetrievalError(_run_is_an_option(ctx.command_path, [*data, *extra], "--resume" in named)) from None

    def invoke(self, ctx: typer.Context) -> object:
        """Runs the command; Ctrl+C where it has no line of its own (train, index and demo say what they keep) still
        gets one, exit 130 (typer's own handling exits silently)."""
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            stopped_by_ctrl_c(INTERRUPTED)


def _refuse_empty(command: TyperCommand, args: list[str]) -> None:
    """Refuses an empty argument (`"$GALLERY"` with GALLERY unset), naming its option or argument: a path read as the
    folder the user stood in (`retrieval index RUN ""` indexed it) and an option's text as not given (the default,
    without a word)."""
    options = [param for param in command.params if param.param_type_name == "option"]
    valued = {name for param in options if not getattr(param, "is_flag", False) for name in param.opts}
    arguments = [param.name or "" for param in command.params if param.param_type_name == "argument"]
    position, option = 0, None
    for token in args:
        name, equals, value = token.partition("=") if token.startswith("--") else (token, "", "")
        if option is not None or (equals and name in valued):
            given, named = (token, option) if option is not None else (value, name)
            option = None
            if not given.strip():
                raise RetrievalError(f"{named} is empty (a shell variable unset?); give a value, or leave {named} out")
        elif token.startswith("-") and token != "-":
            option = token if token in valued else None
        elif not token.strip():
            named = arguments[min(position, len(arguments) - 1)].upper() if arguments else "an argument"
            raise RetrievalError(f"{named} is empty (a shell variable unset?); give its path")
        else:
            position += 1


def _run_is_an_option(command: str, words: list[str], resume: bool) -> str:
    """`retrieval train photos runs/x` (RUN given as the other commands take it, by position) read "Missing option
    '--run'" and only then, once given, that runs/x was one argument too many: one line with the command to type."""
    said = "missing option --run: the run {} is given as an option, `{}`"
    if resume and len(words) == 1:  # `retrieval train --resume runs/x`
        return said.format("to resume", f"{command} --run {shell_path(words[0])} --resume")
    data, extra = (words[0], words[1:]) if words else ("DATA", [])
    if len(extra) == 1 and _named_first(Path(data), Path(extra[0])):
        data, extra = extra[0], [data]
    run = shell_path(extra[0]) if len(extra) == 1 else "RUN"
    return said.format("directory", f"{command} {shell_path(data)} --run {run}")


def _named_first(run: Path, data: Path) -> bool:
    """Whether the run came before the images: a run there, or nothing there where the other path is."""
    return (RunDir(run).holds_run() and not RunDir(data).holds_run()) or (not run.exists() and data.exists())


class _Group(_Flags, TyperGroup):
    pass


def reflow(text: str | None) -> str:
    """A docstring as help text: each paragraph on one line, for the help formatter to wrap at the terminal's width."""
    paragraphs = inspect.cleandoc(text or "").split("\n\n")
    return "\n\n".join(" ".join(paragraph.split()) for paragraph in paragraphs)


def show_version(asked: bool) -> None:
    if asked:
        typer.echo(f"retrieval {__version__}")
        raise typer.Exit()


app = typer.Typer(
    name="retrieval", help=HELP, no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False, cls=_Group
)


@app.callback()
def _options(
    version: Annotated[
        bool, typer.Option("--version", help="Print the version and exit.", callback=show_version, is_eager=True)
    ] = False,
) -> None:
    """Train image embeddings with contrastive losses, export them to ONNX, index a gallery, search it."""


COMMANDS = {
    "train": train.train,
    "analyze": train.analyze,
    "export": export.export,
    "index": indexing.index,
    "search": search.search,
    "index-stats": indexing.index_stats,
    "evaluate": evaluate.evaluate,
    "audit": audit.audit,
    "serve": serve.serve,
    "demo": demo.demo,
}
for name, function in COMMANDS.items():
    app.command(name, help=reflow(function.__doc__), cls=_Command)(function)


def _skip_the_last_collection() -> None:
    """At exit, after the exit handlers the command registers (they run last-registered first), the objects still alive
    go to the collector's permanent generation, so that the interpreter's last collection does not walk them: with
    PyTorch, Gradio and matplotlib loaded that took 0.1-2 s of a command's end, the search app's Ctrl+C included
    (`python bench/exit.py`). Nothing written waits for it: files are closed by the code that writes them, and the
    exit handlers (logging's, threads', temporary folders') still run. Registered once, however often main runs."""
    atexit.unregister(gc.freeze)
    atexit.register(gc.freeze)


def _small_pages() -> None:
    """Fresh numpy arrays in this process, and in those it starts (the copy check's worker), go in 4 KiB pages, not
    numpy's huge pages, unless NUMPY_MADVISE_HUGEPAGE is set: on the 2-vCPU cloud VMs measured, the first touch of
    huge pages is ten times slower (294 MB: 1.9 s against 0.18 s), which cost the audit and the evaluation of 10,000
    images 16 and 20 % of their time (docs/benchmarks.md)."""
    if "NUMPY_MADVISE_HUGEPAGE" in os.environ:
        return
    os.environ["NUMPY_MADVISE_HUGEPAGE"] = "0"  # read by numpy where it is imported: the processes started from here
    import numpy

    core = getattr(numpy, "_core", None) or numpy.core  # numpy 2, numpy 1
    setting = getattr(getattr(core, "multiarray", None), "_set_madvise_hugepage", None)
    if setting is not None:  # this process, whose numpy is imported already (a numpy without it: left as it is)
        setting(False)


def _refused(error: OSError | sqlite3.Error) -> str:
    """One line for a write or read the system refused: a full disk says to free space (an index's SQLite files say
    "database or disk is full"), anything else names the file and asks to check it."""
    if isinstance(error, sqlite3.Error):
        where, reason = "", f"{error} (an index's SQLite database)"
    else:
        where, reason = (f"{error.filename}: " if error.filename else ""), error.strerror or str(error)
    return f"{where}{reason}; {FREE_SPACE if disk_full(error) else 'check the path and its permissions'}"


def main(argv: list[str] | None = None) -> int:
    """Runs the command line and returns its exit status; our own errors become one line on stderr and status 2. Where
    the reader of stdout has stopped (`retrieval search ... --json | head`), the command ends quietly with status 1,
    as click ends one whose writes meet the closed pipe: not with "error: Broken pipe; check the path and its
    permissions", nor Python's "Exception ignored ... BrokenPipeError" when what stdout still holds is flushed at
    exit (it is flushed here)."""
    _skip_the_last_collection()
    try:
        code = _run(argv)
        sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the flush at exit then writes nowhere
        return 1
    return code


def _run(argv: list[str] | None) -> int:
    """main's command and its errors."""
    _small_pages()
    for stream in (sys.stdout, sys.stderr):  # file names that are not valid UTF-8 are printed escaped, not a crash
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["help"]:  # `retrieval help search`: that command's help, as git and pip answer it
        argv = [*argv[1:2], "--help"]
    try:
        code = app(args=argv, prog_name="retrieval", standalone_mode=False)
    except RetrievalError as error:
        errors.print(f"error: {error}", highlight=False, soft_wrap=True, markup=False)
        return 2
    except typer.TyperException as error:  # the parser's: a missing option, an unknown one, a value of the wrong type
        context, message = getattr(error, "ctx", None), error.format_message().rstrip(".")
        where = f"; see `{context.command_path} --help`" if context is not None else ""
        if message:  # (no message: the help was shown, as for a bare `retrieval`)
            errors.print(f"error: {message}{where}", highlight=False, soft_wrap=True, markup=False)
        return int(getattr(error, "exit_code", 2))
    except typer.Abort:  # end of input at a prompt
        return 130
    except BrokenPipeError:  # the reader of stdout stopped: main ends quietly
        raise
    except (OSError, sqlite3.Error) as error:  # what the system refused where no command words it: still one line
        errors.print(f"error: {_refused(error)}", highlight=False, soft_wrap=True, markup=False)
        return 2
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    return code if isinstance(code, int) else 0
