"""The app under 32 concurrent clients mixing good and bad uploads (bench/app_load.py --mixed, short):
no good query fails, every bad one is answered with a message, and after a warm-up the server's memory
grows by less than GROWTH_LIMIT_MIB (the long runs: README, "The hardening suite, latest run")."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]
GROWTH_LIMIT_MIB = 12  # this test's setting: +2 to +5 MiB; +14 to +27 with Gradio's monitoring summary rebuilt per event (docs/reliability.md)


def test_32_clients_mixing_good_and_bad_uploads(tmp_path: Path) -> None:
    out = tmp_path / "load.json"
    command = [sys.executable, "bench/app_load.py", "--mixed", "--users", "32", "--seconds", "20", "--warmup", "10", "--images", "300", "--work", str(tmp_path / "work"), "--json", str(out)]
    finished = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert finished.returncode == 0, finished.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert figures["good"] > 0 and figures["bad"] > 0
    assert figures["failed good"] == 0 and figures["bad without a message"] == 0
    assert figures["growth_mib"] < GROWTH_LIMIT_MIB, figures["rss_samples"]
