"""Memory upkeep of a long-running server: freed heap memory handed back to the system every few seconds."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import threading
import time

from retrieval.errors import RetrievalError

TRIM_VARIABLE = "RETRIEVAL_TRIM_SECONDS"  # how often freed heap memory is handed back to the system (0: never)
TRIM_SECONDS = 10.0


def release_memory_periodically(every: float | None = None) -> threading.Thread | None:
    """Hands the memory that concurrent requests freed back to the system every few seconds (glibc's malloc_trim).

    The server's threads decode uploads, embed and answer side by side; glibc keeps what they free in
    per-thread arenas, so without this the resident memory climbs for many minutes under load
    (bench/app_load.py --mixed). Every RETRIEVAL_TRIM_SECONDS seconds (default 10; 0: never). Not
    glibc (macOS, musl): nothing to do, returns None. One thread per process and interval: later calls return it.
    """
    if every is None:
        try:
            every = float(os.environ.get(TRIM_VARIABLE, TRIM_SECONDS))
        except ValueError:
            raise RetrievalError(
                f"{TRIM_VARIABLE}={os.environ[TRIM_VARIABLE]!r}: give a number of seconds (0: never)"
            ) from None
    return _trimming(every) if every > 0 else None


@functools.cache
def _trimming(every: float) -> threading.Thread | None:
    """The thread that calls malloc_trim every `every` seconds, started once (None without glibc)."""
    name = ctypes.util.find_library("c")
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    if trim is None:
        return None

    def loop() -> None:
        while True:
            time.sleep(every)
            trim(0)

    thread = threading.Thread(target=loop, name="malloc-trim", daemon=True)
    thread.start()
    return thread
