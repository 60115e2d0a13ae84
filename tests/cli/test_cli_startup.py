"""The CLI's read commands start without the heavy imports: a command that only reads the
manifest database loads neither torch nor numpy (nor boto3, zstandard or, but for ``db``,
Alembic), so ``ckptstore latest RUN`` costs an interpreter and SQLAlchemy, not a deep-learning
framework. Only the invoked command's module is imported, and the lookups and reports of
``latest``, ``show``, ``runs``, ``ls`` and ``du`` run on SQLAlchemy Core without the ORM (nor
the models)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckptstore.checkpointer import open_run
from ckptstore.cli import commands
from ckptstore.cli.main import build_parser

HEAVY = ("torch", "numpy", "boto3", "alembic", "zstandard")

# Runs the command in a fresh interpreter and reports its exit code, output and what it loaded.
PROBE = """
import contextlib, io, json, sys
from ckptstore.cli.main import main
out = io.StringIO()
with contextlib.redirect_stdout(out):
    code = main(sys.argv[1:])
heavy = [m for m in {heavy!r} if m in sys.modules]
commands = [m for m in sys.modules if m.startswith("ckptstore.cli.commands.")]
orm = [m for m in ("sqlalchemy.orm", "ckptstore.manifest.models") if m in sys.modules]
print(json.dumps({{"code": code, "out": out.getvalue(), "heavy": heavy, "commands": commands,
                  "orm": orm}}))
"""


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("startup")
    db, store = str(root / "manifest.db"), str(root / "store")
    with open_run("r", db=db, store=store, async_save=False) as run:
        run.save(1, {"model": {"w": torch.ones(4)}}, metrics={"loss": 1.0})
        run.save(2, {"model": {"w": torch.zeros(4)}}, metrics={"loss": 0.5})
    return db, store


@pytest.mark.parametrize(
    "command",
    [
        ["latest", "r"],
        ["runs"],
        ["ls", "r"],
        ["show", "r@2"],
        ["show", "r", "--json"],
        ["sql", "SELECT step FROM checkpoints ORDER BY step"],
        ["du"],
        ["db", "current"],
    ],
)
def test_read_commands_import_neither_torch_nor_numpy(
    saved: tuple[str, str], tmp_path: Path, command: list[str]
) -> None:
    db, store = saved
    probe = PROBE.format(heavy=HEAVY)
    done = subprocess.run(
        [sys.executable, "-c", probe, "--db", db, "--store", store, *command],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["code"] == 0, report
    assert report["out"].strip(), "the command printed nothing"
    # `db` reads the packaged migrations, which is Alembic's job.
    allowed = {"alembic"} if command[0] == "db" else set()
    assert set(report["heavy"]) <= allowed, f"{command[0]} imported {report['heavy']}"
    assert report["commands"] == [f"ckptstore.cli.commands.{command[0]}"]
    if command[0] != "db":  # Alembic's environment declares the models
        assert not report["orm"], f"{command[0]} imported {report['orm']}"
    if command == ["latest", "r"]:
        assert report["out"].strip() == "2"


def test_the_probe_would_see_a_heavy_import(saved: tuple[str, str], tmp_path: Path) -> None:
    # verify reads blobs, so it loads numpy and torch: the probe notices.
    db, store = saved
    done = subprocess.run(
        [sys.executable, "-c", PROBE.format(heavy=HEAVY), "--db", db, "--store", store, "verify"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=tmp_path,
    )
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["code"] == 0, report
    assert "numpy" in report["heavy"]
    assert report["orm"] == ["sqlalchemy.orm", "ckptstore.manifest.models"]


def test_every_command_module_has_its_line_in_commands(capsys: pytest.CaptureFixture[str]) -> None:
    # A command is found by its name in COMMANDS before its module is imported: a module
    # missing there could never run, and one that registered another name would not parse.
    # A keyword's module ends in "_" (import_.py holds "import").
    stems = {p.stem for p in Path(commands.__file__).parent.glob("*.py")} - {"__init__"}
    modules = {stem.removesuffix("_") for stem in stems}
    assert set(commands.COMMANDS) == modules
    for name in commands.COMMANDS:
        with pytest.raises(SystemExit) as exited:
            build_parser(name).parse_args([name, "--help"])
        assert exited.value.code == 0
        assert capsys.readouterr().out.startswith(f"usage: ckptstore {name} ")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    listing = " ".join(capsys.readouterr().out.split())  # argparse wraps long lines
    for name, line in commands.COMMANDS.items():
        assert f" {name} {line} " in listing
