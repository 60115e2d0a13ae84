"""Opening the manifest: only writers create; readers refuse a wrong path and touch nothing.

And bad arguments through the API: a CkptStoreError subclass raised up front, never a driver
exception with SQL in it, never a failure that only shows up in the background save.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ckptstore import Run, open_run
from ckptstore.errors import (
    CheckpointNotFoundError,
    ComponentNotFoundError,
    ConfigError,
    ForeignDatabaseError,
    SchemaError,
)
from ckptstore.manifest import Database
from ckptstore.objectstore import LocalStore


def tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def test_a_reader_refuses_a_missing_database_and_creates_nothing(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"no manifest database at .*typo\.db"):
        Database(tmp_path / "typo.db", create=False)
    with pytest.raises(ConfigError, match="no manifest database"):
        Database(tmp_path / "nodir" / "sub" / "m.db", create=False)
    assert tree(tmp_path) == set()


def test_a_reader_refuses_an_empty_or_schemaless_database(tmp_path: Path) -> None:
    (tmp_path / "empty.db").write_bytes(b"")
    with pytest.raises(ConfigError, match="empty file"):
        Database(tmp_path / "empty.db", create=False)
    sqlite3.connect(tmp_path / "blank.db").execute("PRAGMA user_version = 1").connection.close()
    with pytest.raises(ConfigError, match="no ckptstore schema"):
        Database(tmp_path / "blank.db", create=False)
    assert tree(tmp_path) == {"empty.db", "blank.db"}


def test_an_empty_database_argument_is_refused_not_defaulted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    for value in ("", "   "):
        with pytest.raises(ConfigError, match="empty string"):
            Database(value)
    assert tree(tmp_path) == set()


def test_a_file_that_is_not_a_database_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("these are not the tables you are looking for\n" * 10)
    for create in (True, False):
        with pytest.raises(ConfigError, match="not a SQLite database"):
            Database(path, create=create)
    assert path.read_text().startswith("these are not")
    with pytest.raises(ConfigError, match="not a file"):
        Database(tmp_path, create=False)


def test_a_foreign_sqlite_file_is_refused_before_anything_touches_it(tmp_path: Path) -> None:
    path = tmp_path / "app.db"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT)")
    conn.execute("INSERT INTO users (name) VALUES ('ada')")
    conn.commit()
    conn.close()
    before = path.read_bytes()
    for create in (True, False):
        with pytest.raises(ForeignDatabaseError, match="no ckptstore schema version") as excinfo:
            Database(path, create=create)
        assert isinstance(excinfo.value, SchemaError | ConfigError)
    # Not switched to WAL (the header's version bytes stay 1), not changed at all, and no
    # lock or journal file was left beside it.
    assert path.read_bytes() == before
    assert before[18:20] == b"\x01\x01"
    assert tree(tmp_path) == {"app.db"}


def test_a_writer_creates_the_database_without_leaving_a_lock_file(tmp_path: Path) -> None:
    db = Database(tmp_path / "new" / "m.db")
    db.close()
    assert tree(tmp_path) == {"new", "new/m.db"}
    Database(tmp_path / "new" / "m.db", create=False).close()
    assert tree(tmp_path) == {"new", "new/m.db"}


def test_opening_a_run_read_only_creates_nothing(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no manifest database"):
        open_run("r", db=tmp_path / "m.db", store=tmp_path / "store", writable=False)
    assert tree(tmp_path) == set()


@pytest.fixture
def run_with_two_steps(db_url: str, store: LocalStore) -> Iterator[Run]:
    with open_run("api", db=db_url, store=store) as run:
        run.save(1, {"policy": {"w": torch.arange(4.0)}}).wait()
        run.save(2, {"policy": {"w": torch.arange(5.0)}}).wait()
        yield run


@pytest.mark.parametrize("step", [2**63, 2**70, -1, "3", 1.0, True])
def test_save_refuses_a_step_the_manifest_cannot_hold_up_front(
    run_with_two_steps: Run, step: object
) -> None:
    with pytest.raises(ConfigError, match="step"):
        run_with_two_steps.save(step, {"policy": {"w": torch.zeros(1)}})
    assert [c.step for c in run_with_two_steps.checkpoints()] == [1, 2]


@pytest.mark.parametrize("step", [2**70, 2**63, -5, "x", 2.0])
def test_load_refuses_a_bad_step_with_a_config_error(run_with_two_steps: Run, step: object) -> None:
    with pytest.raises(ConfigError, match="step"):
        run_with_two_steps.load(step)


def test_load_of_a_missing_step_or_component_names_it(run_with_two_steps: Run) -> None:
    with pytest.raises(CheckpointNotFoundError, match="step 7"):
        run_with_two_steps.load(7)
    with pytest.raises(ComponentNotFoundError, match="no component 'optim'") as excinfo:
        run_with_two_steps.load(components=["optim"])
    assert str(excinfo.value).startswith("run 'api'")  # not KeyError's quoted repr
    assert isinstance(excinfo.value, KeyError)


@pytest.mark.parametrize("name", ["with\x00nul", "a@b", "\x1b]0;pwned\x07", "", "x" * 256, " lead"])
def test_bad_run_names_are_refused_before_the_database_sees_them(
    db_url: str, store: LocalStore, name: str
) -> None:
    with pytest.raises(ConfigError, match="run name"):
        open_run(name, db=db_url, store=store)


@pytest.mark.parametrize("component", ["policy/", "../x", "a/../b", "", "x\x00"])
def test_bad_component_names_are_refused_at_save_time(
    run_with_two_steps: Run, component: str
) -> None:
    with pytest.raises(ConfigError, match="invalid component name"):
        run_with_two_steps.save(3, {component: {"w": torch.zeros(1)}})


@pytest.mark.parametrize("fork", ["base@x", "base@²", f"base@{2**63}", "base"])
def test_a_bad_fork_target_is_a_config_error(db_url: str, store: LocalStore, fork: str) -> None:
    with pytest.raises(ConfigError, match="fork_from"):
        open_run("child", db=db_url, store=store, fork_from=fork)


def test_a_bad_component_kind_is_refused_up_front(run_with_two_steps: Run) -> None:
    with pytest.raises(ConfigError, match="invalid component kind"):
        run_with_two_steps.save(3, {"policy": {"w": torch.zeros(1)}}, kinds={"policy": "x" * 40})
    assert [c.step for c in run_with_two_steps.checkpoints()] == [1, 2]


def test_a_second_open_in_one_process_keeps_the_first_ones_sqlite_locks(tmp_path: Path) -> None:
    """A trainer that holds a writer and a reader of one SQLite file, and another process that
    opens and closes it: that process must still see this one's connections (SQLite's POSIX
    locks). A raw read of the file by the second open used to drop them -- closing any
    descriptor of a file releases all of the process's locks on it -- so the other process,
    believing itself the last user, deleted the WAL under this one: stale reads there,
    "disk I/O error" here."""
    import subprocess
    import sys

    db = tmp_path / "m.db"
    writer = open_run("r", db=db, store=tmp_path / "store")
    reader = open_run("r", db=db, store=tmp_path / "store", writable=False)
    writer.save(1, {"x": torch.ones(2)}).wait()
    assert [c.step for c in reader.checkpoints()] == [1]
    other = (
        "import sys; from ckptstore import open_run; "
        "run = open_run('r', db=sys.argv[1], store=sys.argv[2], writable=False); "
        "print([c.step for c in run.checkpoints()]); run.close(); run.db.engine.dispose()"
    )
    seen = subprocess.run(
        [sys.executable, "-c", other, str(db), str(tmp_path / "store")],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert seen.stdout.strip() == "[1]"
    assert (tmp_path / "m.db-wal").exists(), "the other process deleted the WAL in use here"
    writer.save(2, {"x": torch.ones(2)}).wait()
    assert [c.step for c in reader.checkpoints()] == [1, 2]
    reader.close()
    writer.close()
