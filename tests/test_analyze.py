"""`retrieval analyze`: the temperature sweep writes its table, JSON and plot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from retrieval.commands import main
from tests.conftest import copy_classes


def test_temperature_sweep_writes_json_and_plot(icons_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = copy_classes(icons_root, tmp_path / "data", 6)
    out = tmp_path / "sweep"
    # a value or loss given twice is swept once (it trained the same run twice); SupCon as the paper writes it
    options = ["--out", str(out), "--temperatures", "0.1,0.5,0.1", "--losses", "SupCon,hard,supcon", "--epochs", "1", "--batch-size", "8", "--image-size", "32", "--val-classes", "0.34"]
    assert main(["analyze", str(data), *options]) == 0
    rows = json.loads((out / "temperature_sweep.json").read_text())["rows"]
    assert [(row["loss"], row["temperature"]) for row in rows] == [("supcon", 0.1), ("supcon", 0.5), ("hard", 0.1), ("hard", 0.5)]
    assert all(-1 <= row[f"{space}tolerance"] <= 1 and row[f"{space}uniformity"] <= 0 for row in rows for space in ("", "loss_"))
    assert all(0 <= row["recall@1"] <= 1 for row in rows)
    assert (out / "temperature_sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "runs" / "hard-t0.5" / "checkpoints" / "last.safetensors").is_file()
    assert "uniformity" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--temperatures", "0.1,hot"], "--temperatures '0.1,hot': give positive numbers separated by commas"),
        (["--temperatures", "0.1,-1"], "--temperatures '0.1,-1': give positive numbers"),  # it said --temperature
        (["--temperatures", "inf,0.1"], "--temperatures 'inf,0.1': give positive numbers"),  # it trained at a constant loss
        (["--losses", "supcon,triplet"], "--losses 'supcon,triplet': unknown loss 'triplet'"),
        (["--losses", "supcon,infonse"], "--losses 'supcon,infonse': unknown loss 'infonse'; did you mean 'infonce'? choose one of hard,"),
        (["--losses", ","], "--losses ',': give losses separated by commas"),
        (["--losses", "simclr"], "--losses 'simclr': simclr learns without labels: add --self-supervised"),  # it said --loss, --ssl-loss, --adapt
        (["--losses", "supcon", "--self-supervised"], "--losses 'supcon': supcon needs labels; with --self-supervised give simclr"),
        (["--losses", ""], "--losses is empty (a shell variable unset?)"),  # it swept the default losses
        (["--val-classes", "0"], "measured on held-out classes"),
    ],
)
def test_bad_sweeps_are_refused_before_training(small_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], options: list[str], message: str) -> None:
    assert main(["analyze", str(small_folder), "--out", str(tmp_path / "sweep"), *options]) == 2
    assert message in capsys.readouterr().err.replace("\n", "")
    assert not (tmp_path / "sweep").exists()


@pytest.mark.parametrize(("classes", "found"), [(0, "no labeled image"), (2, "2 labeled classes")])
def test_a_sweep_without_enough_labeled_classes_is_one_line(icons_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], classes: int, found: str) -> None:
    """An unlabeled folder said "--loss supcon needs labels" (no --loss was given); two classes said to raise
    --val-classes, which cannot help."""
    data = copy_classes(icons_root, tmp_path / "data", 2)
    if not classes:
        for image in list(data.rglob("*.png")):
            image.rename(data / f"{image.parent.name}-{image.name}")
    assert main(["analyze", str(data), "--out", str(tmp_path / "sweep")]) == 2
    err = capsys.readouterr().err
    assert f"{data}: {found}; the sweep trains on some classes" in err and err.count("\n") == 1


def test_a_sweep_out_into_a_file_is_one_line(small_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--out naming a file ended in "File exists; check the path and its permissions" after the checks."""
    (tmp_path / "notes.txt").write_text("mine")
    assert main(["analyze", str(small_folder), "--out", str(tmp_path / "notes.txt")]) == 2
    said = capsys.readouterr().err.replace("\n", "")
    assert f"--out {tmp_path / 'notes.txt'}: a file is there, not a folder; give a folder" in said
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_a_sweep_into_its_own_images_is_refused(small_folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--out inside the images wrote temperature_sweep.png among them (read as an image by the next job)."""
    assert main(["analyze", str(small_folder), "--out", str(small_folder / "sweep")]) == 2
    assert "inside the images" in capsys.readouterr().err and not (small_folder / "sweep").exists()
