"""Load on the search app: N concurrent gradio_client users querying a 10,000-image index for a fixed time.

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

    python bench/app_load.py [--users 1,4,16] [--seconds 30] [--think 1.0] [--images 10000] [--work /tmp/app_load]
"""

from __future__ import annotations

import argparse
import multiprocessing
import random
import socket
import subprocess
import sys
import time
import urllib.request
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


def prepare(work: Path, images: int) -> tuple[Path, Path, list[Path]]:
    """The run, its 10,000-image index and the query images (made once, reused by later runs)."""
    run, index = work / "run", work / f"index-{images}"
    if not (run / "model.onnx").is_file():
        subprocess.run([RETRIEVAL, "demo", "--no-serve", "--run", str(run), "--classes", "8", "--epochs", "2"], check=True, stdout=subprocess.DEVNULL)
    sources = sorted((icons() / "train").rglob("*.png")) + sorted((icons() / "test").rglob("*.png"))
    gallery, queries = work / f"gallery-{images}", work / "queries"
    if not gallery.is_dir():
        variants(sources, images, gallery, seed=1)
    if not queries.is_dir():
        variants(sources[::7], 100, queries, seed=2)
    if not (index / "manifest.json").is_file():
        subprocess.run([RETRIEVAL, "index", str(run), str(gallery), "--index", str(index)], check=True, stdout=subprocess.DEVNULL)
    return run, index, sorted(queries.rglob("*.png"))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def serve(run: Path, index: Path, max_batch: int) -> tuple[subprocess.Popen, str]:
    """Starts `retrieval serve` and waits until it answers."""
    port = free_port()
    server = subprocess.Popen(
        [RETRIEVAL, "serve", str(run), "--index", str(index), "--port", str(port), "--max-batch", str(max_batch)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
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
    parser.add_argument("--users", default="1,4,16", help="numbers of concurrent users, separated by commas")
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--think", type=float, default=1.0, help="mean pause of a user between queries, in the last row (uniform 0.5-1.5x)")
    parser.add_argument("--images", type=int, default=10_000)
    parser.add_argument("--work", type=Path, default=Path("/tmp/app_load"))
    args = parser.parse_args()
    console = Console(width=150)
    run, index, queries = prepare(args.work, args.images)
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


if __name__ == "__main__":
    main()
