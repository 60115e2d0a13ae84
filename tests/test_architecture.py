"""The package's shape, checked from its source (DESIGN.md §2).

- Layers depend downward only, and no module imports itself back through others (no loop).
- SQL lives in ``manifest/``: no other module imports SQLAlchemy or a database driver.
- Every public function, method and class says in one line what it is for.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "ckptstore"

#: Lower number = lower layer. A module may import its own layer or lower ones only.
LAYERS = {
    "errors": 0,
    "names": 0,
    "settings": 0,
    "durations": 0,
    "_lazy": 0,
    "objectstore": 1,
    "manifest": 1,
    "_migrations": 1,
    "cas": 2,
    "serialize": 3,
    "checkpointer": 4,
    "maintenance": 5,
    "integrations": 5,
    "testing": 5,
    "cli": 6,
    "web": 6,
    "demo": 7,
    "__init__": 7,
    "__main__": 7,
}
#: What may not see what even within the order (DESIGN §2: "objectstore knows nothing of SQL or
#: torch; manifest knows nothing of torch; cas knows nothing of SQL").
FORBIDDEN = {
    "objectstore": {"manifest", "cas", "serialize"},
    "manifest": {"objectstore", "cas", "serialize"},
    "cas": {"manifest"},
    "serialize": {"manifest"},
}
SQL_PACKAGES = ("sqlalchemy", "psycopg", "alembic", "sqlite3")


def modules() -> Iterator[tuple[str, Path]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        yield ".".join(("ckptstore", *parts)), path


def layer_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imports(path: Path, module: str) -> set[str]:
    """Absolute names of the modules ``path`` imports (relative imports resolved)."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def test_layers_depend_downward_only() -> None:
    known = {name for name, _ in modules()}
    upward = []
    for module, path in modules():
        mine = layer_of(module)
        assert mine in LAYERS, f"{module}: add its package to LAYERS (which layer is it?)"
        for target in imports(path, module):
            if target not in known or not target.startswith("ckptstore."):
                continue
            theirs = layer_of(target)
            if LAYERS[theirs] > LAYERS[mine] or theirs in FORBIDDEN.get(mine, set()):
                upward.append(f"{module} -> {target}")
    assert upward == []


def test_no_import_loops_between_modules() -> None:
    known = {name for name, _ in modules()}
    graph = {
        module: {t for t in imports(path, module) if t in known and t != module}
        for module, path in modules()
    }
    # Package __init__ modules re-export their submodules: importing a package is not a cycle
    # through the package's own children.
    for module in graph:
        graph[module] = {t for t in graph[module] if not module.startswith(f"{t}.")}
    state: dict[str, int] = {}
    loops: list[str] = []

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                loops.append(" -> ".join([*trail[trail.index(nxt) :], nxt]))
            elif nxt not in state:
                visit(nxt, [*trail, nxt])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert loops == []


def test_only_the_manifest_speaks_sql() -> None:
    offenders = [
        f"{module} imports {target}"
        for module, path in modules()
        if layer_of(module) not in {"manifest", "_migrations"}
        for target in imports(path, module)
        if target.split(".")[0] in SQL_PACKAGES
    ]
    assert offenders == []


def public_definitions(path: Path) -> Iterator[tuple[str, ast.AST]]:
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            if not node.name.startswith("_"):
                yield node.name, node
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                for item in node.body:
                    if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) and not (
                        item.name.startswith("_")
                        or any(
                            isinstance(d, ast.Attribute) and d.attr == "setter"
                            for d in item.decorator_list
                        )
                    ):
                        yield f"{node.name}.{item.name}", item


@pytest.mark.parametrize("module", [m for m, _ in modules()])
def test_every_public_function_says_what_it_is_for(module: str) -> None:
    path = dict(modules())[module]
    missing = [
        name
        for name, node in public_definitions(path)
        if not isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        or ast.get_docstring(node) is None
    ]
    assert missing == [], f"{module}: give these a one-line docstring: {missing}"
