"""Progress of long work: a tqdm bar on a terminal, one summary line per bar when the output is a file or a pipe.

A bar redrawn into a log file (CI, `make demo > log`) is hundreds of carriage-return updates on one
line; there, each bar prints a single line when it closes instead: what was done, how much, how fast.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any

from tqdm import tqdm


def interactive() -> bool:
    """Whether progress goes to a terminal (stderr), where a bar can redraw itself."""
    return bool(getattr(sys.stderr, "isatty", lambda: False)())


def progress(
    iterable: Iterable | None = None,
    *,
    total: int | None = None,
    desc: str = "",
    unit: str = "it",
    enabled: bool = True,
    leave: bool = True,
) -> Any:
    """A tqdm bar on a terminal; elsewhere a LineProgress (one line when done); nothing when not enabled."""
    if enabled and not interactive():
        return LineProgress(iterable, total=total, desc=desc, unit=unit, leave=leave)
    return tqdm(iterable, total=total, desc=desc, unit=unit, disable=not enabled, leave=leave)


def say(line: str) -> None:
    """Prints a line of news (an epoch's loss, a resumed run) to stdout without breaking a bar being drawn.

    Flushed at once: a log file (block-buffered) shows each epoch when it ends, not at exit.
    """
    tqdm.write(line)
    sys.stdout.flush()


class LineProgress:
    """The part of tqdm's interface the project uses, printing `desc: n/total unit in s (rate/s)` once, on close.

    leave=False (a bar inside a loop that reports each pass itself) prints nothing.
    """

    def __init__(self, iterable: Iterable | None, total: int | None, desc: str, unit: str, leave: bool) -> None:
        self.iterable, self.desc, self.unit, self.leave = iterable, desc, unit, leave
        self.total = total if total is not None else (len(iterable) if hasattr(iterable, "__len__") else None)  # type: ignore[arg-type]
        self.n, self.started, self.closed = 0, time.perf_counter(), False

    def __iter__(self) -> Iterator:
        for value in self.iterable or ():
            yield value
            self.n += 1
        self.close()

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def update(self, n: int = 1) -> None:
        self.n += n

    def set_postfix(self, **values: object) -> None:
        """Ignored: a line is printed only at the end."""

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.leave:
            seconds = time.perf_counter() - self.started
            done = f"{self.n:,}" + (f"/{self.total:,}" if self.total is not None else "")
            rate = self.n / max(seconds, 1e-9)
            print(f"{self.desc}: {done} {self.unit} in {seconds:.1f} s ({rate:,.0f} {self.unit}/s)", file=sys.stderr)
