"""Training killed with SIGKILL and resumed reaches the same weights as a run never interrupted."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from retrieval.cli import main
from retrieval.runs import RunDir
from tests.conftest import copy_classes

ROOT = Path(__file__).parents[1]


def log_without_timings(run: RunDir) -> list[dict]:
    entries = [json.loads(line) for line in run.train_log.read_text().splitlines()]
    return [{key: value for key, value in entry.items() if key != "seconds"} for entry in entries]


def logged_epochs(run: RunDir) -> int:
    return len(run.train_log.read_text().splitlines()) if run.train_log.is_file() else 0


def test_sigkill_then_resume_gives_the_uninterrupted_weights(icons_root: Path, tmp_path: Path) -> None:
    data = copy_classes(icons_root, tmp_path / "data", 6)
    options = ["--epochs", "4", "--batch-size", "16", "--image-size", "32", "--val-classes", "0.34"]
    whole = RunDir(tmp_path / "whole")
    assert main(["train", str(data), "--run", str(whole.root), *options]) == 0

    broken = RunDir(tmp_path / "broken")
    worker = subprocess.Popen([sys.executable, "-m", "retrieval", "train", str(data), "--run", str(broken.root), *options], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 180
    while logged_epochs(broken) < 2 and worker.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(worker.pid, signal.SIGKILL)
    worker.wait()
    assert 1 <= logged_epochs(broken) < 4, "the run was not killed part-way"

    assert main(["train", str(data), "--run", str(broken.root), "--resume"]) == 0
    expected, resumed = load_file(str(whole.last_checkpoint)), load_file(str(broken.last_checkpoint))
    assert expected.keys() == resumed.keys()
    assert all(torch.equal(expected[name], resumed[name]) for name in expected)
    assert load_file(str(whole.best_checkpoint)).keys() == load_file(str(broken.best_checkpoint)).keys()
    assert log_without_timings(whole) == log_without_timings(broken)


def test_resume_without_state_or_with_other_data_is_refused(small_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    assert main(["train", str(small_folder), "--run", str(run), "--resume"]) == 2
    assert "config.json: missing" in capsys.readouterr().err.replace("\n", "")
    assert main(["train", str(small_folder), "--run", str(run), "--epochs", "1", "--batch-size", "8", "--image-size", "32"]) == 0
    assert main(["train", str(tmp_path), "--run", str(run), "--resume"]) == 2
    assert "on its own data" in capsys.readouterr().err.replace("\n", "")
