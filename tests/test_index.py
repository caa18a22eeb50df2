"""Index save -> load -> search round trip, and refusal of damaged or mismatched indexes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from index.backends import open_index
from index.store import GalleryIndex
from retrieval.data import Item
from retrieval.embedders import l2_normalise
from retrieval.errors import RetrievalError


def build(directory: Path, n: int = 20, dim: int = 8, encoder: str = "enc-a") -> tuple[GalleryIndex, np.ndarray]:
    vectors = l2_normalise(np.random.default_rng(0).standard_normal((n, dim)))
    items = [Item(Path(f"/gallery/{i % 3}/img{i}.png"), f"label{i % 3}") for i in range(n)]
    return GalleryIndex.build(directory, vectors, items, [f"sha{i}" for i in range(n)], encoder), vectors


def test_round_trip(tmp_path: Path) -> None:
    built, vectors = build(tmp_path / "index")
    loaded = open_index(tmp_path / "index", "enc-a", 8)
    assert len(loaded) == 20 and loaded.manifest == built.manifest
    hits = loaded.search(vectors[[3, 7]], k=4)
    assert [row[0].id for row in hits] == [4, 8]  # ids are SQLite row ids, 1-based in item order
    assert hits[0][0].path == "/gallery/0/img3.png" and hits[0][0].label == "label0"
    assert hits[0][0].score == pytest.approx(1.0, abs=1e-5)
    assert all(a.score >= b.score for row in hits for a, b in zip(row, row[1:]))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["index"]  # no staging directory left behind


def test_rebuild_replaces_the_previous_index(tmp_path: Path) -> None:
    build(tmp_path / "index", n=20)
    build(tmp_path / "index", n=5)
    assert len(open_index(tmp_path / "index")) == 5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["index"]


def test_mismatched_encoder_and_dimension_are_refused(tmp_path: Path) -> None:
    build(tmp_path / "index")
    with pytest.raises(RetrievalError, match="built with encoder enc-a.*rebuild"):
        open_index(tmp_path / "index", "enc-b")
    with pytest.raises(RetrievalError, match="8-dimensional vectors, the encoder makes 16"):
        open_index(tmp_path / "index", "enc-a", 16)


@pytest.mark.parametrize("damage", ["truncate-vectors", "drop-items", "garble-manifest", "no-manifest"])
def test_damaged_indexes_are_refused(tmp_path: Path, damage: str) -> None:
    directory = tmp_path / "index"
    build(directory)
    if damage == "truncate-vectors":
        data = (directory / "vectors.faiss").read_bytes()
        (directory / "vectors.faiss").write_bytes(data[: len(data) // 2])
    elif damage == "drop-items":
        (directory / "items.sqlite").write_bytes(b"garbage" * 100)
    elif damage == "garble-manifest":
        (directory / "manifest.json").write_text("{not json")
    else:
        (directory / "manifest.json").unlink()
    with pytest.raises(RetrievalError, match=str(directory)):
        open_index(directory)


def test_empty_gallery_is_refused(tmp_path: Path) -> None:
    with pytest.raises(RetrievalError, match="nothing to index"):
        GalleryIndex.build(tmp_path / "index", np.zeros((0, 4), np.float32), [], [], "enc")
