"""The layers of ARCHITECTURE.md, checked on the source: arrows point one way, and there is no circle.

- the core (retrieval/, but its commands) imports no stage (training/, index/, app/) and not the commands;
- index/ and app/ import neither torch, torchvision nor training/; index/ does not import app/;
- training/ imports neither index/ nor app/;
- nothing imports the command line (retrieval.commands) but itself and `python -m retrieval`; it imports stages only
inside
  its commands (lazily), and only the serve command imports app/.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
PACKAGES = ("retrieval", "training", "index", "app")
STAGES = {"training", "index", "app"}
TORCH = {"torch", "torchvision", "training"}
COMMANDS = "retrieval.commands"
ENTRY_POINTS = {"retrieval.__main__"}  # `python -m retrieval` (torchrun runs it so), like the `retrieval` script


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(source: str) -> list[tuple[str, bool]]:
    """(imported name, at module level) for every import of a module's source: `import a.b` gives a.b,
    `from a.b import c` gives a.b.c (a module of a.b, or a name in it)."""
    tree = ast.parse(source)
    top = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{alias.name}" for alias in node.names]  # a module, or a name in one
        found += [(name, id(node) in top) for name in names]
    return found


def violations(module: str, source: str) -> list[str]:
    """The import rules this module breaks, one line each."""
    broken = []
    package = module.split(".")[0]
    for name, module_level in imports(source):
        root = name.split(".")[0]
        in_commands = module == COMMANDS or module.startswith(COMMANDS + ".") or module in ENTRY_POINTS
        if (name == COMMANDS or name.startswith(COMMANDS + ".")) and not in_commands:
            broken.append(f"{module} imports the command line ({name})")
        if package == "retrieval" and not in_commands and root in STAGES:
            broken.append(f"the core module {module} imports the stage {name}")
        if package in ("index", "app") and root in TORCH:
            broken.append(f"{module} imports {name}: the search side runs without torch and training/")
        if (package == "index" and root == "app") or (package == "training" and root in ("index", "app")):
            broken.append(f"{module} imports {name}, a stage above it")
        if in_commands and root in STAGES and module_level:
            broken.append(f"{module} imports {name} at module level: the commands import stages inside each command")
        if in_commands and root == "app" and module != f"{COMMANDS}.serve":
            broken.append(f"{module} imports {name}: only the serve command imports app/")
    return broken


def product_modules() -> dict[str, str]:
    return {
        module_name(path): path.read_text(encoding="utf-8")
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
    }


def test_every_arrow_points_down() -> None:
    broken = [line for module, source in product_modules().items() for line in violations(module, source)]
    assert not broken, "\n".join(broken)


def test_no_module_circle() -> None:
    modules = product_modules()

    def target(name: str) -> str:
        return name if name in modules else name.rpartition(".")[0]

    def targets(source: str) -> set[str]:
        """The modules an import runs: `from pkg import sub` reads pkg's namespace, so it depends on pkg's
        __init__ as well as on pkg.sub; `from pkg.sub import name` needs pkg.sub only."""
        found = set()
        for name, _ in imports(source):
            found.add(target(name))
            package, _, _ = name.rpartition(".")
            if name in modules and package in modules and (ROOT / package.replace(".", "/") / "__init__.py").is_file():
                found.add(package)
        return found & set(modules)

    graph = {module: targets(source) - {module} for module, source in modules.items()}
    state: dict[str, int] = {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                pytest.fail(
                    "import circle: " + " -> ".join([*path[path.index(target) :], target]) if target in path else target
                )
            if target not in state:
                visit(target, [*path, target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


@pytest.mark.parametrize(
    "module,source,rule",
    [
        ("retrieval.metrics", "from index.store import GalleryIndex", "imports the stage"),
        ("index.search", "def f():\n    import torch", "runs without torch"),
        ("app.server", "from training.loop import train", "runs without torch"),
        ("index.build", "from retrieval.commands.output import console", "imports the command line"),
        ("retrieval.commands.search", "from index.search import search_images", "at module level"),
        ("retrieval.commands.search", "def f():\n    from app.service import SearchService", "only the serve command"),
        ("training.exporting", "from index.build import build_index", "a stage above it"),
    ],
)
def test_a_forbidden_import_is_caught(module: str, source: str, rule: str) -> None:
    assert any(rule in line for line in violations(module, source))
