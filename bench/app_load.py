"""Load on the search server: concurrent clients querying a 10,000-image index for a fixed time.

By default, one asynchronous client process (httpx, one connection per client, closed loop: each
client sends its next query when the last is answered) drives one `retrieval serve`: rows for 1, 16
and 64 clients on the JSON API (POST /api/v1/search, the image as the body, k=10) and 16 on the
Gradio route (upload, /gradio_api/call/search, its event stream: what gradio_client and the browser
do, each call without a session, as curl does), --seconds each; queries/s, p50/p95/p99, errors, and the server's CPU milliseconds per query
(its utime + stime over the row, from /proc) and its resident memory after the row. The clients share one process, so they do not eat the
server's cores the way a process per user does.

    python bench/app_load.py [--clients 1,16,64] [--gradio-clients 16] [--seconds 30] [--images 10000] [--idle 20]

--idle N adds a last row per server: its CPU over N seconds without queries, after the rows (cores busy).

--processes runs the earlier setting: N gradio_client users, each a process of its own:

The script makes what it needs in --work: a small run (`retrieval demo --no-serve`, 8 classes, 2
epochs: the model's quality does not matter here, its cost does), a gallery of 10,000 images (the
icons dataset's images, rotated, cropped, recoloured and resized at random, seeded) indexed with
`retrieval index`, and 100 query images made the same way. Then, for each setting, it starts
`retrieval serve` in its own process, lets every user (a thread with its own gradio_client.Client)
search with random query images (uploaded each time, k=10) back to back for --seconds, and reports
queries/s, p50/p95/p99 latency as the user sees it (upload + queue + embedding + search + the
results as URLs, as a browser gets them) and errors. Each user is a process of its own. The most
users are also run with batching off (--max-batch 1), and with a pause of about --think seconds
between a user's queries (people look at the results), side by side. Before each row, every query
image is searched once, so that the thumbnails of its results exist (a server that has been up a while).

    python bench/app_load.py --processes [--users 1,4,16] [--seconds 30] [--think 1.0] [--images 10000] [--work /tmp/app_load]

--mixed runs the hardening issue's setting instead: --users users (default 32) of which each query
is, with probability --bad-share, a bad upload from the adversarial corpus (tests/robustness/corpus.py:
empty, truncated, not an image, a decompression bomb, a header that lies); it counts good queries
that failed, bad ones answered without a message, and samples the server's resident memory each
half second, after --warmup seconds of the same load (not sampled): the growth is the median of the
last quarter of the run minus that of the first. --baseline adds, side by side, a server with the
app's memory settings off (RETRIEVAL_TRIM_SECONDS=0, Gradio's default of 10,000 kept events, its monitoring
summary rebuilt after every event).

    python bench/app_load.py --mixed [--users 32] [--seconds 60] [--warmup 0] [--bad-share 0.25] [--baseline]

--service-only runs the same mix without the server: the search service in this process, batches of
4 queries (and their thumbnails) --queries times, its resident memory before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from PIL import Image, ImageEnhance
from rich.console import Console
from rich.table import Table

from retrieval.datasets import icons

RETRIEVAL = str(Path(sys.executable).with_name("retrieval"))


def variants(sources: list[Path], count: int, target: Path, seed: int) -> None:
    """Writes count seeded variants of the source images into target/<label>/<n>.png."""
    rng = random.Random(seed)
    for number in range(count):
        source = sources[number % len(sources)]
        image = Image.open(source).convert("RGB")
        image = image.rotate(rng.uniform(-25, 25), fillcolor=(255, 255, 255))
        width, height = image.size
        cut = rng.uniform(0.0, 0.15)
        image = image.crop((int(cut * width), int(cut * height), int((1 - cut) * width), int((1 - cut) * height)))
        image = ImageEnhance.Color(image).enhance(rng.uniform(0.5, 1.5))
        image = ImageEnhance.Brightness(image).enhance(rng.uniform(0.8, 1.2))
        side = rng.choice((48, 64, 96, 128))
        folder = target / source.parent.name
        folder.mkdir(parents=True, exist_ok=True)
        image.resize((side, side)).save(folder / f"{number:05d}.png")


def prepare(work: Path, images: int, model: str = "float32") -> tuple[Path, Path, list[Path]]:
    """The run, its 10,000-image index (of the model's embeddings) and the query images (made once, reused later)."""
    run, index = work / ("run" if model == "float32" else f"run-{model}"), work / (f"index-{images}" if model == "float32" else f"index-{images}-{model}")
    if not (run / "model.onnx").is_file():
        subprocess.run([RETRIEVAL, "demo", "--no-serve", "--run", str(run), "--classes", "8", "--epochs", "2"], check=True, stdout=subprocess.DEVNULL)
    if model == "int8" and not (run / "model.int8.onnx").is_file():
        # unwhitened: the whitening of a 2-epoch run's weak directions keeps its int8 model below the gate
        subprocess.run([RETRIEVAL, "export", str(run), "--whiten", "none", "--int8"], check=True, stdout=subprocess.DEVNULL)
    sources = sorted((icons() / "train").rglob("*.png")) + sorted((icons() / "test").rglob("*.png"))
    gallery, queries = work / f"gallery-{images}", work / "queries"
    if not gallery.is_dir():
        variants(sources, images, gallery, seed=1)
    if not queries.is_dir():
        variants(sources[::7], 100, queries, seed=2)
    if not (index / "manifest.json").is_file():
        subprocess.run([RETRIEVAL, "index", str(run), str(gallery), "--index", str(index), "--model", model], check=True, stdout=subprocess.DEVNULL)
    return run, index, sorted(queries.rglob("*.png"))


CHECKOUT = "CHECKOUT"  # in serve's environment: run `retrieval serve` from that checkout of the project instead
FROM_CHECKOUT = """
import sys
sys.meta_path[:] = [f for f in sys.meta_path if "__editable__" not in getattr(f, "__module__", "")]  # this checkout's
sys.path.insert(0, sys.argv.pop(1))
from retrieval.commands import main
sys.exit(main(sys.argv[1:]))
"""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def serve(run: Path, index: Path, max_batch: int | None, environment: dict[str, str] | None = None, model: str = "float32") -> tuple[subprocess.Popen, str]:
    """Starts `retrieval serve` (with these extra environment variables) and waits until it answers."""
    port = free_port()
    checkout = (environment or {}).get(CHECKOUT)
    command = [sys.executable, "-c", FROM_CHECKOUT, checkout] if checkout else [RETRIEVAL]
    server = subprocess.Popen(
        [*command, "serve", str(run), "--index", str(index), "--port", str(port), *(["--max-batch", str(max_batch)] if max_batch else []), "--model", model],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, **(environment or {})},
    )
    url = f"http://127.0.0.1:{port}/"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return server, url
        except OSError:
            time.sleep(0.5)
    server.kill()
    raise SystemExit(f"retrieval serve did not answer on {url} within 120 s")


