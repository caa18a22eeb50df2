"""Serving the app: the Gradio interface (app.tabs) and the JSON API (app.api) on one uvicorn server.

`launch` checks the settings (auth off loopback, the upload cap), mounts the app's own static files
(the page's stylesheet and script, the API documentation's assets) and the Gradio interface on the
FastAPI application, and serves it in a thread; `serve` blocks until Ctrl+C or SIGTERM.
"""

from __future__ import annotations

import contextlib
import inspect
import ipaddress
import os
import signal
import threading
import time
from pathlib import Path

import gradio as gr
from fastapi.staticfiles import StaticFiles

from app.gradio_folder import use_own_gradio_folder
from app.memory import release_memory_periodically
from app.service import MAX_BATCH, SearchService
from app.tabs import build_app
from index.faiss_ops import serve_on
from retrieval.embedders import AUTO
from retrieval.errors import RetrievalError
from retrieval.rerank import NO_RERANK, Rerank
from retrieval.runs import RunDir

AUTH_VARIABLE = "RETRIEVAL_AUTH"  # user:password, instead of --auth on the command line
ANALYTICS_EVENTS = 500  # finished events Gradio keeps for its monitoring page (its default, 10,000: ~10 MiB of dicts)
# events between two of Gradio's monitoring summaries (a pandas DataFrame of the kept events, grouped; its default: 1,
# after every event): never, since the app does not enable that page; rebuilt per search, it cost CPU and memory
ANALYTICS_SUMMARY_EVERY = 10**9
STATIC = Path(__file__).with_name("static")  # app.css, app.js: served at STATIC_ROUTE
STATIC_ROUTE = "/app-static"
KERNEL_SHARE = 0.5  # of the cores, for the encoder and FAISS in a server (the rest serve HTTP)
HEAD = f'<link rel="stylesheet" href="{STATIC_ROUTE}/app.css"><script src="{STATIC_ROUTE}/app.js"></script>'
STYLE_AT_LAUNCH = "head" in inspect.signature(gr.Blocks.launch).parameters  # Gradio 6 takes it there, 5 in Blocks()
IDLE_POLL_SECONDS = 0.01  # how often the app's event queue looks for new events while it has none
# seconds a stopping server waits for the requests in flight before it drops the connections still open: a browser
# tab's or a gradio_client's event stream never ends by itself, and held Ctrl+C for the whole 10 s of the join
CLOSE_GRACE_SECONDS = 1.0


def theme() -> gr.themes.Base | None:
    """Gradio's default look with its fonts' regular and bold faces only, where Gradio ships them (6.x; 5.x fetched
    Source Sans Pro from Google Fonts whole: None keeps its default). The semibold faces Gradio 6 ships hold a few
    letters (Source Sans Pro's: A, B and some Cyrillic), so text at weight 600 (headings, buttons, table headers) mixed
    those letters with a system font's; without a 600 face the browser draws that text in the bold one."""
    fonts = Path(gr.__file__).parent / "templates" / "frontend" / "static" / "fonts"
    if not all((fonts / name / f"{name}-Bold.woff2").is_file() for name in ("SourceSansPro", "IBMPlexMono")):
        return None
    return gr.themes.Default(
        font=[gr.themes.LocalFont("Source Sans Pro", weights=(400, 700)), "ui-sans-serif", "system-ui", "sans-serif"],
        font_mono=[gr.themes.LocalFont("IBM Plex Mono", weights=(400, 700)), "ui-monospace", "Consolas", "monospace"],
    )


