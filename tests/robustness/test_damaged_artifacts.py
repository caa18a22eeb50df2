"""Every artifact a run keeps, truncated or with one bit flipped, is refused by the command that reads
it with a one-line message naming the file, never loaded half-way and never a traceback.

Checkpoints are safetensors sealed with the sha256 of their tensor bytes; config.json, model.json
and the index's manifest.json carry a checksum of their content; the manifest holds the sha256 of
vectors.faiss and items.sqlite; model.json holds the sha256 of model.onnx.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from retrieval.runs import RunDir, read_json
from tests.test_cli import expect_error

ARTIFACTS = {  # file in the run -> the command that reads it
    "checkpoints/last.safetensors": "export",
    "checkpoints/trainer.safetensors": "resume",
    "config.json": "export",
    "model.onnx": "search",
    "model.json": "search",
    "index/manifest.json": "search",
    "index/vectors.faiss": "search",
    "index/items.sqlite": "search",
}
DAMAGE = ("truncated", "bit flipped at 10 %", "bit flipped at 50 %", "bit flipped at 90 %")


def damage(path: Path, how: str) -> None:
    """Truncates path to half its size, or flips the lowest bit of the byte at a fraction of it."""
    data = bytearray(path.read_bytes())
    if how == "truncated":
        path.write_bytes(bytes(data[: len(data) // 2]))
        return
    position = int(len(data) * int(how.split()[-2]) / 100)
    data[position] ^= 1
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", DAMAGE)
@pytest.mark.parametrize("artifact", ARTIFACTS)
def test_a_damaged_artifact_is_refused_by_its_reader(
    demo_run: RunDir, icons_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], artifact: str, how: str
) -> None:
    run = RunDir(tmp_path / "run")
    shutil.copytree(demo_run.root, run.root, ignore=shutil.ignore_patterns("plots", "*.png"))
    config = read_json(run.config)
    query = min((icons_root / "test").rglob("*.png"))
    damage(run.root / artifact, how)
    command = {
        "export": ["export", str(run.root)],
        "resume": ["train", config["data"], "--run", str(run.root), "--resume"],
        "search": ["search", str(run.root), str(query)],
    }[ARTIFACTS[artifact]]
    expect_error(command, capsys, Path(artifact).name)
