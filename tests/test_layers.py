"""Imports go one way: the package's layers (docs/architecture.md) only import layers below them, and no module
imports one that imports it back. Read from the source with `ast`, imports inside functions included."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "cmpchat"

LAYERS: list[set[str]] = [
    {"errors", "paths", "long_lived"},
    {"model", "vocab", "tokenizer", "chat", "sampling", "history", "kv_formats", "gpu_readings"},
    {"cudart"},
    {"kernels", "devtools"},
    {"backends"},
    {"vision"},
    {"engine"},
    {"demo", "api", "__init__"},
    {"evaluation", "bench", "doctor"},
    {"server", "tui", "commands"},
    {"cli", "__main__"},
]
"""From the bottom up; a module may import its own layer and those below (the cycle test keeps those one way).
`cmpchat` itself (`__init__`) re-exports the public API, so it sits with `api`."""


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, *, typing_only: bool = True) -> set[str]:
    """Every cmpchat module `path` imports (at module level or inside functions; with `typing_only`, also those
    under `if TYPE_CHECKING:`, which only annotations use)."""
    found = set()
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rsplit(".", 1)[0]
    tree = ast.parse(path.read_text(), str(path))
    if not typing_only:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
                node.body = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("cmpchat")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            if base.startswith("cmpchat"):
                found.add(base)
    return found


def graph(*, typing_only: bool = True) -> dict[str, set[str]]:
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    edges = {}
    for name, path in modules.items():
        targets = set()
        for target in imports(path, typing_only=typing_only):
            while target not in modules and "." in target:  # `from cmpchat.x import name` of a module's member
                target = target.rsplit(".", 1)[0]
            if target in modules and target != name:
                targets.add(target)
        edges[name] = targets
    return edges


def top_package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def layer_of(package: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if package in layer)


def test_every_package_has_a_layer() -> None:
    packages = {top_package(m) for m in graph()}
    assert packages <= set().union(*LAYERS), packages - set().union(*LAYERS)


def test_imports_only_go_down_the_layers() -> None:
    wrong = []
    for source, targets in graph().items():
        for target in targets:
            if layer_of(top_package(target)) > layer_of(top_package(source)):
                wrong.append(f"{source} imports {target}")
    assert not wrong, "\n".join(sorted(wrong))


def test_no_module_imports_one_that_imports_it_back() -> None:
    edges = graph(typing_only=False)  # an annotation's import makes no cycle at run time
    cycles = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for target in edges[node]:
            if state.get(target) == 1:
                cycles.append(" -> ".join([*stack[stack.index(target) :], target]))
            elif target not in state:
                visit(target)
        stack.pop()
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node)
    assert not cycles, "\n".join(cycles)
