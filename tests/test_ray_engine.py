"""`retrieval index --engine ray`: on a local Ray, the same index as the local engine, incremental and resumable."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import index.build as build_module
from index.build import build_index
from index.ray_engine import RayOptions
from index.store import GalleryIndex
from retrieval.commands import main
from retrieval.data import load_collection
from retrieval.embedders import OnnxEmbedder
from retrieval.runs import RunDir
from tests.conftest import copy_classes, write_bad_files


@pytest.fixture(scope="module")
def local_ray() -> Iterator[object]:
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    ray.shutdown()


def contents(index: GalleryIndex) -> dict[str, tuple[str, str, np.ndarray]]:
    """path -> (label, sha256, vector) of every item."""
    rows = index.rows()
    vectors = index.vectors_of(sorted(rows))
    return {path: (label, digest, vector) for (path, label, digest), vector in zip((rows[i] for i in sorted(rows)), vectors)}


def test_the_ray_engine_builds_the_local_engines_index(local_ray: object, demo_run: RunDir, icons_root: Path, tmp_path: Path) -> None:
    data = copy_classes(icons_root, tmp_path / "data", 4)
    write_bad_files(data / "broken")
    embedder = OnnxEmbedder.from_run(demo_run)
    local = build_index(embedder, load_collection(data), tmp_path / "local", progress=False)
    remote = build_index(embedder, load_collection(data), tmp_path / "ray", progress=False, ray=RayOptions(workers=2))
    assert remote.embedded == local.embedded > 0
    assert sorted((str(s.path), s.reason) for s in remote.skipped) == sorted((str(s.path), s.reason) for s in local.skipped)
    assert remote.index.rows() == local.index.rows()  # same ids, paths, labels and hashes
    ours, theirs = contents(local.index), contents(remote.index)
    assert np.allclose(np.stack([v for *_, v in ours.values()]), np.stack([theirs[p][2] for p in ours]), atol=1e-5)
    queries = local.index.vectors_of([1, 2, 3])
    assert [[hit.id for hit in hits] for hits in remote.index.search(queries, 5)] == [[hit.id for hit in hits] for hits in local.index.search(queries, 5)]

    again = build_index(embedder, load_collection(data), tmp_path / "ray", progress=False, ray=RayOptions(workers=1))
    assert again.embedded == 0 and again.unchanged == local.embedded  # incremental: nothing decoded again
    changed = next((data / sorted(p.name for p in data.iterdir() if p.name != "broken")[0]).iterdir())
    Image.new("RGB", (40, 40), (1, 2, 3)).save(changed)
    Image.new("RGB", (40, 40), (9, 9, 9)).save(data / "broken" / "new.png")
    third = build_index(embedder, load_collection(data), tmp_path / "ray", progress=False, ray=RayOptions(workers=1))
    assert third.embedded == 2 and third.removed == 1 and len(third.index) == len(local.index) + 1


def test_a_killed_ray_job_resumes_from_its_journal(local_ray: object, demo_run: RunDir, icons_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = copy_classes(icons_root, tmp_path / "data", 4)
    embedder = OnnxEmbedder.from_run(demo_run)
    real = build_module.iter_embedded_ray

    def killed_after_two_batches(*args: object, **options: object) -> Iterator[object]:
        for number, batch in enumerate(real(*args, **options)):  # type: ignore[arg-type]
            if number == 2:
                raise KeyboardInterrupt  # as a kill would, after two batches were journaled
            yield batch

    monkeypatch.setattr(build_module, "iter_embedded_ray", killed_after_two_batches)
    with pytest.raises(KeyboardInterrupt):
        build_index(embedder, load_collection(data), tmp_path / "ray", batch_size=8, progress=False, ray=RayOptions(workers=1))
    monkeypatch.setattr(build_module, "iter_embedded_ray", real)
    resumed = build_index(embedder, load_collection(data), tmp_path / "ray", batch_size=8, progress=False, ray=RayOptions(workers=1))
    whole = build_index(embedder, load_collection(data), tmp_path / "local", progress=False)
    assert resumed.resumed == 16 and resumed.embedded == whole.embedded - 16
    assert resumed.index.rows().values().__len__() == len(whole.index)
    assert sorted(resumed.index.rows().values()) == sorted(whole.index.rows().values())


def test_without_ray_the_engine_says_how_to_install_it(demo_run: RunDir, small_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)
    assert main(["index", str(demo_run.root), str(small_folder), "--index", str(tmp_path / "ix"), "--engine", "ray"]) == 2
    assert "pip install 'retrieval[ray]'" in capsys.readouterr().err
    assert main(["index", str(demo_run.root), str(small_folder), "--index", str(tmp_path / "ix"), "--engine", "spark"]) == 2
    capsys.readouterr()
    for option, value in (("--address", "10.0.0.5:6379"), ("--workers", "4")):  # ignored without --engine ray
        assert main(["index", str(demo_run.root), str(small_folder), "--index", str(tmp_path / "ix"), option, value]) == 2
        assert f"{option} sets how --engine ray embeds: add --engine ray, or leave {option} out" in capsys.readouterr().err
    assert main(["index", str(demo_run.root), str(small_folder), "--index", str(tmp_path / "ix"), "--milvus-index", "HNSW"]) == 2
    assert "--milvus-index sets a Milvus collection's index: add --backend milvus --uri URI" in capsys.readouterr().err
    assert main(["index", str(demo_run.root), str(small_folder), "--index", str(tmp_path / "ix"), "--uri", "gallery.db"]) == 2
    assert "--uri gallery.db is where a Milvus collection lives: add --backend milvus, or leave --uri out" in capsys.readouterr().err
    assert main(["index", str(demo_run.root), str(small_folder), "--index", str(tmp_path / "ix"), "--faiss", "Flat", "--memory", "1KB"]) == 2
    assert "--memory sets the budget within which the index type is chosen, and --faiss Flat chooses it: drop one of the two" in capsys.readouterr().err  # it was ignored
    assert not (tmp_path / "ix").exists()
