"""Counts in the words of a message: "1 image", "311 images", never "image(s)"."""

from __future__ import annotations


def counted(count: int, noun: str, plural: str = "") -> str:
    """count (with thousands separated) and the noun it counts, singular for 1 (plural: where an added s is wrong)."""
    return f"{count:,} {noun if count == 1 else plural or noun + 's'}"
