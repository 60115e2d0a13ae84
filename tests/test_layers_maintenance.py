"""``maintenance`` and ``integrations`` share a layer and never reach into each other from
maintenance's side: what both use (the format registry) is on the floor below both
(``ckptstore/formats.py``), and reading foreign checkpoints (``ckptstore import``) is an
integration (``ckptstore.integrations.importing``), not maintenance."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_architecture import LAYERS, imported_modules, layer_of, modules


def maintenance_imports_of_integrations() -> list[str]:
    """Every import of an integration module by a maintenance module (function-level ones too)."""
    return [
        f"{module} -> {target}"
        for module, path in modules()
        if layer_of(module) == "maintenance"
        for target in sorted(imported_modules(path, module))
        if layer_of(target) == "integrations"
    ]


def test_maintenance_never_imports_integrations() -> None:
    assert maintenance_imports_of_integrations() == []


def test_the_format_registry_is_below_both() -> None:
    assert LAYERS["formats"] < min(LAYERS["maintenance"], LAYERS["integrations"])


@pytest.mark.parametrize(
    "source",
    [
        "from ckptstore.integrations.formats import format_of",
        "from ckptstore.integrations import dcp",
        "import ckptstore.integrations.dcp._reader",
    ],
)
def test_the_rule_sees_imports_inside_functions(tmp_path: Path, source: str) -> None:
    """The check reads imports at any depth (maintenance imports torch-heavy code lazily)."""
    path = tmp_path / "_example.py"
    path.write_text("def f():\n    " + source + "\n")
    found = imported_modules(path, "ckptstore.maintenance._example")
    assert any(layer_of(t) == "integrations" for t in found), found
