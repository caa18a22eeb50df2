"""The app under 32 concurrent clients mixing good and bad uploads (bench/app_load.py --mixed, short):
no good query fails, every bad one is answered with a message, and after a warm-up the server's memory
grows by less than GROWTH_LIMIT_MIB (the long runs: README, "The hardening suite, latest run")."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from retrieval.runs import RunDir

ROOT = Path(__file__).parents[2]
GROWTH_LIMIT_MIB = 12  # this test's setting: +2 to +5 MiB; +14 to +27 with Gradio's monitoring summary rebuilt per event (docs/reliability.md)


def test_32_clients_mixing_good_and_bad_uploads(demo_run: RunDir, tmp_path: Path) -> None:
    out = tmp_path / "load.json"
    # the session's demo run is the run the bench would train (`retrieval demo` on 8 classes, 2 epochs): its model serves
    shutil.copytree(demo_run.root, tmp_path / "work" / "run", ignore=shutil.ignore_patterns("checkpoints", "index"))
    command = [sys.executable, "bench/app_load.py", "--mixed", "--users", "32", "--seconds", "20", "--warmup", "10", "--images", "300", "--work", str(tmp_path / "work"), "--json", str(out)]
    finished = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert finished.returncode == 0, finished.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert figures["good"] > 0 and figures["bad"] > 0
    assert figures["failed good"] == 0 and figures["bad without a message"] == 0
    assert figures["growth_mib"] < GROWTH_LIMIT_MIB, figures["rss_samples"]
