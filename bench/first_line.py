"""How long each command takes to say its first line when the user mistyped a path (the goal: under a second).

Each command runs --runs times in a fresh process (`retrieval`, as a user calls it) with a path that does not
exist; the table gives the median seconds from the start to the first byte it writes, and that line.

    python bench/first_line.py [--runs 5]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

RETRIEVAL = str(Path(sys.executable).with_name("retrieval"))
COMMANDS = [
    ["train", "photos/trian", "--run", "runs/new"],
    ["train", "photos/train"],
    ["export", "runs/nosuchrun"],
    ["index", "runs/nosuchrun", "photos/gallery"],
    ["search", "runs/nosuchrun", "query.jpg"],
    ["evaluate", "runs/nosuchrun", "photos/test"],
    ["index-stats", "runs/nosuchrun"],
    ["serve", "runs/nosuchrun"],
    ["analyze", "photos/trian"],
]


def first_line(arguments: list[str], folder: Path) -> tuple[float, str]:
    """Seconds until the command's first output, and its last line."""
    started = time.perf_counter()
    process = subprocess.Popen([RETRIEVAL, *arguments], cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert process.stdout is not None
    first = process.stdout.read(1)
    seconds = time.perf_counter() - started
    rest = (first + process.communicate()[0]).decode(errors="replace").strip().splitlines()
    return seconds, rest[-1] if rest else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--work", type=Path, default=Path("/tmp/first_line"))
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    table = Table(title=f"seconds to the first line of a mistyped path, median of {args.runs} fresh processes")
    for column in ("command", "seconds", "what it said"):
        table.add_column(column)
    for command in COMMANDS:
        measured = [first_line(command, args.work) for _ in range(args.runs)]
        seconds = statistics.median(time for time, _ in measured)
        table.add_row("retrieval " + " ".join(command), f"{seconds:.2f}", measured[-1][1][:90])
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
