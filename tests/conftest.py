"""Shared fixtures: the embedded icons dataset, small image folders, and one small demo run."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from PIL import Image

from retrieval.commands import main
from retrieval.datasets import icons
from retrieval.runs import RunDir

# torchvision's weight cache, empty: the default recipe uses ImageNet weights when they are cached, and the tests
# (and the commands they start) must train the same recipe on every machine
# (one per test process, removed when it exits: every run of the suite left its empty folders in /tmp)
_TORCH_HOME = tempfile.TemporaryDirectory(prefix="retrieval-tests-torch-")
os.environ["TORCH_HOME"] = _TORCH_HOME.name

# the temporary files of the libraries the tests drive, in this process and the commands it starts (gradio_client
# leaves an empty folder in the temporary folder per file it downloads, and its downloads in <temp>/gradio; torchrun
# its logs; Ray its sessions): in a folder of the test run's own, removed when the process that made it exits;
# pytest's tmp_path folders stay in the system's temporary folder, kept after a failure as pytest keeps them. Made
# once: this module is imported again as tests.conftest, and by the processes the tests start. Its name is short:
# Ray's socket paths under it must stay within 107 bytes.
if "RETRIEVAL_TESTS_TMP" not in os.environ:
    os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", tempfile.gettempdir())
    _TEMPORARY = tempfile.TemporaryDirectory(prefix="retrieval-tmp-", ignore_cleanup_errors=True)
    os.environ["RETRIEVAL_TESTS_TMP"] = _TEMPORARY.name
tempfile.tempdir = os.environ["TMPDIR"] = os.environ["RETRIEVAL_TESTS_TMP"]


@pytest.fixture(scope="session")
def icons_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded dataset, unpacked into a test-only cache."""
    return icons(tmp_path_factory.mktemp("cache"))


def copy_classes(icons_root: Path, target: Path, classes: int, split: str = "train") -> Path:
    """Copies the first `classes` classes of a split into target (ROOT/<label>/<image>)."""
    for folder in sorted((icons_root / split).iterdir())[:classes]:
        shutil.copytree(folder, target / folder.name)
    return target


def icon_copies(icons_root: Path, gallery: Path, copies: int) -> Path:
    """A gallery of `copies` copies of every test icon under new names (ROOT/<label>/<copy>-<name>): about 500 images
    a copy, enough for an indexing job to be stopped part-way."""
    for copy in range(copies):
        for source in (icons_root / "test").rglob("*.png"):
            target = gallery / source.parent.name / f"{copy}-{source.name}"
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(source.read_bytes())
    return gallery


def as_in_a_terminal() -> None:
    """Ctrl+C as a terminal's foreground process gets it: a test run started in the background (`make test &`, nohup)
    starts its children with SIGINT ignored, and Python keeps ignoring what it starts with ignored."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def prints(line: str) -> Callable[[subprocess.Popen], bool]:
    """Whether the command's next line of output starts with line (a readiness test for ctrl_c_when)."""
    return lambda worker: (worker.stdout.readline() or "").startswith(line)


def ctrl_c_when(command: list[str], ready: Callable[[subprocess.Popen], bool]) -> tuple[int, str]:
    """Runs command as a terminal would and presses Ctrl+C once ready(worker) is true (or it ended, or 240 s went
    by): (exit status, stderr)."""
    worker = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=Path(__file__).parents[1], preexec_fn=as_in_a_terminal)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and worker.poll() is None and not ready(worker):
            time.sleep(0.01)
        worker.send_signal(signal.SIGINT)
        _, err = worker.communicate(timeout=120)
    finally:
        worker.kill()  # nothing left behind when the test fails (a no-op once it has exited)
    return worker.returncode, err


@pytest.fixture
def small_folder(icons_root: Path, tmp_path: Path) -> Path:
    """Four real classes of the icons training split."""
    return copy_classes(icons_root, tmp_path / "images", 4)


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory: pytest.TempPathFactory, icons_root: Path) -> RunDir:
    """A run made by `retrieval demo --no-serve` on a small subset (8 classes, 2 epochs)."""
    root = tmp_path_factory.mktemp("demo") / "run"
    assert main(["demo", "--no-serve", "--run", str(root), "--classes", "8", "--epochs", "2"]) == 0
    return RunDir(root)


def write_bad_files(folder: Path) -> dict[str, Path]:
    """Writes an empty, a truncated and a non-image file (with an image suffix) into folder."""
    folder.mkdir(parents=True, exist_ok=True)
    good = folder / "good.png"
    Image.new("RGB", (40, 30), (200, 30, 30)).save(good)
    paths = {"empty": folder / "empty.png", "truncated": folder / "truncated.png", "text": folder / "notes.jpg"}
    paths["empty"].write_bytes(b"")
    paths["truncated"].write_bytes(good.read_bytes()[:60])
    paths["text"].write_text("this is not an image\n")
    return paths


def pytest_terminal_summary(terminalreporter: object, exitstatus: int, config: object) -> None:
    """Says in one line at the end when the browser tests were skipped, and how to run them."""
    skipped = [report for report in terminalreporter.stats.get("skipped", []) if "test_browser" in report.nodeid]  # type: ignore[attr-defined]
    if skipped:
        terminalreporter.write_line(  # type: ignore[attr-defined]
            f"{len(skipped)} browser {'test' if len(skipped) == 1 else 'tests'} skipped: they need Debian's Chromium and Playwright (sudo apt-get install chromium)",
            yellow=True,
        )
