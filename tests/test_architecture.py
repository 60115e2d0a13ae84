"""The package's shape, checked from its source (DESIGN.md §2).

- Layers depend downward only, and no module imports itself back through others (no loop).
- SQL lives in ``manifest/``: no other module imports SQLAlchemy or a database driver.
- Every public function, method and class says in one line what it is for.
- Integrations (and the trainer) stand on the public floor: from ckptstore they import only
  ``ckptstore``, ``ckptstore.extending`` and ``ckptstore.errors`` (plus the integrations' own
  modules), never the layers below.
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
    "formatting": 0,
    "_lazy": 0,
    "objectstore": 1,
    "manifest": 1,
    "_migrations": 1,
    "cas": 2,
    "serialize": 3,
    "tiers": 3,
    "checkpointer": 4,
    "extending": 5,
    "formats": 5,
    "maintenance": 6,
    "integrations": 6,
    "testing": 6,
    "cli": 7,
    "web": 7,
    "demo": 8,
    "__init__": 8,
    "__main__": 8,
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


#: The manifest's levels (see ckptstore/manifest/_sql/__init__.py): Core statements (1), ORM
#: statements in a caller's session (2), named operations on a Database (3, every other module),
#: over the shared vocabulary of rows, records and statuses (0).
MANIFEST_LEVELS = {"models": 0, "records": 0, "statuses": 0, "_sql": 1, "_orm": 2}


def manifest_level(module: str) -> int | None:
    """The level of a manifest module (None outside the manifest)."""
    parts = module.split(".")
    if parts[:2] != ["ckptstore", "manifest"]:
        return None
    return MANIFEST_LEVELS.get(parts[2], 3) if len(parts) > 2 else 3


def level_may_import(mine: int | None, theirs: int | None) -> bool:
    """Outside the manifest (None): levels 0 and 3 only. Inside: the same level or a lower one;
    level 3 anything of the manifest."""
    if theirs is None:
        return True
    if mine is None:
        return theirs in (0, 3)
    return mine == 3 or theirs <= mine


def test_manifest_levels_live_in_their_paths() -> None:
    """Only the manifest imports its private statement packages; a level imports only lower
    ones; and no public function name is defined at two levels (each name says its level)."""
    known = {name for name, _ in modules()}
    wrong: list[str] = []
    names: dict[str, set[int]] = {}
    for module, path in modules():
        mine = manifest_level(module)
        wrong += [
            f"{module} -> {target}"
            for target in sorted(imports(path, module) & known)
            if not level_may_import(mine, manifest_level(target))
        ]
        if mine is not None:
            for name, node in public_definitions(path):
                if isinstance(node, ast.FunctionDef) and "." not in name:
                    names.setdefault(name, set()).add(mine)
    assert wrong == [], "manifest levels import downward only; outside, import operation modules"
    assert {n: levels for n, levels in names.items() if len(levels) > 1} == {}


# -- the public floor --------------------------------------------------------------------------

REPO = PACKAGE.parent
#: What an integration, or the trainer, may import from ckptstore (``ckptstore/extending.py``;
#: ``ckptstore/formats.py`` is the registry an integration adds its checkpoint format to).
FLOOR = frozenset({"ckptstore", "ckptstore.extending", "ckptstore.errors", "ckptstore.formats"})
#: Internals trainer/ may import beyond FLOOR: none (it is the reference user: what it needs is
#: public).
TRAINER_ALSO: frozenset[str] = frozenset()
#: Integration modules that may import more than the floor, and what. torchtitan's
#: ``last_save_in_hf`` writes the Hugging Face files ``ckptstore export --hf`` writes, with the
#: export's own code (one layer, not a copy; imported only when asked for).
INTEGRATIONS_ALSO = {
    "ckptstore.integrations.torchtitan._hf": frozenset({"ckptstore.maintenance.hfexport"}),
}


def imported_modules(path: Path, module: str) -> set[str]:
    """The ckptstore modules ``path`` imports: ``from ckptstore import manifest`` counts as
    ``ckptstore.manifest``, ``from ckptstore.extending import Run`` as ``ckptstore.extending``."""
    known = {name for name, _ in modules()} | {"ckptstore"}
    packages = {name.rsplit(".__init__", 1)[0] for name in known}
    found: set[str] = set()
    for name in imports(path, module):
        if not name.startswith("ckptstore"):
            continue
        # An imported name is a module only if one exists by that name; else its parent is.
        while name not in packages and name not in known and "." in name:
            name = name.rsplit(".", 1)[0]
        found.add(name)
    return {n for n in found if n == "ckptstore" or n.startswith("ckptstore.")}


def integration_may_import(module: str, target: str) -> bool:
    """Whether integration ``module`` may import ``target``: the floor; its own package, the
    shared ``_common`` one and the integrations' public modules; ``integrations/``'s top-level
    modules (the format table) may reach any integration module."""
    if target in FLOOR or target in INTEGRATIONS_ALSO.get(module, ()):
        return True
    if not target.startswith("ckptstore.integrations"):
        return False
    mine, theirs = module.split(".")[2:], target.split(".")[2:]
    if len(mine) <= 1 or not theirs or theirs[0] in (mine[0], "_common"):
        return True
    return not any(part.startswith("_") for part in theirs)


def floor_breaches(path: Path, module: str) -> list[str]:
    """The imports of integration ``module`` that the floor rule forbids."""
    return [
        f"{module} -> {target}"
        for target in sorted(imported_modules(path, module))
        if not integration_may_import(module, target)
    ]


def test_integrations_import_only_the_public_floor() -> None:
    breaches = [
        breach
        for module, path in modules()
        if layer_of(module) == "integrations"
        for breach in floor_breaches(path, module)
    ]
    assert breaches == [], "integrations import ckptstore.extending, not the layers below it"


def test_the_trainer_imports_only_the_floor_and_its_listed_internals() -> None:
    breaches = [
        f"{path.name} -> {target}"
        for path in sorted((REPO / "trainer").glob("*.py"))
        for target in sorted(imported_modules(path, f"trainer.{path.stem}"))
        if target not in FLOOR | TRAINER_ALSO and not public_integration(target)
    ]
    assert breaches == [], "trainer/ imports ckptstore.extending (or the top level), not internals"


def public_integration(target: str) -> bool:
    """An integration's public face (``ckptstore.integrations.dcp``), which the trainer uses
    as any user would; its private modules stay out of reach."""
    parts = target.split(".")
    return parts[:2] == ["ckptstore", "integrations"] and not any(
        part.startswith("_") for part in parts
    )


@pytest.mark.parametrize(
    ("source", "allowed"),
    [
        ("from ckptstore.extending import Run", True),
        ("from ckptstore import errors", True),
        ("from ckptstore.integrations.dcp._metadata import rank_component", True),
        ("from ckptstore.integrations._common.names import DCP_METADATA", True),
        ("from ckptstore.manifest import reading", False),
        ("from ckptstore import manifest", False),
        ("import ckptstore.serialize.reader", False),
        ("from ckptstore.checkpointer.run import Run", False),
        ("from ckptstore.integrations.megatron._commit import describe", False),
    ],
)
def test_the_floor_rule_tells_allowed_imports_from_breaches(
    tmp_path: Path, source: str, allowed: bool
) -> None:
    """The rule itself, on a DCP module that imports one thing."""
    path = tmp_path / "_example.py"
    path.write_text(source + "\n")
    breaches = floor_breaches(path, "ckptstore.integrations.dcp._example")
    assert (breaches == []) is allowed, breaches
