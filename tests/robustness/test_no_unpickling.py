"""Nothing a user can hand us is unpickled: a scan of the product's source for every way to do it."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).parents[2]
PACKAGES = ("retrieval", "index", "app", "training")
UNPICKLING_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "shelve", "marshal"}


def calls_to(tree: ast.AST, dotted: str) -> list[ast.Call]:
    """Calls whose function is written as dotted (e.g. torch.load)."""
    return [node for node in ast.walk(tree) if isinstance(node, ast.Call) and ast.unparse(node.func) == dotted]


def keyword(call: ast.Call, name: str) -> object:
    return next((ast.literal_eval(k.value) for k in call.keywords if k.arg == name), None)


def test_the_product_never_unpickles() -> None:
    sources = [path for package in PACKAGES for path in (ROOT / package).rglob("*.py")]
    assert len(sources) > 20
    problems = []
    for path in sources:
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node in ast.walk(tree):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            problems += [f"{path}: imports {name}" for name in names if name.split(".")[0] in UNPICKLING_MODULES]
        problems += [f"{path}:{call.lineno}: torch.load without weights_only=True" for call in calls_to(tree, "torch.load") if keyword(call, "weights_only") is not True]
        problems += [f"{path}:{call.lineno}: np.load with allow_pickle" for call in calls_to(tree, "np.load") if keyword(call, "allow_pickle")]
        problems += [f"{path}:{call.lineno}: yaml.load" for call in calls_to(tree, "yaml.load")]
    assert problems == []


def test_the_scan_finds_what_it_looks_for(tmp_path: Path) -> None:
    tree = ast.parse("import pickle\nimport torch\ntorch.load('x')\ntorch.load('y', weights_only=True)\nnp.load('z', allow_pickle=True)\n")
    assert [call.lineno for call in calls_to(tree, "torch.load") if keyword(call, "weights_only") is not True] == [3]
    assert [call.lineno for call in calls_to(tree, "np.load") if keyword(call, "allow_pickle")] == [5]
