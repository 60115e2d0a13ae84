"""First contact: ``ckptstore --version``, ``python -m ckptstore``, the exit codes in ``--help``,
and package metadata that builds without deprecation warnings."""

from __future__ import annotations

import shutil
import subprocess
import sys
import warnings
from importlib.metadata import version
from pathlib import Path

import pytest

import ckptstore
from ckptstore.cli import main
from ckptstore.cli.exits import EXIT_ERROR, EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE, MEANINGS

ROOT = Path(__file__).resolve().parents[2]
INSTALLED = version("ckptstore")


def test_version_comes_from_the_package_metadata(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out == f"ckptstore {INSTALLED}\n"
    assert ckptstore.__version__ == INSTALLED
    assert "__version__" in dir(ckptstore)


def test_python_dash_m_runs_the_command(tmp_path: Path) -> None:
    """The module entry point: its version, and a real command's exit code and error line."""
    missing = tmp_path / "nowhere.db"
    runs = [
        subprocess.run(
            [sys.executable, "-m", "ckptstore", *argv],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            timeout=120,
            check=False,
        )
        for argv in (["--version"], ["--db", str(missing), "runs"])
    ]
    assert (runs[0].returncode, runs[0].stdout) == (0, f"ckptstore {INSTALLED}\n")
    assert runs[1].returncode == EXIT_USAGE
    assert runs[1].stderr.startswith("ckptstore: error: ")
    assert str(missing) in runs[1].stderr
    assert not missing.exists()


def test_help_documents_every_exit_code(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    shown = capsys.readouterr().out
    assert sorted(MEANINGS) == [EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE, EXIT_ERROR] == [0, 1, 2, 3]
    for code, meaning in MEANINGS.items():
        assert f"  {code}  {meaning}" in shown
    assert "unknown run" in MEANINGS[EXIT_ERROR]
    assert '{"error": {"type": ..., "message": ..., "exit_code": ...}}' in shown


def test_package_metadata_builds_without_a_license_warning(tmp_path: Path) -> None:
    """pyproject.toml as setuptools reads it for a wheel: an SPDX license expression, and no
    deprecation warning about the license (a TOML table there is deprecated)."""
    from setuptools import build_meta

    tree = tmp_path / "tree"
    tree.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, tree / name)
    for package in ("ckptstore", "migrations", "trainer"):
        shutil.copytree(ROOT / package, tree / package, ignore=shutil.ignore_patterns("*.so"))
    out = tmp_path / "metadata"
    out.mkdir()
    with warnings.catch_warnings(record=True) as caught, pytest.MonkeyPatch.context() as mp:
        warnings.simplefilter("always")
        mp.chdir(tree)
        dist_info = build_meta.prepare_metadata_for_build_wheel(str(out))
    license_warnings = [str(w.message) for w in caught if "license" in str(w.message).lower()]
    assert license_warnings == []
    metadata = (out / dist_info / "METADATA").read_text()
    assert "License-Expression: Apache-2.0" in metadata.splitlines()
