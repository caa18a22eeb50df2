"""Faults: processes killed (SIGKILL) at random points, again and again, and a disk that fills up
during a save. A resumed job ends where an uninterrupted one would; nothing is lost or half-written.

ROBUSTNESS_KILLS sets how many times each job is killed (3 here; bench/robustness.py runs more).
"""

from __future__ import annotations

import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
from contextlib import closing
from pathlib import Path

import pytest
import torch

import retrieval.runs
from index.backends import open_index
from index.faiss_ops import stored_vectors
from index.store import GalleryIndex
from retrieval.commands import main
from retrieval.runs import RunDir
from tests.conftest import copy_classes, icon_copies
from tests.test_cli import expect_error
from training.checkpoints import read_sealed

ROOT = Path(__file__).parents[2]
KILLS = int(os.environ.get("ROBUSTNESS_KILLS", "3"))


def kill_at_random(command: list[str], low: float, high: float, rng: random.Random) -> bool:
    """Starts command, SIGKILLs it after a random time in [low, high) seconds; whether it was still running."""
    worker = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        worker.wait(timeout=rng.uniform(low, high))
        return False  # it finished first
    except subprocess.TimeoutExpired:
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait()
        return True


def test_training_killed_again_and_again_resumes_to_the_uninterrupted_weights(icons_root: Path, tmp_path: Path) -> None:
    data = copy_classes(icons_root, tmp_path / "data", 6)
    # the small backbone: its trainer state, saved after every step, is 8x smaller than resnet18's (resuming is the same
    # code for every backbone), and the kills fall over the whole of a run rather than its first fifth
    options = ["--epochs", "3", "--batch-size", "8", "--image-size", "32", "--checkpoint-every", "1", "--queue-size", "24", "--backbone", "mobilenet_v3_small"]
    whole = RunDir(tmp_path / "whole")
    assert main(["train", str(data), "--run", str(whole.root), *options]) == 0
    broken = RunDir(tmp_path / "broken")
    rng = random.Random(0)
    kills = 0
    for _ in range(KILLS):
        resume = ["--resume"] if broken.trainer_state.is_file() else options
        if not kill_at_random([sys.executable, "-m", "retrieval", "train", str(data), "--run", str(broken.root), *resume], 2.0, 8.0, rng):
            break  # a run finished before its kill (a fast machine): there is nothing left to resume
        kills += 1
    else:
        resume = ["--resume"] if broken.trainer_state.is_file() else options
        assert main(["train", str(data), "--run", str(broken.root), *resume]) == 0
    assert kills, "no run was killed part-way"
    expected, _ = read_sealed(whole.last_checkpoint)
    resumed, _ = read_sealed(broken.last_checkpoint)
    assert expected.keys() == resumed.keys() and all(torch.equal(expected[name], resumed[name]) for name in expected)


def test_indexing_killed_again_and_again_indexes_every_image_exactly_once(demo_run: RunDir, icons_root: Path, tmp_path: Path) -> None:
    gallery = icon_copies(icons_root, tmp_path / "gallery", 3)
    directory = tmp_path / "index"
    command = [sys.executable, "-m", "retrieval", "index", str(demo_run.root), str(gallery), "--index", str(directory), "--batch-size", "16"]
    rng = random.Random(1)
    kills = sum(kill_at_random(command, 1.0, 6.0, rng) for _ in range(KILLS))
    assert kills, "no job was killed part-way"
    finished = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert finished.returncode == 0, finished.stderr
    paths = [path for path, _, _ in open_index(directory).rows().values()]
    assert len(paths) == len(set(paths)) == len(list(gallery.rglob("*.png")))  # every image exactly once


APP_WRITER = """
import sys
from pathlib import Path
from app.service import SearchService
from retrieval.runs import RunDir
service = SearchService(RunDir(Path(sys.argv[1])), Path(sys.argv[2]), allow_write=True, cache=Path(sys.argv[3]))
images = sorted(Path(sys.argv[4]).rglob("*.png"))
for round in range(1000):
    ids = service.add_images(images[round % 20 :: 20], label=f"round {round}").ids
    service.remove_items(ids[: len(ids) // 2])
    print(round, flush=True)
"""


def sqlite_ids(directory: Path) -> set[int]:
    with closing(sqlite3.connect(directory / "items.sqlite")) as connection:
        return {row[0] for row in connection.execute("SELECT id FROM items")}


def test_an_app_writer_killed_at_random_leaves_the_index_and_its_metadata_agreeing(demo_run: RunDir, icons_root: Path, tmp_path: Path) -> None:
    directory = tmp_path / "index"
    assert main(["index", str(demo_run.root), str(icons_root / "train"), "--index", str(directory)]) == 0
    images = copy_classes(icons_root, tmp_path / "uploads", 40, split="train")
    rng = random.Random(2)
    for attempt in range(KILLS):
        command = [sys.executable, "-c", APP_WRITER, str(demo_run.root), str(directory), str(tmp_path / "cache"), str(images)]
        writer = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert writer.stdout is not None
        writer.stdout.readline()  # one add and remove done: the next are under way
        time.sleep(rng.uniform(0, 1.5))
        os.kill(writer.pid, signal.SIGKILL)
        writer.wait()
        index = open_index(directory)  # the previous or the next version, whole
        ids, _ = stored_vectors(index.vectors)
        assert set(ids.tolist()) == sqlite_ids(directory) == set(index.rows()), attempt


def full_disk(*args: object, **options: object) -> None:
    raise OSError(28, "No space left on device")


def disk_full_for(name: str):  # noqa: ANN201 - a replacement of os.fsync
    """os.fsync that fails as a full disk would, for the files whose name contains name."""
    real = os.fsync

    def fsync(descriptor: int) -> None:
        if name in os.readlink(f"/proc/self/fd/{descriptor}"):
            raise OSError(28, "No space left on device")
        real(descriptor)

    return fsync


@pytest.mark.parametrize("artifact", ["checkpoint", "model", "index"])
def test_a_full_disk_during_a_save_keeps_the_previous_artifact(
    demo_run: RunDir, icons_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], artifact: str
) -> None:
    run = RunDir(tmp_path / "run")
    data = copy_classes(icons_root, tmp_path / "data", 4)
    assert main(["train", str(data), "--run", str(run.root), "--epochs", "1", "--batch-size", "16", "--image-size", "32"]) == 0
    assert main(["export", str(run.root)]) == 0
    assert main(["index", str(run.root), str(data)]) == 0
    files = {"checkpoint": run.last_checkpoint, "model": run.model, "index": run.index / "vectors.faiss"}
    before = {name: path.read_bytes() for name, path in files.items()}
    capsys.readouterr()
    if artifact == "index":
        import index.store

        monkeypatch.setattr(index.store.faiss, "write_index", full_disk)
        expect_error(["index", str(run.root), str(icons_root / "test"), "--rebuild"], capsys, "No space left on device", "previous version is kept")
    else:
        monkeypatch.setattr(retrieval.runs.os, "fsync", disk_full_for(files[artifact].name))
        command = ["train", str(data), "--run", str(run.root), "--epochs", "1", "--batch-size", "16", "--image-size", "32", "--overwrite"] if artifact == "checkpoint" else ["export", str(run.root)]
        expect_error(command, capsys, "No space left on device", "previous version is kept")
    monkeypatch.undo()
    assert files[artifact].read_bytes() == before[artifact]
    assert not [path for path in run.root.rglob("*") if ".tmp" in path.name]  # no temporary file left behind
    assert main(["search", str(run.root), str(next(data.rglob("*.png")))]) == 0
