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

from retrieval.commands import main
from retrieval.runs import RunDir
from tests.conftest import copy_classes

ROOT = Path(__file__).parents[1]


def log_without_timings(run: RunDir) -> list[dict]:
    entries = [json.loads(line) for line in run.train_log.read_text().splitlines()]
    return [{key: value for key, value in entry.items() if key not in ("seconds", "images_per_second")} for entry in entries]


def logged_epochs(run: RunDir) -> int:
    return len(run.train_log.read_text().splitlines()) if run.train_log.is_file() else 0


def saved_record(run: RunDir) -> dict:
    """The progress record of the run's trainer state ({} before the first save).

    The safetensors header is read through one file handle: the trainer replaces the file while this
    polls, and a reader that opens the path twice may pair one version's header with another's size.
    """
    try:
        with run.trainer_state.open("rb") as handle:
            size = int.from_bytes(handle.read(8), "little")
            return json.loads(json.loads(handle.read(size))["__metadata__"]["record"])
    except (OSError, KeyError, ValueError):  # not written yet
        return {}


EPOCH_CHECKPOINTS = ["--epochs", "4", "--batch-size", "16", "--image-size", "32", "--val-classes", "0.34"]
# the runs that save their trainer state after every step use the small backbone: resuming is the same code for every
# backbone, and resnet18's state (model, weight average, optimizer moments: 230 MB a save, against 27 MB) made these tests 3x slower
SMALL = ["--backbone", "mobilenet_v3_small"]
# 4 batches an epoch, the trainer state saved after every step, a MoCo queue and momentum encoder and a weight average to restore
STEP_CHECKPOINTS_WITH_QUEUE = ["--epochs", "3", "--batch-size", "8", "--image-size", "32", "--val-classes", "0.34", "--checkpoint-every", "1", "--queue-size", "24", "--ema", "0.9", *SMALL]


# the same without labels: MoCo's queue and key encoder, and instance discrimination's memory bank and NCE constant
SELF_SUPERVISED_MOCO = ["--epochs", "3", "--batch-size", "8", "--image-size", "32", "--self-supervised", "--loss", "moco", "--checkpoint-every", "1", "--queue-size", "24", *SMALL]
SELF_SUPERVISED_BANK = ["--epochs", "3", "--batch-size", "8", "--image-size", "32", "--self-supervised", "--loss", "instdisc", "--nce-negatives", "16", "--checkpoint-every", "1", *SMALL]


def killed_after(run: RunDir, record: dict) -> bool:
    """Whether the run has saved past epoch 1 (and, with step checkpoints, inside an epoch)."""
    return logged_epochs(run) >= 2 if not record else record.get("epoch", 0) >= 1 and record.get("batch", 0) >= 1


@pytest.mark.parametrize(
    "options",
    [EPOCH_CHECKPOINTS, STEP_CHECKPOINTS_WITH_QUEUE, SELF_SUPERVISED_MOCO, SELF_SUPERVISED_BANK],
    ids=["after-epochs", "mid-epoch-with-queue-and-ema", "self-supervised-moco", "self-supervised-memory-bank"],
)
def test_sigkill_then_resume_gives_the_uninterrupted_weights(icons_root: Path, tmp_path: Path, options: list[str]) -> None:
    data = copy_classes(icons_root, tmp_path / "data", 6)
    step_checkpoints = "--checkpoint-every" in options
    whole = RunDir(tmp_path / "whole")
    assert main(["train", str(data), "--run", str(whole.root), *options]) == 0

    broken = RunDir(tmp_path / "broken")
    worker = subprocess.Popen([sys.executable, "-m", "retrieval", "train", str(data), "--run", str(broken.root), *options], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 180
    while worker.poll() is None and time.monotonic() < deadline:
        if (step_checkpoints and killed_after(broken, saved_record(broken))) or (not step_checkpoints and killed_after(broken, {})):
            break
        time.sleep(0.002)
    os.kill(worker.pid, signal.SIGKILL)
    worker.wait()
    assert saved_record(broken) and logged_epochs(broken) < int(options[1]), "the run was not killed part-way"

    assert main(["train", str(data), "--run", str(broken.root), "--resume"]) == 0
    expected, resumed = load_file(str(whole.last_checkpoint)), load_file(str(broken.last_checkpoint))
    assert expected.keys() == resumed.keys()
    assert all(torch.equal(expected[name], resumed[name]) for name in expected)
    if whole.best_checkpoint.is_file():  # with validation
        assert load_file(str(whole.best_checkpoint)).keys() == load_file(str(broken.best_checkpoint)).keys()
    assert log_without_timings(whole) == log_without_timings(broken)


def test_resume_without_state_or_with_other_data_is_refused(small_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    assert main(["train", str(small_folder), "--run", str(run), "--resume"]) == 2
    assert f"--run {run}: no such run directory; nothing to resume" in capsys.readouterr().err.replace("\n", "")
    assert main(["train", str(small_folder), "--run", str(run), "--epochs", "1", "--batch-size", "8", "--image-size", "32"]) == 0
    assert main(["train", str(tmp_path), "--run", str(run), "--resume"]) == 2
    assert "on its own data" in capsys.readouterr().err.replace("\n", "")
