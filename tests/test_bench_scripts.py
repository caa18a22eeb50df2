"""The benchmark scripts that have no other test: the GPU check's refusal without a GPU, the re-ranking, label-search and exit benches, and the index bench's data sets."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from retrieval.runs import RunDir

ROOT = Path(__file__).parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine the check runs for real")
def test_the_gpu_check_says_there_is_no_gpu_and_exits_2(tmp_path: Path) -> None:
    report = tmp_path / "report.txt"
    done = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), str(report)], capture_output=True, text=True, env={"PATH": str(Path(sys.executable).parent) + ":/usr/bin:/bin", "PYTHON": sys.executable})
    assert done.returncode == 2
    assert done.stderr.strip() == "gpu_check: no CUDA GPU visible to PyTorch here; run it on a GPU machine, installed with pip install -e '.[gpu,train]'"
    assert not report.exists()


def test_the_rerank_bench_times_every_reranker_against_none() -> None:
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "rerank.py"), "--sizes", "300", "--batch", "4", "--batches", "1", "--shortlist", "20"], capture_output=True, text=True, cwd=ROOT, check=True)
    row = next(line for line in done.stdout.splitlines() if line.startswith("│ 300"))
    cells = [cell.strip() for cell in row.strip("│").split("│")]
    assert len(cells) == 5 and all(cell.endswith("x)") for cell in cells[2:])


def test_the_label_search_bench_measures_every_label_share() -> None:
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "label_search.py"), "--items", "2000", "--factories", "HNSW16"], capture_output=True, text=True, cwd=ROOT, check=True)
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines() if line.startswith("| HNSW16")]
    assert [row[1].strip() for row in rows] == ["0.1 %", "1 %", "10 %", "50 %"]
    assert all(float(row[2]) >= 0.9 for row in rows)  # recall@10
    assert [float(row[3]) for row in rows] == [2.0, 10.0, 10.0, 10.0]  # hits a query: the 0.1 % label has 2 items


def bench_module(name: str) -> object:
    """A bench/ script loaded by path (its own name, index, would hide the project's package)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def test_the_spectrum_fit_recovers_a_known_mixture() -> None:
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 50, 3000)
    centres = rng.standard_normal((50, 64)) * np.sqrt(0.3)
    vectors = centres[labels] + rng.standard_normal((3000, 64)) * np.sqrt(0.7)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    fitted = bench_module("spectrum").fit(vectors.astype(np.float32), [str(label) for label in labels], 32)  # type: ignore[attr-defined]
    assert abs(fitted["between_class_share"] - 0.3) < 0.05 and fitted["mean_share"] < 0.01
    assert len(fitted["variances"]) == 32 and abs(sum(fitted["variances"]) - 1) < 1e-4 and fitted["variance_in_top"] < 0.8


def test_the_index_bench_sets_have_the_fitted_intrinsic_dimension() -> None:
    """The hard sets are what bench/index.py and docs/benchmarks.md say: whitened about 30 (TwoNN), encoder about 13."""
    index, spectrum = bench_module("index"), bench_module("spectrum")
    dimensions = {}
    for data in ("whitened", "encoder"):
        gallery = index.generated(data, 4000, 128, seed=1)  # type: ignore[attr-defined]
        np.testing.assert_allclose(np.linalg.norm(gallery, axis=1), 1, atol=1e-5)
        np.testing.assert_array_equal(index.generated(data, 50, 128, seed=1), index.generated(data, 50, 128, seed=1))  # type: ignore[attr-defined]
        assert not np.allclose(index.generated(data, 50, 128, seed=1), index.generated(data, 50, 128, seed=2))  # type: ignore[attr-defined]
        dimensions[data] = spectrum.two_nn(gallery)  # type: ignore[attr-defined]
    assert 20 <= dimensions["whitened"] <= 40 and 8 <= dimensions["encoder"] <= 20, dimensions


def test_the_glyph_collection_is_seeded_and_keeps_cases_apart(tmp_path: Path) -> None:
    glyphs = bench_module("glyphs")
    fonts = glyphs.fonts()  # type: ignore[attr-defined]
    if not fonts:
        pytest.skip("this machine has no fonts")
    root = glyphs.write_glyphs(tmp_path / "glyphs", "aA1")  # type: ignore[attr-defined]
    assert sorted(folder.name for folder in root.iterdir()) == ["1", "A_upper", "a_lower"]
    assert {len(list(folder.iterdir())) for folder in root.iterdir()} == {len(fonts)}
    first = np.asarray(glyphs.render("a", fonts[0]))  # type: ignore[attr-defined]
    assert first.shape == (64, 64, 3) and first.min() < 100 and first.max() == 255  # dark ink on white
    np.testing.assert_array_equal(first, np.asarray(glyphs.render("a", fonts[0])))  # type: ignore[attr-defined]
    assert not np.array_equal(first, np.asarray(glyphs.render("a", fonts[-1])))  # type: ignore[attr-defined]


def test_the_exit_bench_times_each_command_both_ways(demo_run: RunDir, tmp_path: Path) -> None:
    command = [sys.executable, str(ROOT / "bench" / "exit.py"), "--run", str(demo_run.root), "--rounds", "1", "--work", str(tmp_path), "--commands", "index-stats,search"]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=300, check=True)
    rows = [[cell.strip() for cell in line.strip("│").split("│")] for line in done.stdout.splitlines() if line.startswith("│ ")]
    assert [row[:2] for row in rows] == [["index-stats", "skipped (shipped)"], ["index-stats", "done"], ["search", "skipped (shipped)"], ["search", "done"]]
    assert all(0 < float(row[3]) < float(row[2]) for row in rows)  # the end is part of the whole