def user(url: str, seconds: float, think: float, queries: list[Path], seed: int, answers: multiprocessing.Queue) -> None:
    """One user in a process of its own (a client's CPU time would otherwise queue on one GIL): searches until the time is up."""
    from gradio_client import Client, handle_file

    client = Client(url, verbose=False, download_files=False)  # results are URLs, as a browser gets them
    rng = random.Random(seed)
    latencies, errors = [], 0
    answers.put("ready")
    stop = time.monotonic() + seconds
    while time.monotonic() < stop:
        started = time.perf_counter()
        try:
            gallery, _ = client.predict(handle_file(str(rng.choice(queries))), 10, "", 0, api_name="/search")
            if len(gallery) != 10:
                raise ValueError(f"{len(gallery)} results")
            latencies.append(time.perf_counter() - started)
        except Exception:  # noqa: BLE001 - every failure counts as an error
            errors += 1
        time.sleep(rng.uniform(0.5, 1.5) * think)
    answers.put((latencies, errors))


def mixed_user(url: str, seconds: float, good: list[Path], bad: list[Path], bad_share: float, seed: int, answers: multiprocessing.Queue) -> None:
    """One user of --mixed: good or bad uploads at random; counts what went wrong for each kind."""
    from gradio_client import Client, handle_file

    client = Client(url, verbose=False, download_files=False)
    rng = random.Random(seed)
    counts = {"good": 0, "bad": 0, "failed good": 0, "bad without a message": 0}
    answers.put("ready")
    stop = time.monotonic() + seconds
    while time.monotonic() < stop:
        is_bad = rng.random() < bad_share
        counts["bad" if is_bad else "good"] += 1
        try:
            gallery, summary = client.predict(handle_file(str(rng.choice(bad if is_bad else good))), 10, "", 0, api_name="/search")
        except Exception:  # noqa: BLE001 - an exception is a failure of either kind
            counts["bad without a message" if is_bad else "failed good"] += 1
            continue
        if is_bad and (gallery or "⚠️" not in summary):
            counts["bad without a message"] += 1
        elif not is_bad and len(gallery) != 10:
            counts["failed good"] += 1
    answers.put(counts)


