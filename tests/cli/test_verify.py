"""``ckptstore verify [RUN[@STEP]]`` and :func:`ckptstore.maintenance.verify` behind it: damage
found, reported, marked corrupt and quarantined; sampling; ``--recheck`` after a repair. (Its exit
status as a gate: test_verify_status.py.)
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from damaged import corrupt_shared_chunk, damage, shared_statuses, verify_state
from populated import OPTIONS, Populated, assert_components, cli, cli_json, committed_references
from sqlalchemy import select

from ckptstore.checkpointer import open_run
from ckptstore.cli import main
from ckptstore.maintenance import verify
from ckptstore.manifest import Database
from ckptstore.manifest.models import BlobRow, BlobState
from ckptstore.objectstore import LocalStore


def test_verify_a_healthy_store(populated: Populated, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = cli(populated, capsys, "verify")
    assert (code, err) == (0, "")
    assert out.strip().endswith(": OK")
    assert f"verified {len(populated.committed())} checkpoint(s)" in out

    db = Database(populated.db_url)
    try:
        distinct = committed_references(db)
    finally:
        db.close()
    report = cli_json(populated, capsys, "verify")
    assert (report["checkpoints"], report["blobs_checked"]) == (5, len(distinct))
    assert (report["problems"], report["corrupt_checkpoints"]) == ([], [])

    report = cli_json(populated, capsys, "verify", "beta")
    assert report["checkpoints"] == 2
    report = cli_json(populated, capsys, "verify", "alpha@4", "--sample", "3")
    assert (report["checkpoints"], report["blobs_checked"]) == (1, 3)
    report = cli_json(populated, capsys, "verify", "alpha@4", "--sample", "1000")
    assert report["blobs_checked"] > 3  # a sample larger than the checkpoint checks it all


@pytest.fixture
def db(db_url: str) -> Iterator[Database]:
    """The manifest database of ``db_url``, opened for the test."""
    database = Database(db_url)
    yield database
    database.close()


def test_verify_finds_damage_marks_corrupt_and_quarantines(db: Database, store: LocalStore) -> None:
    with open_run("vrun", db=db, store=store, writer_options=OPTIONS, async_save=False) as run:
        run.save(1, verify_state(1))
        run.save(2, verify_state(2))
        damaged = damage(store)
        expected = {
            ("vrun", 2, component, f"{store.url}/{key}", kind)
            for component, (key, kind) in damaged.items()
        }
        digests = {"b3:" + key.rsplit("/", 1)[1] for key, _ in damaged.values()}

        def snapshot() -> tuple[Any, ...]:
            with db.read() as session:
                blobs = {b.digest: b.state for b in session.scalars(select(BlobRow))}
            listing = {i.key: i.size for i in store.list("")}
            return [(c.step, c.status) for c in run.checkpoints()], blobs, listing

        # Report only: nothing changes.
        before = snapshot()
        report = verify(db, store, mark_corrupt=False)
        found = {(p.run, p.step, p.component, p.key, p.kind) for p in report.problems}
        assert found == expected
        assert all(p.detail for p in report.problems)
        assert report.corrupt_checkpoints == [("vrun", 2)]
        assert report.checkpoints == 2
        assert snapshot() == before

        # Marking: the checkpoint is corrupt, the damaged blobs condemned and moved aside.
        report = verify(db, store)
        assert {(p.run, p.step, p.component, p.key, p.kind) for p in report.problems} == expected
        rows = run.checkpoints()
        assert [(c.step, c.status) for c in rows] == [(1, "committed"), (2, "corrupt")]
        assert rows[1].error is not None
        assert "verify" in rows[1].error
        with db.read() as session:
            query = select(BlobRow.digest, BlobRow.state).where(BlobRow.digest.in_(digests))
            states = dict(session.execute(query).all())
        assert states == dict.fromkeys(digests, BlobState.CONDEMNED)
        keys = {i.key for i in store.list("")}
        assert not keys & {key for key, _ in damaged.values()}
        assert len([k for k in keys if k.startswith("quarantine/")]) == 2  # the missing one: none

        # Only step 1 is left to check, and it is intact.
        again = verify(db, store)
        assert (again.checkpoints, again.problems) == (1, [])

        # Resume falls back to step 1 (already marked: no need to skip anything).
        loaded = run.load()
        assert (loaded.info.step, loaded.skipped) == (1, ())
        assert_components(loaded.state, verify_state(1))

        # Redoing step 2 stores good bytes again under the same keys: bit-exact.
        info = run.save(3, verify_state(2)).wait()
        assert info.uploaded_bytes > 0
        keys = {i.key for i in store.list("cas/")}
        assert {key for key, _ in damaged.values()} <= keys
        loaded = run.load()
        assert (loaded.info.step, loaded.skipped) == (3, ())
        assert_components(loaded.state, verify_state(2))
        # The good bytes repaired step 2 as well: it is committed again, and verified.
        assert [(c.step, c.status) for c in run.checkpoints()] == [
            (1, "committed"),
            (2, "committed"),
            (3, "committed"),
        ]
        final = verify(db, store)
        assert (final.checkpoints, final.problems) == (3, [])


def test_verify_sample_checks_at_most_n_blobs_per_checkpoint(
    db: Database, store: LocalStore
) -> None:
    with open_run("sample", db=db, store=store, writer_options=OPTIONS) as run:
        for step in (1, 2, 3):
            run.save(step, verify_state(step)).wait()
        whole = verify(db, store, run="sample", step=2)
        assert whole.blobs_checked >= 5
        for n in (1, 2, whole.blobs_checked - 1):
            report = verify(db, store, run="sample", step=2, sample=n)
            assert (report.checkpoints, report.blobs_checked) == (1, n)
        report = verify(db, store, sample=2)
        assert report.checkpoints == 3
        assert report.blobs_checked <= 3 * 2
        # A damaged blob is found when it is sampled.
        damage(store)
        report = verify(db, store, run="sample", step=2, sample=whole.blobs_checked)
        assert len(report.problems) == 3
        assert [(c.step, c.status) for c in run.checkpoints()] == [
            (1, "committed"),
            (2, "corrupt"),
            (3, "committed"),
        ]


def test_verify_command_on_a_damaged_store(
    db_url: str, store: LocalStore, capsys: pytest.CaptureFixture[str]
) -> None:
    with open_run("vrun", db=db_url, store=store, writer_options=OPTIONS) as run:
        run.save(1, verify_state(1)).wait()
        run.save(2, verify_state(2)).wait()
    damaged = damage(store)
    base = ["--db", db_url, "--store", str(store.root)]

    capsys.readouterr()
    code = main([*base, "verify", "--no-mark"])
    out, _ = capsys.readouterr()
    assert code == 1
    for component, (key, kind) in damaged.items():
        line = f"{kind.upper()}: run 'vrun' step 2 component {component!r}: {store.url}/{key}"
        assert line in out
    assert "3 problem(s) in 1 checkpoint(s)" in out

    code = main([*base, "--json", "verify"])
    report = json.loads(capsys.readouterr().out)
    assert code == 1
    assert {(p["component"], p["kind"]) for p in report["problems"]} == {
        (c, kind) for c, (_, kind) in damaged.items()
    }
    assert report["corrupt_checkpoints"] == [{"run": "vrun", "step": 2}]
    with open_run("vrun", db=db_url, store=store, writable=False) as run:
        assert [(c.step, c.status) for c in run.checkpoints()] == [
            (1, "committed"),
            (2, "corrupt"),
        ]


@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
def test_verify_recheck_commits_restored_checkpoints_again(
    db_url: str, store: LocalStore, capsys: pytest.CaptureFixture[str], as_json: bool
) -> None:
    key, good = corrupt_shared_chunk(db_url, store)
    base = ["--db", db_url, "--store", str(store.root), *(["--json"] if as_json else [])]

    # Nothing put back yet: the recheck finds the chunk missing (quarantined) and repairs none.
    capsys.readouterr()
    assert main([*base, "verify", "--recheck"]) == 1
    out = capsys.readouterr().out
    assert "REPAIRED" not in out
    assert shared_statuses(db_url, store) == {1: "corrupt", 2: "corrupt"}

    # An operator restores the object; report-only recheck changes nothing, so both are still
    # marked corrupt: still exit 1.
    store.put(key, good)
    assert main([*base, "verify", "--recheck", "--no-mark"]) == 1
    out = capsys.readouterr().out
    if as_json:
        still = [(c["run"], c["step"]) for c in json.loads(out)["still_corrupt"]]
        assert still == [("shared", 1), ("shared", 2)]
    else:
        assert "2 checkpoint(s) still marked corrupt" in out
    assert shared_statuses(db_url, store) == {1: "corrupt", 2: "corrupt"}

    assert main([*base, "verify", "--recheck"]) == 0
    out = capsys.readouterr().out
    if as_json:
        report = json.loads(out)
        assert report["repaired"] == [{"run": "shared", "step": 1}, {"run": "shared", "step": 2}]
        assert (report["problems"], report["corrupt_checkpoints"]) == ([], [])
    else:
        assert out.splitlines()[:2] == [
            "REPAIRED: run 'shared' step 1 is committed again",
            "REPAIRED: run 'shared' step 2 is committed again",
        ]
        assert out.strip().endswith(": OK")
    assert shared_statuses(db_url, store) == {1: "committed", 2: "committed"}
    capsys.readouterr()
    assert main([*base, "verify"]) == 0
