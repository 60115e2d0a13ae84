"""``ckptstore gc``: grace, dry runs, the lease, and the blobs of corrupt checkpoints kept until
released. The collector itself is tested in tests/maintenance/test_gc.py, which holds the name
``test_gc`` (test modules here are top-level modules: their names must differ).
"""

from __future__ import annotations

import json
import re

import pytest
from damaged import corrupt_shared_chunk
from populated import (
    Populated,
    assert_components,
    assert_one_line_error,
    cli,
    cli_json,
    committed_references,
)
from sqlalchemy import func, select

from ckptstore.checkpointer import open_run
from ckptstore.cli import main
from ckptstore.maintenance.gc import gc_lease
from ckptstore.manifest import Database
from ckptstore.manifest.models import BlobRow
from ckptstore.objectstore import LocalStore


def test_gc_command(populated: Populated, capsys: pytest.CaptureFixture[str]) -> None:
    db = Database(populated.db_url)
    try:
        with db.read() as session:
            rows_before = session.scalar(select(func.count()).select_from(BlobRow))
        needed = committed_references(db)
        garbage = rows_before - len(needed)
        assert garbage > 0  # the deleted checkpoints' own blobs

        # The default grace (6 h) keeps everything this young.
        dry = cli_json(populated, capsys, "gc", "--dry-run")
        assert (dry["dry_run"], dry["condemned"], dry["swept"], dry["orphans"]) == (True, 0, 0, 0)
        dry = cli_json(populated, capsys, "gc", "--dry-run", "--grace", "0s")
        assert (dry["condemned"], dry["orphans"]) == (garbage, 0)
        assert dry["condemned_bytes"] > 0
        with db.read() as session:
            assert session.scalar(select(func.count()).select_from(BlobRow)) == rows_before

        with gc_lease(db, holder="someone-else"):
            code, out, err = cli(populated, capsys, "gc", "--grace", "0")
            assert (code, out) == (3, "")
            assert_one_line_error(err, "someone-else")

        code, out, err = cli(populated, capsys, "gc", "--grace", "0m")
        assert (code, err) == (0, "")
        assert re.search(rf"condemn\s+{garbage} blobs", out)
        assert re.search(rf"delete\s+{garbage} blobs", out)
        with db.read() as session:
            assert set(session.scalars(select(BlobRow.digest))) == needed
        assert cli_json(populated, capsys, "gc", "--grace", "0")["swept"] == 0
    finally:
        db.close()
    assert cli(populated, capsys, "verify")[0] == 0
    for (name, step), state in populated.states.items():
        if (name, step) in populated.committed():
            with open_run(name, db=populated.db_url, store=populated.root, writable=False) as run:
                assert_components(run.load(step=step).state, state)


KEPT_LINE = re.compile(
    r"^  kept +(\d+) blobs  .+  for 2 corrupt checkpoint\(s\) \(repairable; "
    r"`ckptstore verify --recheck`, or --release-corrupt to let them go\)$",
    re.M,
)


def test_gc_keeps_corrupt_checkpoints_blobs_until_released(
    db_url: str, store: LocalStore, capsys: pytest.CaptureFixture[str]
) -> None:
    corrupt_shared_chunk(db_url, store)
    base = ["--db", db_url, "--store", str(store.root)]
    objects = {i.key for i in store.list("cas/")}

    # Dry run or not, no grace at all: the corrupt checkpoints' blobs stay, and gc says why.
    for dry_run in (["--dry-run"], []):
        capsys.readouterr()
        assert main([*base, "gc", "--grace", "0", *dry_run]) == 0
        out = capsys.readouterr().out
        kept = KEPT_LINE.search(out)
        assert kept is not None, out
        assert int(kept.group(1)) > 0
        assert re.search(r"delete\s+0 blobs", out)
    assert {i.key for i in store.list("cas/")} == objects
    capsys.readouterr()
    assert main([*base, "--json", "gc", "--grace", "0", "--dry-run"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["corrupt_checkpoints"], report["release_corrupt"]) == (2, False)
    assert report["kept_for_corrupt"] == int(kept.group(1))
    assert report["kept_for_corrupt_bytes"] > 0

    # Given up on: --release-corrupt lets them go (a dry run first counts them).
    assert main([*base, "--json", "gc", "--grace", "0", "--dry-run", "--release-corrupt"]) == 0
    dry = json.loads(capsys.readouterr().out)
    assert dry["release_corrupt"] is True
    assert dry["condemned"] > 0
    assert {i.key for i in store.list("cas/")} == objects
    assert main([*base, "gc", "--grace", "0", "--release-corrupt"]) == 0
    out = capsys.readouterr().out
    assert not KEPT_LINE.search(out)
    assert "released" in out
    assert not any(store.list("cas/")), "released blobs are deleted"