def resident_mib(pid: int) -> float:
    """A process's resident memory (VmRSS) in MiB, from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def mixed_load(url: str, server_pid: int, users: int, seconds: float, good: list[Path], bad: list[Path], bad_share: float) -> dict:
    """Runs --mixed: users processes for seconds; returns the counts, the memory samples and their growth."""
    answers: multiprocessing.Queue = multiprocessing.Queue()
    processes = [multiprocessing.Process(target=mixed_user, args=(url, seconds, good, bad, bad_share, seed, answers)) for seed in range(users)]
    for process in processes:
        process.start()
    ready = [answers.get() for _ in range(users)]
    assert ready == ["ready"] * users
    samples = []
    while any(process.is_alive() for process in processes) and len(samples) < 4 * seconds:
        samples.append(resident_mib(server_pid))
        time.sleep(0.5)
    counts = [answers.get() for _ in range(users)]
    for process in processes:
        process.join()
    quarter = max(1, len(samples) // 4)
    totals = {key: sum(count[key] for count in counts) for key in counts[0]}
    return {**totals, "rss_first_mib": float(np.median(samples[:quarter])), "rss_last_mib": float(np.median(samples[-quarter:])), "rss_samples": samples}


def bad_uploads(work: Path) -> list[Path]:
    """The adversarial corpus's bad files that can be uploaded (regular files with UTF-8 names)."""
    sys.path.insert(0, str(Path(__file__).parents[1]))
    from tests.robustness.corpus import write_corpus

    shutil.rmtree(work / "adversarial", ignore_errors=True)
    corpus = write_corpus(work / "adversarial")
    return sorted(path for path in corpus.bad.values() if path.is_file() and not path.is_symlink() and os.access(path, os.R_OK) and str(path).isprintable())