def loopback(host: str) -> bool:
    """Whether host only accepts connections from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse_auth(auth: str | None) -> tuple[str, str] | None:
    """user:password from --auth or the RETRIEVAL_AUTH variable; None when neither is set. An empty --auth is refused:
    `--auth "$PASS"` with PASS unset served the app without a password, the user believing it had one."""
    if auth == "":
        raise RetrievalError("--auth is empty (a shell variable unset?); give user:password, or leave --auth out")
    value = auth or os.environ.get(AUTH_VARIABLE)
    if not value:
        return None
    user, colon, password = value.partition(":")
    if not colon or not user or not password:
        raise RetrievalError(f"--auth / {AUTH_VARIABLE}: give user:password (both non-empty)")
    return user, password


class Server:
    """The app and the JSON API on one uvicorn server, in a thread of this process."""

    def __init__(self, app: object, host: str, port: int) -> None:
        import uvicorn

        self.url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"  # an IPv6 address in brackets
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False, lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)

    def start(self, port: int, host: str) -> None:
        """Starts serving; refuses a port that was taken between the check and the start."""
        self.server.install_signal_handlers = lambda: None  # type: ignore[method-assign]  # Ctrl+C is the main thread's
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RetrievalError(f"port {port} on {host} is in use; give another with --port")
            time.sleep(0.02)

    def close(self) -> None:
        """Stops the server: requests in flight get CLOSE_GRACE_SECONDS to finish, then open connections are dropped."""
        self.server.should_exit = True
        self.thread.join(timeout=CLOSE_GRACE_SECONDS)
        if self.thread.is_alive():
            self._drop_connections()
        self.thread.join(timeout=10)

    def _drop_connections(self) -> None:
        """Closes the open connections from the server's own thread, as if their clients had gone: a stream ends the way
        a closed tab ends it (no task is cancelled, so nothing prints a traceback)."""
        for connection in list(self.server.server_state.connections):
            loop, transport = getattr(connection, "loop", None), getattr(connection, "transport", None)
            if loop is not None and transport is not None:
                with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: the server has stopped
                    loop.call_soon_threadsafe(transport.close)


def launch(
    service: SearchService,
    host: str = "127.0.0.1",
    port: int = 7860,
    auth: str | None = None,
    max_upload: str = "20MB",
    block: bool = True,
) -> Server:
    """Starts the app and the JSON API on host:port: auth off loopback, uploads capped, only the app's cache served."""
    from app.api import build_api

    credentials = parse_auth(auth)
    if credentials is None and not loopback(host):
        raise RetrievalError(
            f"--host {host} lets other machines reach the app: give --auth "
            f"user:password (or set {AUTH_VARIABLE}), or bind 127.0.0.1"
        )
    os.environ.setdefault("GRADIO_ANALYTICS_MAX_EVENTS", str(ANALYTICS_EVENTS))  # read when the queue is made
    os.environ.setdefault("GRADIO_ANALYTICS_CACHE_FREQUENCY", str(ANALYTICS_SUMMARY_EVERY))
    use_own_gradio_folder()  # before the app is built: its components take their folder then
    style = {"head": HEAD, "theme": theme()}
    demo = build_app(service, None if STYLE_AT_LAUNCH else style)
    release_memory_periodically()
    api = build_api(service, credentials, max_upload)
    api.mount(STATIC_ROUTE, StaticFiles(directory=STATIC), name="app-static")
    settings = {"auth": credentials, "allowed_paths": [str(service.cache)], "max_file_size": max_upload.lower()}
    settings.update(style if STYLE_AT_LAUNCH else {})
    queued(demo)
    app = gr.mount_gradio_app(api, demo, path="", show_error=True, **settings)
    server = Server(app, host, port)
    server.start(port, host)
    if block:
        wait_until_stopped(server)
    return server


def queued(demo: gr.Blocks) -> gr.Blocks:
    """Gives the app its event queue: one event at a time per handler, new events looked for every 10 ms when idle.

    Gradio's queue looks every millisecond while it has nothing to do (every 50 ms on Windows): a thousand wake-ups
    a second, 3-5 % of a core for a server nobody is using (1.5 % every 10 ms). A search through the app then waits
    about 3 ms more at one client (p50 29 -> 32 ms), none at 16, where the queue is never empty; the JSON API does not
    use this queue (`python bench/app_load.py --idle`; docs/benchmarks.md)."""
    demo.queue(default_concurrency_limit=1)
    queue = demo._queue  # Gradio has no public setting for it
    queue.sleep_when_free = max(queue.sleep_when_free, IDLE_POLL_SECONDS)
    return demo


def wait_until_stopped(server: Server) -> None:
    """Says where the app is and serves until Ctrl+C (or SIGTERM, turned into it), then closes the server and says so:
    the stop takes a second or two (requests in flight finish), in which a terminal showed nothing but ^C."""
    print(f"serving the search app at {server.url}, its JSON API at {server.url}/docs  (Ctrl+C to stop)", flush=True)
    try:
        while True:
            time.sleep(0.5)
    finally:
        server.close()
        print(f"stopped the search app at {server.url}", flush=True)


def stop_like_ctrl_c(signum: int, frame: object) -> None:
    """SIGTERM handler: stops the server the way Ctrl+C does, so that the cleanup after it runs."""
    raise KeyboardInterrupt


def serve(
    run: RunDir,
    host: str = "127.0.0.1",
    port: int = 7860,
    index_dir: Path | None = None,
    allow_write: bool = False,
    auth: str | None = None,
    max_upload: str = "20MB",
    mmap: bool = False,
    max_batch: int = MAX_BATCH,
    rerank: Rerank = NO_RERANK,
    model: str = AUTO,
    threshold: float | None = None,
) -> None:
    """Starts the app and blocks until Ctrl+C or SIGTERM (systemd, docker stop); then removes its cache.

    The encoder and FAISS run on half the cores (KERNEL_SHARE): the batched queries of a loaded server keep
    them busy, and the other half parse requests and write answers instead of waiting behind them.
    """
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, stop_like_ctrl_c)
    kernels = max(1, int((os.cpu_count() or 1) * KERNEL_SHARE))
    serve_on(kernels)
    options = {"mmap": mmap, "allow_write": allow_write, "rerank": rerank, "model": model, "max_batch": max_batch}
    options.update(threshold=threshold, threads=kernels)
    service = SearchService(run, index_dir, **options)
    try:
        launch(service, host, port, auth, max_upload)
    except KeyboardInterrupt:
        pass  # a stop that came before Gradio's own wait loop could catch it: the same normal stop
    finally:
        service.close()
