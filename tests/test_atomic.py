"""Writes that matter are atomic: a failure part-way leaves the previous artifact whole."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import index.store as store
from index.backends import open_index
from retrieval.errors import RetrievalError
from retrieval.runs import write_atomic
from tests.test_index import build


def test_a_failed_write_keeps_the_old_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "model.onnx"
    write_atomic(target, b"old")

    def disk_full(*args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", disk_full)
    with pytest.raises(RetrievalError, match="No space left on device.*previous version is kept"):
        write_atomic(target, b"new")
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx"]


def test_a_failed_index_save_keeps_the_old_index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    directory = tmp_path / "index"
    build(directory, n=7)

    def crash(*args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store.faiss, "write_index", crash)
    with pytest.raises(RetrievalError, match="No space left on device"):
        build(directory, n=3)
    loaded = open_index(directory)
    assert len(loaded) == 7 and len(loaded.items()) == 7
    assert sorted(p.name for p in tmp_path.iterdir()) == ["index"]
    assert loaded.search(np.eye(8, dtype=np.float32)[:1], k=2)[0][0].id >= 1
