"""Writes that matter are atomic: a failure part-way leaves the previous artifact whole."""

from __future__ import annotations

import os
import sqlite3
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
    with pytest.raises(RetrievalError, match="No space left on device.*previous version is kept; free space on its disk"):
        write_atomic(target, b"new")
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx"]


def test_a_failed_index_save_keeps_the_old_index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    directory = tmp_path / "index"
    build(directory, n=7)

    def crash(*args: object) -> None:  # FAISS's own words on a full disk (seen on a full tmpfs): a RuntimeError, no errno
        raise RuntimeError(
            "Error in void faiss::write_index(const Index*, IOWriter*, int) at index_write.cpp:499: Error: 'ret == (size * 4)' "
            "failed: write error in /x/.index.tmp-1/vectors.faiss: 221102 != 1011712 (No space left on device)"
        )

    monkeypatch.setattr(store.faiss, "write_index", crash)
    with pytest.raises(RetrievalError, match=r"index: the index cannot be written \(No space left on device\); the previous version is kept; free space"):
        build(directory, n=3)
    loaded = open_index(directory)
    assert len(loaded) == 7 and len(loaded.items()) == 7
    assert sorted(p.name for p in tmp_path.iterdir()) == ["index"]
    assert loaded.search(np.eye(8, dtype=np.float32)[:1], k=2)[0][0].id >= 1


def test_a_full_disk_under_sqlite_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """SQLite's "database or disk is full" (the index's journal on a full disk) ended in a traceback: it is no OSError."""
    from retrieval.commands import main
    from retrieval.commands import search as search_command

    def full(*args: object, **kwargs: object) -> None:
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(search_command, "require_threshold", full)
    (tmp_path / "q.png").write_bytes(b"")
    assert main(["search", str(tmp_path), str(tmp_path / "q.png")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: database or disk is full") and "free space on its disk" in err and err.count("\n") == 1


def test_written_files_get_the_mode_open_gives(tmp_path: Path) -> None:
    """Atomic writes made 0600 files (mkstemp's mode): a model card or manifest that a service user could not read."""
    write_atomic(tmp_path / "model.json", b"{}")
    with open(tmp_path / "plain", "wb"):
        pass
    assert (tmp_path / "model.json").stat().st_mode & 0o777 == (tmp_path / "plain").stat().st_mode & 0o777