def load(url: str, users: int, seconds: float, think: float, queries: list[Path]) -> tuple[list[float], int]:
    """Runs users for seconds (after all have connected); returns every latency (s) and the number of errors."""
    from gradio_client import Client, handle_file

    warm = Client(url, verbose=False, download_files=False)
    for query in queries:  # the thumbnails of the results are made once, as in a server that has been up a while
        warm.predict(handle_file(str(query)), 10, "", 0, api_name="/search")
    answers: multiprocessing.Queue = multiprocessing.Queue()
    processes = [multiprocessing.Process(target=user, args=(url, seconds, think, queries, seed, answers)) for seed in range(users)]
    for process in processes:
        process.start()
    results = [answers.get() for _ in range(2 * users)]
    for process in processes:
        process.join()
    done = [result for result in results if result != "ready"]
    return [latency for latencies, _ in done for latency in latencies], sum(errors for _, errors in done)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", default=None, help="numbers of concurrent users, separated by commas (default 1,4,16; with --mixed one number, default 32)")
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--think", type=float, default=1.0, help="mean pause of a user between queries, in the last row (uniform 0.5-1.5x)")
    parser.add_argument("--images", type=int, default=10_000)
    parser.add_argument("--work", type=Path, default=Path("/tmp/app_load"))
    parser.add_argument("--mixed", action="store_true", help="good and bad uploads from --users users (default 32); memory sampled")
    parser.add_argument("--bad-share", type=float, default=0.25, help="with --mixed: the share of bad uploads")
    parser.add_argument("--warmup", type=float, default=0.0, help="with --mixed: seconds of the same load before the measured run")
    parser.add_argument("--baseline", action="store_true", help="with --mixed: also a server with the app's memory settings off, side by side")
    parser.add_argument("--json", type=Path, default=None, help="with --mixed: also write the figures here")
    parser.add_argument("--service-only", action="store_true", help="the --mixed queries on the search service in this process, no server")
    parser.add_argument("--queries", type=int, default=4800, help="with --service-only: how many")
    parser.add_argument("--model", default="float32", help="the model the server embeds with: float32 or int8")
    parser.add_argument("--processes", action="store_true", help="gradio_client users, a process each (--users)")
    parser.add_argument("--clients", default="1,16,64", help="concurrent asynchronous clients of the JSON API, per row")
    parser.add_argument("--gradio-clients", default="16", help="concurrent asynchronous clients of the Gradio route, per row")
    parser.add_argument("--plain-http", action="store_true", help="the same rows again on a server with uvicorn's pure-Python HTTP (h11) and asyncio's loop")
    parser.add_argument("--against", type=Path, action="append", default=[], help="a checkout of another version of this project (git worktree): the same rows on its server, side by side (repeatable)")
    parser.add_argument("--max-batch", type=int, default=None, help="retrieval serve --max-batch (default: each server's own)")
    parser.add_argument("--idle", type=float, default=0.0, help="after the rows, also the server's CPU over this many seconds without queries (a last row, its cores busy)")
    parser.add_argument("--rounds", type=int, default=3, help="with --against or --plain-http: rounds over the servers in turn (medians)")
    args = parser.parse_args()
    console = Console(width=150)
    run, index, queries = prepare(args.work, args.images, args.model)
    if args.mixed:
        mixed(args, int(args.users or 32), run, index, queries, console)
        return
    if args.service_only:
        service_only(run, index, queries, bad_uploads(args.work), args.bad_share, args.queries, args.work, console)
        return
    if not args.processes:
        asynchronous(args, run, index, queries, console)
        return
    args.users = args.users or "1,4,16"
    most = max(int(users) for users in args.users.split(","))
    settings = [(int(users), 16, 0.0) for users in args.users.split(",")] + [(most, 1, 0.0), (most, 16, args.think)]
    table = Table(title=f"retrieval serve, {args.images:,}-image Flat index, {args.seconds:.0f} s per row, each query uploaded, k=10")
    for column in ("users", "think s", "max batch", "queries", "queries/s", "p50 ms", "p95 ms", "p99 ms", "errors", f"queries/s vs {most} unbatched"):
        table.add_column(column, justify="right")
    rows = []
    for users, max_batch, think in settings:
        server, url = serve(run, index, max_batch)
        try:
            latencies, errors = load(url, users, args.seconds, think, queries)
        finally:
            server.terminate()
            server.wait()
        milliseconds = np.asarray(latencies or [float("nan")]) * 1000
        rows.append((users, think, max_batch, len(latencies), len(latencies) / args.seconds, *np.percentile(milliseconds, [50, 95, 99]), errors))
        console.print(f"{users} users, think {think:g} s, max batch {max_batch}: {rows[-1][4]:.1f} queries/s, p95 {rows[-1][6]:.0f} ms")
    unbatched = rows[len(settings) - 2][4]
    for users, think, max_batch, count, qps, p50, p95, p99, errors in rows:
        table.add_row(str(users), f"{think:g}", str(max_batch), f"{count:,}", f"{qps:.1f}", f"{p50:.0f}", f"{p95:.0f}", f"{p99:.0f}", str(errors), f"{qps / unbatched:.2f}x")
    console.print(table)


def mixed(args: argparse.Namespace, users: int, run: Path, index: Path, queries: list[Path], console: Console) -> None:
    """The --mixed setting: good and bad uploads under load, with the server's memory (and --baseline's, side by side)."""
    bad = bad_uploads(args.work)
    settings = {"as shipped": {}}
    if args.baseline:
        settings["memory settings off"] = {"RETRIEVAL_TRIM_SECONDS": "0", "GRADIO_ANALYTICS_MAX_EVENTS": "10000", "GRADIO_ANALYTICS_CACHE_FREQUENCY": "1"}
    rows = {}
    for name, environment in settings.items():
        server, url = serve(run, index, 16, environment)
        try:
            if args.warmup > 0:
                mixed_load(url, server.pid, users, args.warmup, queries, bad, args.bad_share)
            rows[name] = mixed_load(url, server.pid, users, args.seconds, queries, bad, args.bad_share)
        finally:
            server.terminate()
            server.wait()
        rows[name]["growth_mib"] = rows[name]["rss_last_mib"] - rows[name]["rss_first_mib"]
    table = Table(
        title=f"retrieval serve, {args.images:,}-image index, {users} users, {args.warmup:.0f} s warm-up then {args.seconds:.0f} s measured, "
        f"{args.bad_share:.0%} bad uploads ({len(bad)} kinds)"
    )
    columns = ("server", "good queries", "failed good", "bad uploads", "bad without a message", "RSS first quarter MiB", "last quarter MiB", "min-max MiB", "growth MiB")
    for column in columns:
        table.add_column(column, justify="right")
    for name, figures in rows.items():
        samples = figures["rss_samples"]
        table.add_row(
            name, f"{figures['good']:,}", str(figures["failed good"]), f"{figures['bad']:,}", str(figures["bad without a message"]),
            f"{figures['rss_first_mib']:.0f}", f"{figures['rss_last_mib']:.0f}", f"{min(samples):.0f}-{max(samples):.0f}", f"{figures['growth_mib']:+.0f}",
        )
    console.print(table)
    if args.json:
        shipped = rows["as shipped"]
        args.json.write_text(json.dumps({**shipped, "users": users, "seconds": args.seconds, "warmup": args.warmup, "rows": rows}, indent=1) + "\n")


