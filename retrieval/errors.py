"""The one exception family of the project: a message a user can act on."""

from __future__ import annotations


class RetrievalError(Exception):
    """A problem with the user's input or artifacts; the CLI prints it as one line, the app as a message."""


class ImageError(RetrievalError):
    """An image file that cannot be decoded safely (missing, truncated, not an image, too large)."""

    def __init__(self, name: object, reason: str) -> None:
        super().__init__(f"{name}: {reason}")
        self.reason = reason
