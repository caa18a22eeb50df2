"""The one exception family of the project, and its kinds: a message a user can act on, typed for callers.

Every error carries a kind (`ErrorKind`) beside its message, so that each caller maps it to what it
needs without reading the words: the command line to its exit status, the JSON API to an HTTP
status, the app to a message. Per-query failures of the search path are values (`Failure`), the
same kind and message, so that one bad query of a batch fails alone.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from numbers import Integral


class ErrorKind(Enum):
    """What went wrong, as callers tell it apart."""

    INVALID = "invalid"  # a value or file the user gave is wrong: out of range, malformed, missing, damaged
    UNREADABLE_IMAGE = "unreadable image"  # an image that cannot be read or decoded safely
    UNKNOWN_ID = "unknown id"  # no indexed item has that id
    UNKNOWN_LABEL = "unknown label"  # no indexed item has that label


class RetrievalError(Exception):
    """A problem with the user's input or artifacts; the CLI prints it as one line, the app as a message."""

    def __init__(self, message: str, kind: ErrorKind = ErrorKind.INVALID) -> None:
        super().__init__(message)
        self.kind = kind


class ImageError(RetrievalError):
    """An image file that cannot be decoded safely (missing, truncated, not an image, too large)."""

    def __init__(self, name: object, reason: str) -> None:
        super().__init__(f"{name}: {reason}", ErrorKind.UNREADABLE_IMAGE)
        self.reason = reason


def whole_number(value: object) -> bool:
    """Whether value is a whole number of any integer type (numpy's too): not 2.5, "8" or True."""
    return isinstance(value, Integral) and not isinstance(value, bool)


def require_whole(name: str, value: object, least: int) -> int:
    """value as an int; refuses, naming it, what is not a whole number (2.5, "8", True) or is below least, where it
    would fail deep inside a library or, below least, do nothing without a word."""
    if not whole_number(value):
        raise RetrievalError(f"{name}={value!r}: give a whole number")
    if value < least:
        raise RetrievalError(f"{name} must be at least {least}, got {value}")
    return int(value)


@dataclass(frozen=True)
class Failure:
    """Why one query (or one item of a batch) failed: its kind and the message for people."""

    kind: ErrorKind
    message: str

    @classmethod
    def of(cls, error: RetrievalError) -> Failure:
        """The failure an error describes."""
        return cls(error.kind, str(error))

    def error(self) -> RetrievalError:
        """The error to raise for it, where a caller stops at the first failure (the command line)."""
        return RetrievalError(self.message, self.kind)


def one_of(given: str, known: Iterable[str]) -> str:
    """ "choose one of a, b, c" for a name that is none of them, led by "did you mean 'b'?" where it looks like a
    misspelling (or another case) of one."""
    names = list(known)
    close = difflib.get_close_matches(given.lower(), names, n=1, cutoff=0.75)
    return ("" if not close else f"did you mean {close[0]!r}? ") + f"choose one of {', '.join(names)}"
