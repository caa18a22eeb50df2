"""Progress written to a file or a pipe is one line per step, not hundreds of carriage-return redraws."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from retrieval.progress import LineProgress, progress

ROOT = Path(__file__).parents[1]


def test_a_bar_into_a_pipe_prints_one_line_when_done(capsys: pytest.CaptureFixture[str]) -> None:
    bar = progress(range(250), desc="embedding", unit="img")  # pytest's capture is not a terminal
    assert isinstance(bar, LineProgress)
    assert sum(1 for _ in bar) == 250
    err = capsys.readouterr().err
    assert "\r" not in err and err.count("\n") == 1 and err.startswith("embedding: 250/250 img in ")
    with progress(total=10, desc="quiet", unit="img", enabled=False) as hidden:
        hidden.update(10)
    assert capsys.readouterr().err == ""


def test_training_into_a_pipe_writes_a_line_per_epoch(small_folder: Path, tmp_path: Path) -> None:
    command = [sys.executable, "-m", "retrieval", "train", str(small_folder), "--run", str(tmp_path / "run")]
    options = ["--epochs", "3", "--batch-size", "8", "--image-size", "32"]
    done = subprocess.run([*command, *options], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "\r" not in done.stderr + done.stdout
    lines = done.stdout.splitlines()
    assert [line.split()[1] for line in lines if line.startswith("epoch ")] == ["1/3", "2/3", "3/3"]
    assert done.stderr.splitlines()[0].startswith("checking images: ") and len(done.stderr.splitlines()) == 1
