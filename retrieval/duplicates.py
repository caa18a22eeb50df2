"""Copies of the same picture in a collection, and across two: identical bytes, or the same picture re-encoded,
resized, cropped a little or in grey.

Candidate pairs come from two cheap searches, so that no pair of images is compared one by one: each
image's nearest neighbours by embedding, and by a perceptual hash (the signs of the 8 x 8 lowest
frequencies of a 32 x 32 grey DCT, searched by Hamming distance with FAISS) — the hash finds the
grey copies a colour-trained embedding puts apart. Each candidate pair is then checked on the
pictures themselves (the thumbnails kept while embedding): first at 12 px in grey, COARSE_BLOCK pairs at
once (most pairs stop there), then one picture is aligned on the other over crops of 90-100 % of each side,
roughly at 24 px (a pixel's shift forgiven; each picture's crops drawn once, ROUGH_BLOCK pairs compared
in one array operation) and finely at 32 px around the best crop (FINE_BLOCK pairs at once; pairs still far
apart after two rounds stop there), and
`difference` is the share of the drawn pixels that still differ by more than PIXEL_CUT (in grey when
either picture is grey). A pair is a copy at difference <= COPY_DIFFERENCE, measured in
bench/audit.py (docs/trust.md). From SHARED_PAIRS candidate pairs on, the checks are shared out over
the usable cores (this process and a worker process per other core, run as `python -m
retrieval.duplicates FOLDER`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from functools import lru_cache
from pathlib import Path

import numpy as np
from PIL import Image

from retrieval.extras import require
from retrieval.knn import Neighbours, nearest_neighbours
from retrieval.progress import progress

THUMBNAIL = 64  # pixels a side of the pictures kept while embedding
PIXEL_CUT = 0.1  # a pixel differs when a channel moves by more than this (of 1.0)
COPY_DIFFERENCE = 0.009  # the share of drawn pixels up to which two pictures are copies (bench/audit.py)
CANDIDATES = 10  # neighbours by embedding and by hash checked per image
HASH_BITS = 20  # hash neighbours farther than this many of 64 bits are not checked
COARSE = 12  # pixels a side of the first check of every candidate pair, in grey
COARSE_CUT = 0.15  # a coarse pixel differs when it is this far outside its neighbours' range in the other picture
COARSE_BOUND = 0.02  # pairs whose coarse pictures differ in more of their drawn pixels are not copies (bench/audit.py)
COARSE_BLOCK = 4096  # pairs given the coarse check at once (all 136,000 of 10,000 pictures at once: 11x the time)
SCALES = (1.0, 0.95, 0.9)  # the crops tried when aligning one picture on the other
ROUGH = (24, 5)  # pixels a side and crop places along each side of the rough alignment (grey, a pixel's shift forgiven)
ROUGH_BOUND = 0.06  # pairs whose best rough crop differs in more of their drawn pixels are not copies
FINE_ROUNDS = 4  # rounds of the fine search, each around the last one's best crop at half its step
FINE_SIDE = 32  # pixels a side of the fine search (sibling icons differ by a few pixels' detail)
GIVE_UP = (2, 0.15)  # after this many fine rounds, pairs still farther apart than this are not copies (bench/audit.py)
CONFIRM_SIDE = 48  # pixels a side of the last round, for pairs the fine search leaves within CONFIRM_BOUND
CONFIRM_BOUND = 0.05  # pairs farther apart after the fine search are not copies; nearer ones are confirmed finer
GREY_CUT = 0.05  # PIXEL_CUT of a grey picture against a colour one: greying is exact, so its luma must match closely
CHROMA = np.array([[0.299, 0.587, 0.114], [-0.169, -0.331, 0.5], [0.5, -0.419, -0.081]], np.float32)  # JPEG's YCbCr
PAIR_BLOCK = 256  # pictures judged grey at once
VIEW_BLOCK = 16  # pictures whose rough crops are drawn at once (their row products, 1.3 MB, stay in the cache)
ROUGH_BLOCK = 8  # pairs given the rough check at once: their crops (1 MB) stay in the core's cache (256: 1.7x the time)
BLUR_PLANES = 128  # chroma planes blurred at once (about 0.6 MB)
FINE_BLOCK = 8  # pairs given the fine search at once (larger blocks fall out of the cache: slower, measured)
LUMA = np.array([0.299, 0.587, 0.114], np.float32)  # Pillow's grey
BYTES = np.divide(np.arange(256, dtype=np.uint8), 255, dtype=np.float32)  # each byte's value as the checks read it
# per byte, as the float checks read it: the bytes under BELOW[byte] are under it by more than PIXEL_CUT, and the
# bytes over ABOVE[byte] over it
BELOW = np.searchsorted(BYTES, BYTES - PIXEL_CUT).astype(np.uint8)
ABOVE = (np.searchsorted(BYTES, BYTES + PIXEL_CUT, side="right") - 1).astype(np.uint8)
SHARED_PAIRS = 2000  # candidate pairs from which the checks are shared out over the cores (a process's start: ~1 s)


class CopyKind(Enum):
    """How two images are the same picture."""

    IDENTICAL = "identical bytes"
    NEAR = "near copy"


@dataclass(frozen=True)
class CopyPair:
    """Rows a and b (of one collection, or a of the first and b of the second) hold the same picture."""

    a: int
    b: int
    kind: CopyKind
    difference: float  # the share of pixels that differ after alignment (0 for identical bytes)


def perceptual_hashes(thumbnails: np.ndarray) -> np.ndarray:
    """[N, 8] uint8: each picture's 64-bit DCT hash, packed (grey 32 x 32, low 8 x 8 frequencies above their median).
    The frequencies are rounded to a millionth first: those that are equal (a symmetric picture's zeros) then stay
    equal, where rounding errors of the products would otherwise decide their bits, differently for each way of
    summing them."""
    grey = np.stack([_grey_square(picture) for picture in thumbnails]) if len(thumbnails) else np.zeros((0, 32, 32))
    basis = np.cos(np.pi * (2 * np.arange(32)[None] + 1) * np.arange(8)[:, None] / 64)  # DCT-II rows
    low = np.round(basis @ grey.astype(np.float64) @ basis.T, 6).reshape(len(grey), 64)
    return np.packbits(low > np.median(low, axis=1, keepdims=True), axis=1)


def _grey_square(picture: np.ndarray) -> np.ndarray:
    return np.asarray(Image.fromarray(picture).convert("L").resize((32, 32), Image.BILINEAR), np.float32)


Box = tuple[float, float, float]  # a square crop: left, top and side, in shares of the picture's side


@lru_cache(maxsize=8)
def _boxes(places: int) -> list[Box]:
    """The whole picture, then crops at SCALES, at places positions along each side."""
    boxes = []
    for scale in SCALES:
        for fx in np.linspace(0, 1, places if scale < 1 else 1):
            boxes += [
                ((1 - scale) * fx, (1 - scale) * fy, scale) for fy in np.linspace(0, 1, places if scale < 1 else 1)
            ]
    return boxes


@dataclass(frozen=True)
class _Crops:
    """Square crops of P pictures on an I x K x J grid: I sides, each with K left and J top places (inside the
    picture). Row spans depend on (side, top), column spans on (side, left): 9 of each make 27 crops."""

    lefts: np.ndarray  # [P, I, K]
    tops: np.ndarray  # [P, I, J]
    sides: np.ndarray  # [P, I]
    valid: np.ndarray  # [P, I * K * J]: the crop exists (a side above the whole picture's does not)

    @classmethod
    def whole(cls, count: int) -> _Crops:
        zeros = np.zeros((count, 1, 1))
        return cls(zeros, zeros, np.ones((count, 1)), np.ones((count, 1), bool))

    def box(self, crop: np.ndarray) -> np.ndarray:
        """[P, 3]: the (left, top, side) of each picture's crop number crop ([P], flat over I, K, J)."""
        i, k, j = np.unravel_index(crop, (self.sides.shape[1], self.lefts.shape[2], self.tops.shape[2]))
        rows = np.arange(len(crop))
        return np.stack([self.lefts[rows, i, k], self.tops[rows, i, j], self.sides[rows, i]], axis=1)


def _around(boxes: np.ndarray, step: float) -> _Crops:
    """The crops near each box ([P, 3]: side and place +- step, inside the picture): a round of the fine search."""
    offsets = np.array([-step, 0.0, step])
    sides = boxes[:, 2:] + offsets  # [P, 3]
    valid = (sides > 0) & (sides <= 1)
    sides = np.where(valid, sides, boxes[:, 2:])  # the box itself stands in for a crop that does not exist
    lefts = np.minimum(np.maximum(boxes[:, None, :1] + offsets, 0), 1 - sides[:, :, None])
    tops = np.minimum(np.maximum(boxes[:, None, 1:2] + offsets, 0), 1 - sides[:, :, None])
    return _Crops(lefts, tops, sides, np.repeat(valid, 9, axis=1))


@lru_cache(maxsize=8192)
def _weights(side: int, size: int, start: float, width: float) -> np.ndarray:
    """[side, size]: each output pixel the mean of the input pixels its span [start, start + width) covers (area
    resampling, as a matrix: every crop of a picture is then two matrix products)."""
    edges = start + width * np.arange(side + 1) / side
    pixels = np.arange(size)[None]
    overlap = np.clip(np.minimum(edges[1:, None], pixels + 1) - np.maximum(edges[:-1, None], pixels), 0, None)
    return (overlap / overlap.sum(axis=1, keepdims=True)).astype(np.float32)


def _area_weights(side: int, size: int, start: np.ndarray, width: np.ndarray) -> np.ndarray:
    """[..., side, size]: _weights for arrays of spans (start and width in shares of the side, broadcast together),
    each distinct span's built once (the fine search's spans come from a small grid; _weights keeps them)."""
    start, width = np.broadcast_arrays(np.round(start * size, 3), np.round(width * size, 3))
    table = [_weights(side, size, at, span) for at, span in zip(start.ravel().tolist(), width.ravel().tolist())]
    return np.stack(table).reshape(*start.shape, side, size)


@dataclass(frozen=True)
class _Resampling:
    """The matrices that resample a picture to a list of crops: one per distinct span of rows (crops share them: the
    fine search's 27 crops have 9), and each crop's for its columns."""

    rows: np.ndarray  # [T, side, size]
    columns: np.ndarray  # [V, 1, size, side]: each crop's, transposed
    top: np.ndarray  # [V] each crop's index into rows


@lru_cache(maxsize=4096)
def _resampling(side: int, size: int, boxes: tuple[Box, ...]) -> _Resampling:
    def span(start: float, width: float) -> tuple[float, float]:
        return round(start * size, 3), round(width * size, 3)

    tops = sorted({span(y, w) for _, y, w in boxes})
    top = np.array([tops.index(span(y, w)) for _, y, w in boxes])
    columns = np.stack([_weights(side, size, *span(x, w)) for x, _, w in boxes])
    return _Resampling(np.stack([_weights(side, size, *spans) for spans in tops]), columns[:, None].swapaxes(2, 3), top)


def _neighbourhood(planes: np.ndarray) -> list[np.ndarray]:
    """9 flat views over the planes ([N, S, S]) with their edges repeated: each pixel's neighbour one pixel away in
    every direction (and itself), in rows of S + 2; _inside takes each plane's S x S pixels back out. Flat, so that
    numpy runs every operation on them as one contiguous loop, not one per row of a plane."""
    side = planes.shape[-1]
    wide = side + 2
    padded = np.empty((len(planes), wide, wide), planes.dtype)  # np.pad's "edge", without its overhead
    padded[:, 1:-1, 1:-1] = planes
    padded[:, 1:-1, 0], padded[:, 1:-1, -1] = planes[:, :, 0], planes[:, :, -1]
    padded[:, 0], padded[:, -1] = padded[:, 1], padded[:, -2]
    flat, length = padded.reshape(-1), padded.size - 2 * (wide + 1)
    return [flat[i * wide + j : i * wide + j + length] for i in range(3) for j in range(3)]


def _inside(values: np.ndarray, count: int, side: int) -> np.ndarray:
    """[count, side, side]: each plane's pixels of values computed over _neighbourhood's flat views."""
    wide = side + 2
    whole = np.empty(count * wide * wide, values.dtype)
    whole[: len(values)] = values
    return whole.reshape(count, wide, wide)[:, :side, :side]


def _spread(view: np.ndarray, side: int, reach: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """Each pixel's lowest and highest value once moved by up to reach of a pixel towards its 3 x 3 neighbours (a
    shift by that much stays inside); at a reach of one pixel, the neighbourhood's own range (of bytes too)."""
    shifted = _neighbourhood(view.reshape(len(view), side, side))
    planes = shifted[4]
    low, high = planes.copy(), planes.copy()
    for plane in shifted:
        moved = plane if reach == 1 else planes + reach * (plane - planes)
        np.minimum(low, moved, out=low)
        np.maximum(high, moved, out=high)
    return _inside(low, len(view), side).reshape(view.shape), _inside(high, len(view), side).reshape(view.shape)


def _blur(planes: np.ndarray) -> np.ndarray:
    """[N, S, S]: each pixel the mean of its 3 x 3 neighbourhood (edges repeated); BLUR_PLANES planes at a time, whose
    sums stay in the core's cache (twice as fast as all at once, measured)."""
    blurred = np.empty_like(planes)
    for start in range(0, len(planes), BLUR_PLANES):
        part = planes[start : start + BLUR_PLANES]
        shifted = _neighbourhood(part)
        total = shifted[0].copy()
        for plane in shifted[1:]:
            total += plane
        total /= 9
        blurred[start : start + BLUR_PLANES] = _inside(total, len(part), planes.shape[-1])
    return blurred


def _coarse(thumbnails: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Each picture in grey at COARSE pixels a side: values, their lowest and highest over each 3 x 3 neighbourhood
    (a 10 % crop moves nothing farther), and which pixels are drawn; [N, COARSE**2] each."""
    grey = [Image.fromarray(picture).convert("L").resize((COARSE, COARSE), Image.BOX) for picture in thumbnails]
    values = (
        np.stack([np.asarray(image, np.float32) / 255 for image in grey]) if grey else np.zeros((0, COARSE, COARSE))
    )
    low, high = _spread(values, COARSE)
    flat = values.reshape(len(values), -1)
    drawn = np.abs(flat - np.median(flat, axis=1, keepdims=True)) > PIXEL_CUT
    return flat, low.reshape(flat.shape), high.reshape(flat.shape), drawn


def _coarse_filter(mine: tuple, theirs: tuple, pairs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The pairs whose coarse pictures, either within the other's neighbourhood range, differ in at most
    COARSE_BOUND of their drawn pixels: vectorised over COARSE_BLOCK pairs at a time, it drops most candidates before
    any crop is tried."""
    if not pairs:
        return []
    a, b = np.array(pairs).T

    def share(x: tuple, rows: np.ndarray, y: tuple, others: np.ndarray) -> np.ndarray:
        outside = (x[0][rows] < y[1][others] - COARSE_CUT) | (x[0][rows] > y[2][others] + COARSE_CUT)
        return outside.sum(axis=1) / np.maximum((x[3][rows] | y[3][others]).sum(axis=1), 1)

    kept = np.zeros(len(pairs), bool)
    for start in range(0, len(pairs), COARSE_BLOCK):
        x, y = a[start : start + COARSE_BLOCK], b[start : start + COARSE_BLOCK]
        kept[start : start + COARSE_BLOCK] = (
            np.minimum(share(mine, x, theirs, y), share(theirs, y, mine, x)) <= COARSE_BOUND
        )
    return [pair for pair, keep in zip(pairs, kept.tolist(), strict=True) if keep]


def difference(first: np.ndarray, second: np.ndarray) -> float:
    """The share of the drawn pixels of two pictures (thumbnails) that differ by more than PIXEL_CUT once the crop
    of either that fits the other best is found (in grey when either is grey): roughly over a grid of crops in grey,
    then finely around the best one."""
    return float(_differences(np.stack([first]), np.stack([second]), [(0, 0)])[0])


def _rough_views(pictures: np.ndarray) -> np.ndarray:
    """[N, V, 1, D] bytes: the grey plane of each picture's views over the rough grid (one per row, not per pair)."""
    side, boxes = ROUGH[0], _boxes(ROUGH[1])
    resampling = _resampling(side, pictures.shape[-2], tuple(boxes))
    # the crops grouped by their rows' resampling, so that each group's column products are written in place from
    # its row product (not from a copy of it per crop)
    order = np.argsort(resampling.top, kind="stable")
    ends = np.searchsorted(resampling.top[order], np.arange(len(resampling.rows) + 1))
    columns = resampling.columns[order]
    views = np.zeros((len(pictures), len(boxes), 1, side * side), np.uint8)
    crops = np.empty((VIEW_BLOCK, len(boxes), 1, side, side), np.float32)
    for start in range(0, len(pictures), VIEW_BLOCK):  # a block of pictures at a time: their products stay in the cache
        grey = (pictures[start : start + VIEW_BLOCK].astype(np.float32) / 255 @ LUMA)[:, None, None]
        tall, done = resampling.rows[:, None] @ grey, crops[: len(grey)]  # [B, T, 1, side, S]
        for top, (first, last) in enumerate(zip(ends[:-1], ends[1:])):
            np.matmul(tall[:, top, None], columns[first:last], out=done[:, first:last])
        np.rint(np.multiply(done, 255, out=done), out=done)
        views[start : start + len(grey), order] = done.reshape(len(grey), len(boxes), 1, side * side)
    return views


@dataclass(frozen=True)
class _Wholes:
    """What crops are compared with, per picture: its whole view, that view's range once moved by up to a given
    share of a pixel, its background (median) and which of its pixels are drawn."""

    views: np.ndarray  # [N, C, D]
    low: np.ndarray  # [N, C, D]
    high: np.ndarray  # [N, C, D]
    background: np.ndarray  # [N, C, 1]
    drawn: np.ndarray  # [N, D]

    @classmethod
    def of(cls, views: np.ndarray, side: int, reach: float) -> _Wholes:
        low, high = _spread(views.reshape(-1, views.shape[-1]), side, reach)
        return cls(views, low.reshape(views.shape), high.reshape(views.shape), *_background(views))


def _background(views: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Of whole views ([N, C, D] floats): each one's background (median, [N, C, 1]) and which of its pixels are drawn
    (apart from it by more than PIXEL_CUT in some plane, [N, D])."""
    background = np.median(views, axis=2, keepdims=True)
    return background, (np.abs(views - background) > PIXEL_CUT).any(axis=1)


@dataclass(frozen=True)
class _ByteWholes:
    """What the rough check compares a crop (bytes) with: the whole picture's view and its tests of a pixel, as bounds
    on the pixel's byte. Each pixel is decided as _drawn_shares decides it on the floats the bytes stand for (the
    whole views in _Wholes, forgiving a pixel's shift), to the bit: each test is the float test itself, run once on
    the 256 bytes (a background halfway between two bytes puts pixels exactly PIXEL_CUT from it, which the floats'
    rounding decides either way), and a neighbourhood's range is that of its bytes."""

    views: np.ndarray  # [N, 1, D] float: the whole views, for the tie-break
    below: np.ndarray  # [N, 1, D] uint8: a byte under it is below the pixel's neighbourhood range by more than the cut
    above: np.ndarray  # [N, 1, D]: a byte over it is above the range by more than the cut
    plain_low: np.ndarray  # [N, 1, 1]: a byte under it is drawn (apart from the background by more than PIXEL_CUT)
    plain_high: np.ndarray  # [N, 1, 1]: a byte over it is drawn
    drawn: np.ndarray  # [N, D]: the whole view's drawn pixels

    @classmethod
    def of(cls, views: np.ndarray, side: int) -> _ByteWholes:
        """Of whole views as bytes ([N, 1, side * side])."""
        low, high = (bound.reshape(views.shape) for bound in _spread(views[:, 0], side))
        floats = views.astype(np.float32) / 255
        background, drawn = _background(floats)
        plain = ~np.greater(np.abs(BYTES - background[:, 0]), PIXEL_CUT)  # [N, 256], as _drawn_shares tests a pixel
        first, last = plain.argmax(axis=1), 255 - plain[:, ::-1].argmax(axis=1)  # a byte near the background is plain
        return cls(
            floats,
            BELOW[low],
            ABOVE[high],
            first.astype(np.uint8)[:, None, None],
            last.astype(np.uint8)[:, None, None],
            drawn,
        )


def _byte_shares(crops: np.ndarray, wholes: _ByteWholes, rows: np.ndarray) -> np.ndarray:
    """[P, V]: _drawn_shares of grey crops given as bytes ([P, V, 1, D] uint8) on the wholes at rows, to the bit."""
    outside = np.less(crops, wholes.below[rows][:, None])
    outside |= np.greater(crops, wholes.above[rows][:, None])
    differing = _counts(outside[:, :, 0])
    drawn = np.greater(crops, wholes.plain_high[rows][:, None], out=outside)
    drawn |= np.less(crops, wholes.plain_low[rows][:, None])
    return differing / np.maximum(_counts(drawn[:, :, 0] | wholes.drawn[rows][:, None]), 1)


def _shares(crops: np.ndarray, wholes: _Wholes, rows: np.ndarray, cut: float = PIXEL_CUT) -> np.ndarray:
    """[P, V]: per pair, the share of each crop's drawn pixels ([P, V, C, D]) that differ by more than cut from
    the whole picture of its row of wholes (outside its spread range), ties broken by the mean difference so that
    the crop that fits best wins; one array operation over a block of pairs."""
    return _drawn_shares(crops, wholes, rows, cut) + _closeness(crops, wholes.views, rows)


def _drawn_shares(crops: np.ndarray, wholes: _Wholes, rows: np.ndarray, cut: float = PIXEL_CUT) -> np.ndarray:
    """[P, V]: _shares without its tie-break, which only adds (under 0.001)."""
    low, high = wholes.low[rows][:, None] - cut, wholes.high[rows][:, None] + cut
    outside = np.less(crops, low)  # in place where it can be: fewer arrays made and passed over
    outside |= np.greater(crops, high)
    differing = _counts(_across_planes(outside))
    apart = np.subtract(crops, wholes.background[rows][:, None])
    np.abs(apart, out=apart)
    drawn = _across_planes(np.greater(apart, PIXEL_CUT, out=outside)) | wholes.drawn[rows][:, None]
    return differing / np.maximum(_counts(drawn), 1)


def _closeness(crops: np.ndarray, wholes: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """[P, V]: _shares' tie-break, the mean difference of each crop from its whole picture (wholes: their views, [N, C,
    D]), scaled under 0.001."""
    apart = np.subtract(crops, wholes[rows][:, None])
    np.abs(apart, out=apart)
    return apart.mean(axis=(2, 3)) * 1e-3


def _across_planes(flags: np.ndarray) -> np.ndarray:
    """[P, V, D] of [P, V, C, D] bools: set in any plane."""
    return flags[:, :, 0] if flags.shape[2] == 1 else flags.any(axis=2)


def _counts(flags: np.ndarray) -> np.ndarray:
    """[P, V] of [P, V, D] bools: how many are set, counted as bytes (a bool sum casts every one)."""
    return flags.view(np.uint8).sum(axis=-1, dtype=np.uint16)


def _differences(mine: np.ndarray, theirs: np.ndarray, pairs: Sequence[tuple[int, int]], shown: int = 0) -> np.ndarray:
    """[P]: difference of each (row of mine, row of theirs) pair: the rough grid, then the fine search for the pairs
    it leaves under ROUGH_BOUND, both over blocks of pairs at once (pairs without colour apart). shown > 0: a
    progress bar per stage, each pair counted shown times (this is one of shown equal shares checked at once)."""
    a, b = np.array(pairs, dtype=np.int64).reshape(-1, 2).T
    with progress(total=len(a) * shown, desc="copies, rough check", unit="pair", enabled=shown > 0) as bar:
        best, crop = _rough(mine, theirs, a, b, lambda count: bar.update(count * shown))
    found = np.ones(len(a))
    near = np.flatnonzero(best.min(0) <= ROUGH_BOUND)
    if not len(near):
        return found
    flipped = best[1, near] < best[0, near]  # b's crop fits a better than a's fits b: b is the one cropped
    grey_a, grey_b = _greys(mine, a[near]), _greys(theirs, b[near])
    boxes = np.array(_boxes(ROUGH[1]))[crop[flipped.astype(np.int64), near]]
    with progress(total=len(near) * shown, desc="copies, fine check", unit="pair", enabled=shown > 0) as bar:
        for group in (np.flatnonzero(grey_a | grey_b), np.flatnonzero(~(grey_a | grey_b))):
            for start in range(0, len(group), FINE_BLOCK):
                rows = group[start : start + FINE_BLOCK]
                first, second, turn = mine[a[near[rows]]], theirs[b[near[rows]]], flipped[rows, None, None, None]
                cropped, whole = np.where(turn, second, first), np.where(turn, first, second)
                grey, mixed = bool(grey_a[rows[0]] | grey_b[rows[0]]), grey_a[rows] != grey_b[rows]
                found[near[rows]] = _fine(cropped, whole, boxes[rows], grey, mixed)
                bar.update(len(rows) * shown)
    return found


def _shared_out(
    mine: np.ndarray, theirs: np.ndarray, pairs: Sequence[tuple[int, int]], shown: bool = False
) -> np.ndarray:
    """_differences of the pairs, every n-th pair to each of the n usable cores: this process checks one share while a
    worker process per other core checks another (`python -m retrieval.duplicates`, given the thumbnails its pairs
    need in a temporary file). A pair's difference does not depend on the pairs checked beside it
    (tests/test_audit.py), so the result is the one of a single process. shown: progress bars of this process's
    share, standing for all of them."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if cores < 2 or len(pairs) < SHARED_PAIRS:
        return _differences(mine, theirs, pairs, int(shown))
    shares, found = [list(pairs[n::cores]) for n in range(cores)], np.ones(len(pairs))
    try:
        scratch = tempfile.TemporaryDirectory(prefix="retrieval-copies-", ignore_cleanup_errors=True)
    except OSError:  # no temporary folder to be had: every pair is checked here
        return _differences(mine, theirs, pairs, int(shown))
    with scratch as folder:
        workers = [_Worker.start(Path(folder) / str(n), *_needed(mine, theirs, shares[n])) for n in range(1, cores)]
        try:
            found[0::cores] = _differences(mine, theirs, shares[0], cores if shown else 0)
            for n, worker in enumerate(workers, 1):
                done = worker.result() if worker else None  # None: it failed or never started (no room for its file)
                found[n::cores] = done if done is not None else _differences(mine, theirs, shares[n])
        finally:
            for worker in filter(None, workers):
                worker.process.kill()  # nothing when it is done; on Ctrl+C here it stops too
    return found


def _needed(
    mine: np.ndarray, theirs: np.ndarray, pairs: list[tuple[int, int]]
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """What a worker needs for pairs: the thumbnails of their rows (one array when both sides are one collection:
    None for theirs) and the pairs as rows of those."""
    a, b = np.array(pairs, dtype=np.int64).reshape(-1, 2).T
    if mine is theirs:
        rows, at = np.unique(np.concatenate([a, b]), return_inverse=True)
        return mine[rows], None, at.reshape(2, -1).T
    rows_a, at_a = np.unique(a, return_inverse=True)
    rows_b, at_b = np.unique(b, return_inverse=True)
    return mine[rows_a], theirs[rows_b], np.stack([at_a, at_b], axis=1)


@dataclass(frozen=True)
class _Worker:
    """A process that checks a share of the candidate pairs (_shared_out), and the file it answers in."""

    process: subprocess.Popen
    output: Path

    @classmethod
    def start(cls, folder: Path, mine: np.ndarray, theirs: np.ndarray | None, pairs: np.ndarray) -> _Worker | None:
        """Writes the share's thumbnails and pairs to folder and starts the process on them (in its own session: a
        Ctrl+C is its parent's, which ends it); None where the files or the process cannot be had."""
        try:
            folder.mkdir()
            np.savez(folder / "given.npz", mine=mine, pairs=pairs, **({} if theirs is None else {"theirs": theirs}))
        except OSError:  # a full or read-only temporary folder
            return None
        package = str(Path(__file__).resolve().parents[1])  # this checkout's retrieval, whatever is installed
        path = os.pathsep.join(filter(None, [package, os.environ.get("PYTHONPATH")]))
        environment = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
        command = [sys.executable, "-m", "retrieval.duplicates", str(folder)]
        quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
        try:
            process = subprocess.Popen(command, env=environment, start_new_session=True, **quiet)
        except OSError:  # no process to be had
            return None
        return cls(process, folder / "differences.npy")

    def result(self) -> np.ndarray | None:
        """The share's differences once the process has ended, or None where it failed."""
        return np.load(self.output) if self.process.wait() == 0 else None


def _work(folder: Path) -> None:
    """A worker's side of _shared_out: the differences of the pairs given in folder (no theirs: pairs within mine)."""
    with np.load(folder / "given.npz") as given:
        mine, pairs = given["mine"], given["pairs"]
        theirs = given["theirs"] if "theirs" in given.files else mine
    np.save(folder / "differences.npy", _differences(mine, theirs, [tuple(pair) for pair in pairs.tolist()]))


def _rough(
    mine: np.ndarray, theirs: np.ndarray, a: np.ndarray, b: np.ndarray, done: Callable[[int], object] | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """[2, P] each: per pair (row a of mine, row b of theirs), the share of the best crop of the rough grid, and its
    number, of a's crops on b's whole picture and of b's on a's (_best_crops: past ROUGH_BOUND, only a share past
    it); ROUGH_BLOCK pairs at once, each picture's crops drawn once; done(count), if given, is told of each block's
    pairs."""
    if mine is theirs:
        rows_a = rows_b = np.unique(np.concatenate([a, b]))
        rough_a = rough_b = _rough_views(mine[rows_a])
    else:
        rows_a, rows_b = np.unique(a), np.unique(b)
        rough_a, rough_b = _rough_views(mine[rows_a]), _rough_views(theirs[rows_b])
    against_a = _ByteWholes.of(rough_a[:, 0], ROUGH[0])  # what the other side's crops are compared with
    against_b = against_a if rough_b is rough_a else _ByteWholes.of(rough_b[:, 0], ROUGH[0])
    at_a, at_b = np.searchsorted(rows_a, a), np.searchsorted(rows_b, b)
    best, crop = np.ones((2, len(a))), np.zeros((2, len(a)), np.int64)
    for start in range(0, len(a), ROUGH_BLOCK):
        block = slice(start, start + ROUGH_BLOCK)
        for side, (views, at, against, other) in enumerate(
            ((rough_a, at_a, against_b, at_b), (rough_b, at_b, against_a, at_a))
        ):
            best[side, block], crop[side, block] = _best_crops(views[at[block]], against, other[block])
        if done is not None:
            done(len(a[block]))
    return best, crop


def _best_crops(crops: np.ndarray, wholes: _ByteWholes, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[P] each: the smallest of _shares over each pair's crops (bytes, [P, V, 1, D]) and its crop's number, where it
    can be within ROUGH_BOUND; elsewhere a share above ROUGH_BOUND. The tie-break is added only to the pairs whose
    best share without it is within the bound: it only adds, so no other pair comes within it (most pairs of a
    collection without copies are such, and the tie-break is about a fifth of their check)."""
    shares = _byte_shares(crops, wholes, rows)
    near = shares.min(1) <= ROUGH_BOUND
    if near.any():
        shares[near] += _closeness(np.divide(crops[near], 255, dtype=np.float32), wholes.views, rows[near])
    return shares.min(1), shares.argmin(1)


def _greys(pictures: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """[len(rows)] bool: which of the thumbnails at rows have no colour (their channels within 8 of 255 of each other
    everywhere); each distinct picture judged once, a block at a time so that the int16 copies stay small."""
    distinct, at = np.unique(rows, return_inverse=True)
    grey = np.zeros(len(distinct), bool)
    for start in range(0, len(distinct), PAIR_BLOCK):
        channels = pictures[distinct[start : start + PAIR_BLOCK]].astype(np.int16)
        spread = np.abs(3 * channels - channels.sum(axis=-1, keepdims=True, dtype=np.int16))  # 3 x off the mean
        grey[start : start + PAIR_BLOCK] = spread.reshape(len(channels), -1).max(axis=1) < 24
    return grey[at]


def _fine(cropped: np.ndarray, whole: np.ndarray, boxes: np.ndarray, grey: bool, mixed: np.ndarray) -> np.ndarray:
    """[P]: the fine search of a block of pairs, each from its rough grid's best crop (boxes [P, 3]) of cropped on
    whole: FINE_ROUNDS rounds at FINE_SIDE px, each around the last one's best crop at half its step (pairs beyond
    GIVE_UP's share after its rounds stop: no bench pair that ended within CONFIRM_BOUND was above 0.091 there);
    pairs left within CONFIRM_BOUND get one more round at CONFIRM_SIDE px, whose difference is theirs (in grey when
    grey, and at GREY_CUT where one picture of a pair is grey and the other not)."""
    stack, target = _fine_planes(cropped, grey), _fine_planes(whole, grey)
    step, best, going = (1 - min(SCALES)) / (ROUGH[1] - 1), np.ones(len(boxes)), np.arange(len(boxes))
    wholes = _fine_wholes(target, FINE_SIDE)
    for round_ in range(FINE_ROUNDS):
        if not len(going):
            break
        near = _around(boxes[going], step)
        fine = np.where(near.valid, _shares(_fine_views(stack[going], FINE_SIDE, near), wholes, going), np.inf)
        boxes[going], best[going], step = near.box(fine.argmin(1)), np.minimum(best[going], fine.min(1)), step / 2
        if round_ + 1 == GIVE_UP[0]:
            going = going[best[going] <= GIVE_UP[1]]
    found = np.round(best, 3)  # the share of drawn pixels, without the tie-break
    close = np.flatnonzero(best <= CONFIRM_BOUND)
    if len(close):
        wholes, near = _fine_wholes(target[close], CONFIRM_SIDE), _around(boxes[close], step)
        cut = np.where(mixed[close], GREY_CUT, PIXEL_CUT)[:, None, None, None].astype(np.float32)
        shares = _shares(_fine_views(stack[close], CONFIRM_SIDE, near), wholes, np.arange(len(close)), cut)
        found[close] = np.round(np.where(near.valid, shares, np.inf).min(1), 3)
    return found


def _fine_wholes(target: np.ndarray, side: int) -> _Wholes:
    """What the fine search compares crops with: the whole pictures' fine views (forgiving half a pixel's shift)."""
    return _Wholes.of(_fine_views(target, side, _Crops.whole(len(target)))[:, 0], side, 0.5)


def _fine_planes(pictures: np.ndarray, grey: bool) -> np.ndarray:
    """[P, C, S, S]: the planes the fine search compares: grey alone, or luma and the two chroma planes (JPEG's
    YCbCr: a re-encoded copy keeps the luma's detail and loses the colours', which _fine_views blurs on both
    pictures)."""
    rgb = pictures.astype(np.float32) / 255
    if grey:
        return (rgb @ LUMA)[:, None]
    return np.moveaxis(rgb @ CHROMA.T, -1, 1)


def _fine_views(stack: np.ndarray, side: int, crops: _Crops) -> np.ndarray:
    """[P, V, C, side * side]: each picture's crops of its planes (stack [P, C, S, S]) resampled to side, the chroma
    planes (if any) blurred over each pixel's 3 x 3 neighbourhood; rows resampled once per (side, top), columns once
    per (side, left)."""
    size, count = stack.shape[-1], len(stack)
    rows = _area_weights(side, size, crops.tops, crops.sides[:, :, None])  # [P, I, J, side, size]
    columns = _area_weights(side, size, crops.lefts, crops.sides[:, :, None]).swapaxes(-1, -2)  # [P, I, K, size, side]
    tall = rows[:, :, :, None] @ stack[:, None, None]  # [P, I, J, C, side, size]
    views = tall[:, :, None] @ columns[:, :, :, None, None]  # [P, I, K, J, C, side, side]
    views = views.reshape(count, -1, stack.shape[1], side, side)
    if stack.shape[1] > 1:
        chroma = views[:, :, 1:].reshape(-1, side, side)
        views[:, :, 1:] = _blur(chroma).reshape(views[:, :, 1:].shape)
    return views.reshape(count, -1, stack.shape[1], side * side)


def _hash_neighbours(queries: np.ndarray, gallery: np.ndarray, k: int, same: bool) -> np.ndarray:
    """[M, 2]: (query row, gallery row) of each query's k nearest hashes within HASH_BITS bits (itself left out when
    same)."""
    faiss = require("faiss", "cpu")
    index = faiss.IndexBinaryFlat(64)
    index.add(gallery)
    distances, ids = index.search(queries, min(k + int(same), len(gallery)))
    rows = np.repeat(np.arange(len(queries)), ids.shape[1])
    keep = (distances.ravel() <= HASH_BITS) & (ids.ravel() >= 0) & ((rows != ids.ravel()) if same else True)
    return np.stack([rows[keep], ids.ravel()[keep]], axis=1).astype(np.int64)


def candidate_pairs(
    vectors: np.ndarray,
    hashes: np.ndarray,
    other: tuple[np.ndarray, np.ndarray] | None = None,
    k: int = CANDIDATES,
    neighbours: Neighbours | None = None,
) -> list[tuple[int, int]]:
    """(row, row of other or of the same collection) pairs worth checking: neighbours by embedding (within one
    collection, neighbours already searched may be given) and by hash."""
    same = other is None
    gallery, gallery_hashes = (vectors, hashes) if other is None else other
    if not len(vectors) or len(gallery) <= int(same):
        return []
    if same and neighbours is not None:
        ids, _ = neighbours.first(k)
    else:
        ids, _ = nearest_neighbours(vectors, gallery, k, exclude_self=same)
    found = np.stack([np.repeat(np.arange(len(vectors)), ids.shape[1]), ids.ravel()], axis=1)
    pairs = np.concatenate([found, _hash_neighbours(hashes, gallery_hashes, k, same)]).astype(np.int64)
    if same:
        pairs.sort(axis=1)  # (min, max): a pair found from either side is one
    pairs = np.unique(pairs, axis=0)  # sorted, as (a, b) tuples sort
    return list(zip(pairs[:, 0].tolist(), pairs[:, 1].tolist(), strict=True))


def find_copies(
    vectors: np.ndarray,
    digests: Sequence[str],
    thumbnails: np.ndarray,
    other: tuple[np.ndarray, Sequence[str], np.ndarray] | None = None,
    threshold: float = COPY_DIFFERENCE,
    shown: bool = False,
    neighbours: Neighbours | None = None,
) -> list[CopyPair]:
    """Copy pairs within a collection (other None, a < b) or from it to other (a its row, b other's), identical
    bytes first, then near copies at difference <= threshold, the most alike first (shown: with progress bars;
    neighbours: the collection's, already searched, used within one collection)."""
    gallery = (vectors, digests, thumbnails) if other is None else other
    rows_of: dict[str, list[int]] = {}
    for row, digest in enumerate(gallery[1]):
        rows_of.setdefault(digest, []).append(row)
    identical = [
        (a, b) for a, digest in enumerate(digests) for b in rows_of.get(digest, []) if other is not None or a < b
    ]
    hashes = perceptual_hashes(thumbnails)
    against = None if other is None else (gallery[0], perceptual_hashes(gallery[2]))
    known = set(identical)
    checked = [pair for pair in candidate_pairs(vectors, hashes, against, neighbours=neighbours) if pair not in known]
    coarse = _coarse(thumbnails)
    checked = _coarse_filter(coarse, coarse if other is None else _coarse(gallery[2]), checked)
    near = zip(checked, _shared_out(thumbnails, gallery[2], checked, shown).tolist(), strict=True) if checked else []
    pairs = [CopyPair(a, b, CopyKind.IDENTICAL, 0.0) for a, b in identical]
    pairs += sorted(
        (CopyPair(a, b, CopyKind.NEAR, d) for (a, b), d in near if d <= threshold), key=lambda p: p.difference
    )
    return pairs


def copy_groups(pairs: Sequence[CopyPair], count: int) -> list[list[int]]:
    """The rows joined by pairs (within one collection) as groups of two or more, each sorted, largest first."""
    parent = list(range(count))

    def root(row: int) -> int:
        while parent[row] != row:
            parent[row] = parent[parent[row]]
            row = parent[row]
        return row

    for pair in pairs:
        parent[root(pair.a)] = root(pair.b)
    groups: dict[int, list[int]] = {}
    for row in sorted({row for pair in pairs for row in (pair.a, pair.b)}):
        groups.setdefault(root(row), []).append(row)
    return sorted(groups.values(), key=lambda rows: (-len(rows), rows[0]))


if __name__ == "__main__":  # a worker process of _shared_out
    _work(Path(sys.argv[1]))
