"""`retrieval serve`: the search app in the browser (the only command that imports app/)."""

from __future__ import annotations

import errno
import os
import shlex
import socket
from typing import Annotated

import typer

from retrieval.calibration import require_threshold
from retrieval.commands.output import AutoModelOption, IndexOption, RunArg
from retrieval.errors import RetrievalError
from retrieval.rerank import SPEC_HELP as RERANK_HELP
from retrieval.rerank import parse_rerank
from retrieval.runs import RunDir

HOST_HELP = "Address to bind; 127.0.0.1 keeps the app on this machine (any other address needs --auth)."
WRITE_HELP = "Let users add images (kept in the index's sibling uploads/ folder) and remove items."
THRESHOLD_HELP = (
    "The similarity a hit must reach to be a match, for every search (default: the model card's, from "
    "`retrieval evaluate --calibrate`)."
)
AUTH_HELP = "user:password required to use the app (or set RETRIEVAL_AUTH); needed off loopback."
BATCH_HELP = "Queued searches embedded together in one call (default 4: a larger batch keeps those behind it waiting)."


def serve(
    run: RunArg,
    host: Annotated[str, typer.Option(help=HOST_HELP)] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port.", min=1, max=65535)] = 7860,
    index_dir: IndexOption = None,
    allow_write: Annotated[bool, typer.Option("--allow-write", help=WRITE_HELP)] = False,
    auth: Annotated[str | None, typer.Option(help=AUTH_HELP)] = None,
    max_upload: Annotated[str, typer.Option(help="Largest upload accepted, e.g. 20MB.")] = "20MB",
    mmap: Annotated[bool, typer.Option("--mmap", help="Leave the index vectors on disk (memory-mapped).")] = False,
    max_batch: Annotated[int | None, typer.Option(min=1, help=BATCH_HELP, show_default=False)] = None,
    rerank: Annotated[str, typer.Option(help=RERANK_HELP + " Applies to every search and to evaluate now.")] = "none",
    model: AutoModelOption = "auto",
    threshold: Annotated[float | None, typer.Option(help=THRESHOLD_HELP, show_default=False)] = None,
) -> None:
    """Serve the search app for the run's index in the browser: search, browse, metrics, embedding map and an API."""
    # FAISS's OpenMP threads spin between searches, on the cores the encoder needs next: idle, they sleep instead
    # (bench/app_load.py: 8.3 instead of 15.3 ms of server CPU per query at one client). Read when OpenMP loads.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    reranker = parse_rerank(rerank)
    require_threshold(threshold)
    require_free_port(host, port)
    RunDir(run).require_model()  # said before Gradio is loaded (seconds)
    from app.gradio_folder import use_own_gradio_folder

    use_own_gradio_folder()  # before Gradio is imported, which reads it for some of its paths
    from app.server import serve as run_server

    options = {"allow_write": allow_write, "auth": auth, "max_upload": max_upload, "mmap": mmap}
    options.update(rerank=reranker, model=model, threshold=threshold)
    options.update({"max_batch": max_batch} if max_batch else {})  # else the app's MAX_BATCH
    run_server(RunDir(run), host, port, index_dir, **options)


def require_free_port(host: str, port: int, make_variable: str = "") -> None:
    """Refuses a port that another program already listens on, before any work, naming a free one to use (also as
    make_variable=N, where a Makefile's variable sets the port); and a host that is not a name or address of this
    machine."""
    hosts = "give 127.0.0.1 (this machine only) or 0.0.0.0 (every network, with --auth)"
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except (socket.gaierror, UnicodeError) as error:
        raise RetrievalError(f"--host {shlex.quote(host)}: not a name this machine knows ({error}); {hosts}") from None
    try:
        with socket.socket(family) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds it
            probe.bind((host, port))
    except OSError as error:
        if error.errno == errno.EADDRNOTAVAIL:
            raise RetrievalError(f"--host {host}: not an address of this machine; {hosts}") from None
        with socket.socket(family) as probe:
            probe.bind((host, 0))
            free = probe.getsockname()[1]
        reason = "in use" if error.errno == errno.EADDRINUSE else error.strerror or error
        through_make = f"; through make: {make_variable}={free}" if make_variable else ""
        raise RetrievalError(
            f"port {port} on {host} is {reason}: give another with --port (e.g. --port {free}{through_make}), "
            "or stop what holds it"
        ) from None
