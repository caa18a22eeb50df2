"""The hardening suite at its long setting, and the reliability table of the README from its outcome.

Runs tests/robustness with more kills (ROBUSTNESS_KILLS) and many more fuzzed inputs
(HYPOTHESIS_PROFILE=long: 5,000 per property instead of 150), then the app under --users clients
mixing good and bad uploads for --seconds after --warmup seconds (bench/app_load.py --mixed), and prints one row per
check with its outcome and time; --markdown writes the same table for the README.

    python bench/robustness.py [--kills 10] [--seconds 60] [--warmup 120] [--users 32] [--markdown reliability.md]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from pathlib import Path

from rich.console import Console
from rich.table import Table

from recipe import write_markdown  # bench/ is this script's folder, first on sys.path

ROOT = Path(__file__).parents[1]
AREAS = {  # test module -> what it exercises
    "test_adversarial_inputs": "adversarial corpus through train, index, search, evaluate, the app",
    "test_fuzz_decoding": "fuzzed bytes and images through decoding, preprocessing, augmentation",
    "test_faults": "SIGKILL loops (training, indexing, app writes) and a full disk",
    "test_damaged_artifacts": "truncated and bit-flipped checkpoints, ONNX, FAISS, SQLite, JSON",
    "test_no_unpickling": "no unpickling anywhere in the product",
    "test_load": "32 clients, good and bad uploads (short)",
}


def run_suite(kills: int, fuzz: str, report: Path) -> list[dict]:
    """Runs tests/robustness; returns one row per test case: module, name, outcome, seconds."""
    environment = {**os.environ, "ROBUSTNESS_KILLS": str(kills), "HYPOTHESIS_PROFILE": fuzz}
    subprocess.run([sys.executable, "-m", "pytest", "-q", "tests/robustness", f"--junitxml={report}"], cwd=ROOT, env=environment, check=False)
    rows = []
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        failed = case.find("failure") is not None or case.find("error") is not None
        outcome = "failed" if failed else "skipped" if case.find("skipped") is not None else "passed"
        rows.append({"module": case.get("classname", "").split(".")[-1], "name": case.get("name", ""), "outcome": outcome, "seconds": float(case.get("time", 0))})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=10, help="SIGKILLs of each job in the fault loops")
    parser.add_argument("--fuzz", default="long", help="hypothesis profile: long (5,000 inputs per property) or ci (150)")
    parser.add_argument("--seconds", type=float, default=60.0, help="length of the load run")
    parser.add_argument("--warmup", type=float, default=120.0, help="seconds of the same load before it, not measured (a 10,000-image index levels off after 60-120 s)")
    parser.add_argument("--users", type=int, default=32)
    parser.add_argument("--markdown", type=Path, default=None)
    args = parser.parse_args()
    console = Console(width=160)
    with tempfile.TemporaryDirectory() as scratch:
        rows = run_suite(args.kills, args.fuzz, Path(scratch) / "report.xml")
        figures_path = Path(scratch) / "load.json"
        command = [sys.executable, "bench/app_load.py", "--mixed", "--users", str(args.users), "--seconds", str(args.seconds), "--warmup", str(args.warmup), "--work", str(Path(scratch) / "load"), "--json", str(figures_path)]
        load_ok = subprocess.run(command, cwd=ROOT, check=False).returncode == 0 and figures_path.is_file()
        figures = json.loads(figures_path.read_text()) if load_ok else {}
    table = Table(title=f"tests/robustness with {args.kills} kills per fault loop and the {args.fuzz!r} fuzzing profile; the app under {args.users} clients for {args.seconds:.0f} s")
    header = ("area", "checks", "passed", "failed", "figures", "seconds")
    for column in header:
        table.add_column(column)
    lines = []
    for module, area in AREAS.items():
        cases = [row for row in rows if row["module"] == module]
        passed = sum(row["outcome"] == "passed" for row in cases)
        failed = [row["name"] for row in cases if row["outcome"] == "failed"]
        lines.append((area, str(len(cases)), str(passed), ", ".join(failed) or "0", "", f"{sum(row['seconds'] for row in cases):.0f}"))
    area = f"the app under {args.users} clients for {args.seconds:.0f} s after {args.warmup:.0f} s, {figures.get('bad', 0):,} of {figures.get('bad', 0) + figures.get('good', 0):,} uploads bad"
    if figures:
        ok = not figures["failed good"] and not figures["bad without a message"]
        held = (
            f"{figures['failed good']} good queries failed, {figures['bad without a message']} bad ones without a message; "
            f"server memory {figures['rss_first_mib']:.0f} → {figures['rss_last_mib']:.0f} MiB ({figures['growth_mib']:+.0f})"
        )
        lines.append((area, "1", str(int(ok)), str(int(not ok)), held, f"{args.seconds:.0f}"))
    else:
        lines.append((area, "1", "0", "1", "the load run did not finish", "-"))
    for line in lines:
        table.add_row(*line)
    console.print(table)
    if args.markdown:
        write_markdown(args.markdown, header, lines)


if __name__ == "__main__":
    main()
