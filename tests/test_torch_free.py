"""The search side runs without torch: index/ and app/ never import it (ARCHITECTURE.md)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from retrieval.runs import RunDir

BLOCK_TORCH = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"torch", "torchvision", "training"}:
            raise ImportError(f"{name} is made unimportable for this test")
sys.meta_path.insert(0, Block())
"""


def test_search_over_an_existing_index_without_torch(demo_run: RunDir) -> None:
    query = sorted(demo_run.index.parent.glob("demo-test.csv"))[0]
    first_image = query.read_text().splitlines()[1].split(",")[0]
    script = BLOCK_TORCH + f"""
from retrieval.commands import main
from app.service import SearchService
service = SearchService(__import__("retrieval.runs").runs.RunDir(__import__("pathlib").Path({str(demo_run.root)!r})))
result = service.search({first_image!r}, k=3)
assert len(result.hits) == 3, result
assert main(["search", {str(demo_run.root)!r}, {first_image!r}, "-k", "2"]) == 0
assert not any(name.split(".")[0] in {{"torch", "torchvision", "training"}} for name in sys.modules)
print("ok without torch")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=Path(__file__).parents[1], timeout=300)
    assert done.returncode == 0, done.stderr
    assert "ok without torch" in done.stdout


def test_training_without_torch_says_which_extra_to_install(tmp_path: Path) -> None:
    script = BLOCK_TORCH + f"""
from retrieval.commands import main
raise SystemExit(main(["train", {str(tmp_path)!r}, "--run", {str(tmp_path / "run")!r}]))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=Path(__file__).parents[1], timeout=120)
    assert done.returncode == 2
    assert "pip install 'retrieval[train]'" in done.stderr and "Traceback" not in done.stderr


def test_search_without_faiss_says_which_extra_to_install(demo_run: RunDir) -> None:
    script = f"""
import sys
sys.modules["faiss"] = None  # as if no faiss build were installed
from retrieval.commands import main
raise SystemExit(main(["search", {str(demo_run.root)!r}, "query.png"]))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=Path(__file__).parents[1], timeout=120)
    assert done.returncode == 2
    assert "pip install 'retrieval[cpu]'" in done.stderr and "Traceback" not in done.stderr