def service_only(run: Path, index: Path, good: list[Path], bad: list[Path], bad_share: float, count: int, work: Path, console: Console) -> None:
    """The --mixed queries on app.service.SearchService in this process: its memory before and after."""
    from app.service import SearchService
    from retrieval.runs import RunDir

    service = SearchService(RunDir(run), index, cache=work / "service-cache")
    rng = random.Random(0)
    before = resident_mib(os.getpid())
    for _ in range(count // 4):
        batch = [rng.choice(bad if rng.random() < bad_share else good) for _ in range(4)]
        for result in service.search_images(batch, [10] * 4, [""] * 4, [None] * 4):
            service.thumbnails([hit.id for hit in result.hits])
    console.print(f"search service alone, {count:,} queries ({bad_share:.0%} bad) with thumbnails: resident memory {before:.0f} → {resident_mib(os.getpid()):.0f} MiB")



def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (all its threads), from /proc/PID/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def json_query(client: object, url: str, image: bytes) -> None:
    response = await client.post(f"{url}api/v1/search", params={"k": 10}, content=image)  # type: ignore[attr-defined]
    if response.status_code != 200 or len(response.json()["hits"]) != 10:
        raise ValueError(f"{response.status_code}: {response.text[:200]}")


async def gradio_query(client: object, url: str, image: bytes) -> None:
    """What gradio_client does for /search: upload the file, start the call, read its event stream to the end."""
    uploaded = await client.post(f"{url}gradio_api/upload", files={"files": ("query.png", image, "image/png")})  # type: ignore[attr-defined]
    path = uploaded.json()[0]
    data = [{"path": path, "meta": {"_type": "gradio.FileData"}}, 10, "", 0, False]
    started = await client.post(f"{url}gradio_api/call/search", json={"data": data})  # type: ignore[attr-defined]
    event = started.json()["event_id"]
    stream = await client.get(f"{url}gradio_api/call/search/{event}")  # type: ignore[attr-defined]
    if "event: complete" not in stream.text:
        raise ValueError(stream.text[:200])
    results = json.loads(stream.text.split("event: complete", 1)[1].split("data:", 1)[1].strip().splitlines()[0])
    if len(results[0]) != 10:
        raise ValueError(f"{len(results[0])} results")


async def closed_loop(url: str, clients: int, seconds: float, images: list[bytes], query: object) -> tuple[list[float], int]:
    """clients concurrent loops of queries for seconds; every latency (s) and the number of errors."""
    import httpx

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(limits=limits, timeout=60) as client:
        stop = time.monotonic() + seconds

        async def one(seed: int) -> tuple[list[float], int]:
            rng, latencies, errors = random.Random(seed), [], 0
            while time.monotonic() < stop:
                started = time.perf_counter()
                try:
                    await query(client, url, rng.choice(images))  # type: ignore[operator]
                    latencies.append(time.perf_counter() - started)
                except Exception:  # noqa: BLE001 - every failure counts as an error
                    errors += 1
            return latencies, errors

        done = await asyncio.gather(*(one(seed) for seed in range(clients)))
    return [latency for latencies, _ in done for latency in latencies], sum(errors for _, errors in done)


def asynchronous(args: argparse.Namespace, run: Path, index: Path, queries: list[Path], console: Console) -> None:
    """The default table: the JSON API and the Gradio route under one asynchronous client process; with --against
    or --plain-http, the same rows on each server setting in turn, --rounds times (medians, side by side)."""
    images = [path.read_bytes() for path in queries]
    rows = [("JSON API", int(n), json_query) for n in args.clients.split(",") if n] + [("Gradio /search", int(n), gradio_query) for n in args.gradio_clients.split(",") if n]
    settings = [("this checkout", {})]
    settings += [(f"{checkout}", {CHECKOUT: str(checkout.resolve())}) for checkout in args.against]
    settings += [("h11, asyncio loop", {"PYTHONPATH": str(plain_http_shim(args.work))})] if args.plain_http else []
    measured: dict[tuple[str, str, int], list[dict]] = {}
    for _ in range(args.rounds if len(settings) > 1 else 1):
        for setting, environment in settings:
            server, url = serve(run, index, args.max_batch, environment, model=args.model)
            try:
                for route, clients, figures in load_rows(url, rows, server, images, args):
                    measured.setdefault((setting, route, clients), []).append(figures)
                    console.print(f"{setting}: {route}, {clients} clients: {figures['queries/s']:.1f} queries/s, p95 {figures['p95 ms']:.0f} ms, server CPU {figures['server CPU ms/query']:.2f} ms/query, cores busy {figures['cores busy']:.3f}, server {figures['server MiB']:.0f} MiB")
            finally:
                server.terminate()
                server.wait()
    rounds = len(next(iter(measured.values())))
    table = Table(title=f"retrieval serve --model {args.model}, {args.images:,}-image Flat index, one asynchronous client process, closed loop, {args.seconds:.0f} s per row, k=10{f'; medians of {rounds} alternating rounds' if rounds > 1 else ''}")
    for column in ("server", "route", "clients", "queries", *FIGURES, "errors"):
        table.add_column(column, justify="right")
    for (setting, route, clients), runs in measured.items():
        medians = [float(np.median([figures[name] for figures in runs])) for name in FIGURES]
        table.add_row(setting, route, str(clients), f"{sum(figures['queries'] for figures in runs) // len(runs):,}", *(f"{value:.3f}" if name == "cores busy" else f"{value:.1f}" for name, value in zip(FIGURES, medians)), str(sum(figures["errors"] for figures in runs)))
    console.print(table)


FIGURES = ("queries/s", "p50 ms", "p95 ms", "p99 ms", "server CPU ms/query", "client CPU ms/query", "cores busy", "server MiB")


def plain_http_shim(work: Path) -> Path:
    """A folder that, first on PYTHONPATH, hides httptools and uvloop: uvicorn then serves with h11 and asyncio's loop."""
    shim = work / "plain-http"
    for module in ("httptools", "uvloop"):
        (shim / module).mkdir(parents=True, exist_ok=True)
        (shim / module / "__init__.py").write_text(f"raise ImportError('{module} hidden by bench/app_load.py --plain-http')\n")
    return shim


def load_rows(url: str, rows: list, server: subprocess.Popen, images: list[bytes], args: argparse.Namespace) -> Iterator[tuple[str, int, dict]]:
    """Each row's closed loop against the server at url, after a warm-up: (route, clients, figures)."""
    for _, _, query in rows[:1] + rows[-1:]:  # warm-up: the first calls of each route, thumbnails made
        asyncio.run(closed_loop(url, 4, 3.0, images, query))
    for route, clients, query in rows:
        cpu, own, started = cpu_seconds(server.pid), cpu_seconds(os.getpid()), time.monotonic()
        latencies, errors = asyncio.run(closed_loop(url, clients, args.seconds, images, query))
        used, client = cpu_seconds(server.pid) - cpu, cpu_seconds(os.getpid()) - own
        busy = (used + client) / (time.monotonic() - started)  # of os.cpu_count() cores
        p50, p95, p99 = np.percentile(np.asarray(latencies or [float("nan")]) * 1000, [50, 95, 99])
        per_query = 1000 / max(1, len(latencies))
        yield route, clients, {"queries": len(latencies), "queries/s": len(latencies) / args.seconds, "p50 ms": p50, "p95 ms": p95, "p99 ms": p99, "server CPU ms/query": used * per_query, "client CPU ms/query": client * per_query, "cores busy": busy, "server MiB": resident_mib(server.pid), "errors": errors}
    if args.idle:
        time.sleep(2.0)  # the last row's answers and thumbnails finished
        cpu = cpu_seconds(server.pid)
        time.sleep(args.idle)
        yield "idle (no queries)", 0, {"queries": 0, **dict.fromkeys(FIGURES, float("nan")), "cores busy": (cpu_seconds(server.pid) - cpu) / args.idle, "server MiB": resident_mib(server.pid), "errors": 0}

if __name__ == "__main__":
    main()
