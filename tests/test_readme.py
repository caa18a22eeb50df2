"""The README stays true to the code: its commands and options exist, its set-up is what CI runs."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest

from retrieval.commands import main
from retrieval.runs import RunDir
from tests.conftest import copy_classes

ROOT = Path(__file__).parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
GUIDE = (ROOT / "docs" / "guide.md").read_text(encoding="utf-8")  # holds the command reference table


def reference_rows() -> list[tuple[str, list[str]]]:
    """(command, options) for each row of the command reference table (docs/guide.md, linked from the README)."""
    rows = []
    for line in GUIDE.splitlines():
        match = re.match(r"\| `retrieval ([\w-]+)[^`]*` \|", line)
        if match:
            cells = re.split(r"(?<!\\)\|", line)  # table cells; "\|" inside a cell is an escaped pipe
            rows.append((match.group(1), re.findall(r"`(-{1,2}[\w-]+)", cells[3])))
    return rows


def test_the_reference_covers_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    listed = set(re.findall(r"│ (\w[\w-]*)\s{2,}", capsys.readouterr().out))
    assert len(listed) >= 7 and {command for command, _ in reference_rows()} == listed


@pytest.mark.parametrize("command,options", reference_rows())
def test_every_documented_option_exists(command: str, options: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main([command, "--help"]) == 0
    help_text = capsys.readouterr().out
    for option in options:
        assert option in help_text, f"README documents {option} for `retrieval {command}`"


def test_quick_start_commands_exist(capsys: pytest.CaptureFixture[str]) -> None:
    block = README.split("## Quick start")[1].split("```")[1]
    commands = re.findall(r"^retrieval (\w+)", block, flags=re.MULTILINE)
    assert commands == ["train", "export", "index", "evaluate", "evaluate", "audit", "search", "serve"]


def test_ci_runs_the_readmes_test_command() -> None:
    setup = README.split("## Two commands on a fresh machine")[1].split("```")[1].split()
    assert setup == ["make", "demo", "make", "test"]
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_cpu_and_gpu_builds_are_alternatives() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = " ".join(project["dependencies"])
    assert "faiss" not in base and "onnxruntime" not in base and "torch" not in base
    extras = project["optional-dependencies"]
    assert {name.split(">")[0].split("=")[0] for name in extras["cpu"]} == {"faiss-cpu", "onnxruntime"}
    assert {name.split(">")[0].split("=")[0] for name in extras["gpu"]} == {"faiss-gpu-cu12", "onnxruntime-gpu"}
    assert "torch==2.14.1" in extras["train"] and "torchvision==0.29.1" in extras["train"]


def test_the_api_example_runs(demo_run: RunDir) -> None:
    from app.server import launch
    from app.service import SearchService
    from tests.test_app import free_port

    code = README.split("<!-- api-example (run by tests/test_readme.py) -->")[1].split("```python")[1].split("```")[0]
    assert len([line for line in code.splitlines() if line.strip()]) == 3
    service = SearchService(demo_run)
    port = free_port()
    demo = launch(service, port=port, block=False)
    query = next(iter(service.items.values())).path
    try:
        names: dict = {}
        exec(code.replace("http://127.0.0.1:7860/", f"http://127.0.0.1:{port}/").replace('"query.jpg"', repr(str(query))), names)  # noqa: S102
        assert len(names["results"]) == 10 and names["summary"].startswith("10 results"), names["summary"]
    finally:
        demo.close()
        service.close()


def example(marker: str, language: str) -> str:
    """The code block of the README that follows an example marker."""
    return README.split(f"<!-- {marker} (run by tests/test_readme.py) -->")[1].split(f"```{language}")[1].split("```")[0]


def test_the_json_api_examples_run(demo_run: RunDir, tmp_path: Path) -> None:
    import subprocess

    from app.server import launch
    from app.service import SearchService
    from tests.test_app import free_port

    service = SearchService(demo_run)
    port = free_port()
    server = launch(service, port=port, block=False)
    query = tmp_path / "query.jpg"
    query.write_bytes(next(iter(service.items.values())).path.read_bytes())
    try:
        curl = example("curl-example", "bash").strip().replace("7860", str(port))
        done = subprocess.run(curl, shell=True, capture_output=True, text=True, cwd=tmp_path, check=True)  # noqa: S602
        assert len(json.loads(done.stdout)["hits"]) == 5
        names: dict = {}
        code = example("json-example", "python").replace("7860", str(port)).replace('"query.jpg"', repr(str(query)))
        exec(code, names)  # noqa: S102
        assert len(names["hits"]) == 5 and set(names["hits"][0]) == {"id", "score", "path", "label", "match"}
    finally:
        server.close()
        service.close()


def test_the_python_example_runs(small_folder: Path, icons_root: Path, tmp_path: Path) -> None:
    """The README's Python example, on a small folder and a short run: the same functions the commands call, the
    match threshold fitted on classes the run did not train on."""
    code = (
        README.split("<!-- python-example (run by tests/test_readme.py) -->")[1].split("```python")[1].split("```")[0]
    )
    query = next(small_folder.rglob("*.png"))
    replacements = {
        '"runs/photos"': repr(str(tmp_path / "run")),
        '"photos/train"': repr(str(small_folder)),
        '"photos/val"': repr(str(copy_classes(icons_root, tmp_path / "val", 4, "test"))),
        '"photos/gallery"': repr(str(small_folder)),
        '"photos/test"': repr(str(small_folder)),
        '"query.jpg"': repr(str(query)),
        "epochs=50": "epochs=1, batch_size=8, image_size=32",
    }
    for old, new in replacements.items():
        assert old in code, old
        code = code.replace(old, new)
    names: dict = {}
    exec(code, names)  # noqa: S102
    assert len(names["hits"]) == 5 and all(hit.path != str(query) for hit in names["hits"])
    threshold = names["run_threshold"](names["run"])
    assert threshold is not None and all(hit.match == (hit.score >= threshold) for hit in names["hits"])
    assert (tmp_path / "run" / "model.onnx").is_file() and (tmp_path / "run" / "index" / "manifest.json").is_file()
