"""House rules a tool checks: the code is as `ruff format` writes it and `ruff check` finds nothing (pyproject.toml)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
TREES = ["retrieval", "training", "index", "app"]  # the product; pyproject.toml [tool.ruff] has the rules


def ruff() -> str:
    found = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    if not Path(found).is_file():
        pytest.fail("ruff is not installed: pip install -e '.[test]'")
    return found


@pytest.mark.parametrize("arguments", [["format", "--check"], ["check"]], ids=["ruff format", "ruff check"])
def test_ruff_is_clean(arguments: list[str]) -> None:
    done = subprocess.run([ruff(), *arguments, *TREES], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
