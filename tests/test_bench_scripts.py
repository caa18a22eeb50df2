"""The benchmark scripts that have no other test: the GPU check's refusal without a GPU, and the re-ranking bench."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

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
