"""How long each command takes to end after its last line, with the interpreter's last collection skipped (as
shipped: `retrieval.commands` freezes the objects still alive at exit) and with it done (the freeze taken back).

Each command runs in a fresh process, the two ways alternated, --rounds times; the table gives the medians of the
seconds from the start to the process's end, and from its last output to its end. `serve` is stopped by SIGTERM
(what Ctrl+C does) a second after it says where it serves, and so is the demo, trained anew on 4 classes for 2 epochs
(the first stop a new user meets is the end of `make demo`). The run is copied into --work first (evaluate writes
its metrics into the run); train runs one epoch on a few classes of the icons' test split.

    python bench/exit.py [--run runs/demo] [--rounds 3] [--commands index-stats,search,evaluate,train,serve,demo]
"""

from __future__ import annotations

import argparse
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

BENCH = Path(__file__).resolve().parent
sys.path = [entry for entry in sys.path if Path(entry or ".").resolve() != BENCH]  # bench/index.py is not index/
from retrieval.datasets import icons  # noqa: E402

sys.path.append(str(BENCH))  # after the packages
from app_load import RETRIEVAL, free_port  # noqa: E402

NAMES = ("index-stats", "search", "evaluate", "train", "serve", "demo")
# the same command with the freeze taken back: the interpreter's last collection walks every object, as it did
COLLECTED = (
    "import atexit, gc, sys; from retrieval.commands import main; code = main(sys.argv[1:]); "
    "atexit.unregister(gc.freeze); sys.exit(code)"
)
WAYS = {"skipped (shipped)": [RETRIEVAL], "done": [sys.executable, "-c", COLLECTED]}


def timed(command: list[str], stop_when: str | None) -> tuple[float, float]:
    """Seconds from the start to the end of the process, and from its last output to its end. With stop_when, the
    process gets SIGTERM a second after printing a line that holds it."""
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert process.stdout is not None
    last = started
    for line in process.stdout:
        last = time.perf_counter()
        if stop_when and stop_when in line:
            time.sleep(1)
            process.send_signal(signal.SIGTERM)
    process.wait()
    ended = time.perf_counter()
    if process.returncode != 0:
        sys.exit(f"{' '.join(command)}: exit status {process.returncode}")
    return ended - started, ended - last


def commands(run: Path, work: Path) -> dict[str, tuple[list[str], str | None]]:
    """The commands timed, by name, with the line after which each is stopped (None: it ends by itself)."""
    test = icons() / "test"
    few = work / "few"
    if not few.exists():
        for folder in sorted(test.iterdir())[:4]:
            shutil.copytree(folder, few / folder.name)
    query = str(min(few.rglob("*.png")))
    return {
        "index-stats": (["index-stats", str(run)], None),
        "search": (["search", str(run), query, "-k", "5"], None),
        "evaluate": (["evaluate", str(run), str(test)], None),
        "train": (["train", str(few), "--run", str(work / "train"), "--overwrite", "--epochs", "1"], None),
        "serve": (["serve", str(run), "--port", str(free_port())], "serving the search app"),
        "demo": (
            [
                "demo",
                "--run",
                str(work / "demo"),
                "--retrain",
                "--classes",
                "4",
                "--epochs",
                "2",
                "--port",
                str(free_port()),
            ],
            "serving the search app",
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", type=Path, default=Path("runs/demo"), help="a run with a model and an index")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--work", type=Path, default=Path("/tmp/bench_exit"))
    parser.add_argument("--commands", default=",".join(NAMES), help="comma-separated, of " + ", ".join(NAMES))
    args = parser.parse_args()
    chosen = args.commands.split(",")
    if unknown := set(chosen) - set(NAMES):
        parser.error(f"--commands: unknown {', '.join(sorted(unknown))}; choose from {', '.join(NAMES)}")
    if not (args.run / "model.onnx").is_file():
        parser.error(f"--run {args.run}: no exported run there; make demo makes runs/demo")
    run = args.work / "run"  # a fresh copy of the run asked for, not one an earlier call left
    shutil.rmtree(run, ignore_errors=True)
    shutil.copytree(args.run, run)
    table = Table(title=f"seconds, medians of {args.rounds} fresh processes a way, the two ways alternated")
    for column in ("command", "last collection", "start to end", "last line to end"):
        table.add_column(column)
    for name, (arguments, stop_when) in commands(run, args.work).items():
        if name not in chosen:
            continue
        measured: dict[str, list[tuple[float, float]]] = {way: [] for way in WAYS}
        for _ in range(args.rounds):
            for way, prefix in WAYS.items():
                measured[way].append(timed([*prefix, *arguments], stop_when))
        for way, times in measured.items():
            total, tail = (statistics.median(part) for part in zip(*times, strict=True))
            table.add_row(name, way, f"{total:.2f}", f"{tail:.2f}")
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
