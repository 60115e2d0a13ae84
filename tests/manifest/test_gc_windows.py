"""GC walks the blob table in windows and acts in batches (issue 25), on SQLite and PostgreSQL.

- With windows of 7 rows over a manifest of ~100 blob rows, one pass condemns exactly the
  unprotected, unclaimed blobs, sweeps exactly those condemned before the grace, and deletes
  exactly the old orphan objects; a dry run counts the same without changing anything.
- A condemned blob that a committed checkpoint still references (verify condemns a damaged one)
  survives the sweep, whose only protection check is the one under the lock.
- :class:`Pace` hands out every item once, in order, however the batch size changes between
  batches, and sizes batches toward its target lock time within its bounds.
- A GC with nothing to do takes no lock that commits wait for: on PostgreSQL it finishes
  while a commit's transaction holds the GC lock shared.
"""

from __future__ import annotations

import datetime as dt
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import create_engine, insert, select, text, update

from ckptstore.cas.digest import blob_key
from ckptstore.maintenance import gc
from ckptstore.maintenance.gc import Pace, collect_garbage
from ckptstore.manifest import Database
from ckptstore.manifest.models import (
    BlobRow,
    BlobState,
    CheckpointBlobRow,
    CheckpointRow,
    RunRow,
    Status,
    utcnow,
)
from ckptstore.objectstore import LocalStore

HOUR = dt.timedelta(hours=1)
DAY = dt.timedelta(days=1)

COMMITTED = range(40)  # referenced by a committed checkpoint
DELETED = range(40, 70)  # referenced only by a deleted checkpoint
LOOSE = range(70, 80)  # referenced by nothing
CONDEMNED = range(80, 90)  # condemned a day ago, referenced by nothing
ORPHANS = range(1000, 1030)  # objects without a row


def digest(i: int) -> str:
    return f"b3:{(i * 2654435761) % 2**64:064x}"  # spread over the digest order


@pytest.fixture
def db(db_url: str) -> Iterator[Database]:
    database = Database(db_url)
    yield database
    database.close()


@pytest.fixture
def small_windows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gc, "_WINDOW", 7)


def populate(db: Database, store: LocalStore) -> None:
    """The rows and objects of the module docstring, everything last claimed a day ago."""
    long_ago = utcnow() - DAY

    def transaction(session: Any) -> None:
        run = RunRow(name="windows", writer_epoch=1, higher_is_better=True)
        session.add(run)
        session.flush()
        ids = {}
        for step, status in ((1, Status.DELETED), (2, Status.COMMITTED)):
            row = CheckpointRow(
                run_id=run.id, step=step, writer_epoch=1, trigger="manual", status=status
            )
            session.add(row)
            session.flush()
            ids[status] = row.id
        session.execute(
            insert(BlobRow.__table__),
            [
                {
                    "digest": digest(i),
                    "kind": "chunk",
                    "logical_bytes": i,
                    "stored_bytes": i,
                    "codec": "raw",
                    "created_at": long_ago,
                    "last_claimed_at": long_ago,
                    "state": BlobState.CONDEMNED if i in CONDEMNED else BlobState.LIVE,
                    "condemned_at": long_ago if i in CONDEMNED else None,
                }
                for i in range(90)
            ],
        )
        refs = [(ids[Status.COMMITTED], i) for i in COMMITTED]
        refs += [(ids[Status.DELETED], i) for i in DELETED]
        session.execute(
            insert(CheckpointBlobRow.__table__),
            [{"checkpoint_id": c, "digest": digest(i)} for c, i in refs],
        )

    db.write(transaction)
    old = time.time() - DAY.total_seconds()
    for i in [*range(90), *ORPHANS]:
        store.put(blob_key(digest(i)), b"x" * (i % 7 + 1))
        os.utime(store.root / blob_key(digest(i)), (old, old))


def rows(db: Database) -> dict[str, str]:
    with db.read() as session:
        return dict(session.execute(select(BlobRow.digest, BlobRow.state)).all())


def objects(store: LocalStore) -> set[str]:
    return {info.key for info in store.list("cas/")}


def keys(*ranges: range) -> set[str]:
    return {blob_key(digest(i)) for r in ranges for i in r}


def test_a_pass_in_small_windows_condemns_sweeps_and_deletes_exactly(
    db: Database, store: LocalStore, small_windows: None
) -> None:
    populate(db, store)
    before = (rows(db), objects(store))

    dry = collect_garbage(db, store, grace=HOUR, dry_run=True)
    assert (rows(db), objects(store)) == before
    assert (dry.condemned, dry.swept, dry.orphans) == (40, 10, 30)

    report = collect_garbage(db, store, grace=HOUR)
    assert (report.condemned, report.swept, report.orphans) == (40, 10, 30)
    assert report.condemned_bytes == sum(i for r in (DELETED, LOOSE) for i in r)
    assert report.swept_bytes == sum(CONDEMNED)
    assert report.orphan_bytes == sum(i % 7 + 1 for i in ORPHANS)
    assert set(report.seconds) == {"mark", "sweep", "orphans", "incomplete"}
    states = rows(db)
    assert {d for d, s in states.items() if s == BlobState.LIVE} == {digest(i) for i in COMMITTED}
    assert {d for d, s in states.items() if s == BlobState.CONDEMNED} == {
        digest(i) for r in (DELETED, LOOSE) for i in r
    }
    assert objects(store) == keys(COMMITTED, DELETED, LOOSE)

    # Condemned just now: swept only once the grace has passed (here: grace 0).
    final = collect_garbage(db, store, grace=dt.timedelta(0))
    assert (final.condemned, final.swept, final.orphans) == (0, 40, 0)
    assert set(rows(db)) == {digest(i) for i in COMMITTED}
    assert objects(store) == keys(COMMITTED)


def test_a_condemned_blob_a_checkpoint_still_references_is_never_swept(
    db: Database, store: LocalStore, small_windows: None
) -> None:
    """A blob can be condemned while a committed checkpoint references it: verify takes a
    damaged blob out of service that way (the next save uploads it again). The sweep reads its
    candidates without the protection check and checks protection once, under the lock: such
    a blob is neither counted by a dry run nor deleted, row or object."""
    populate(db, store)
    damaged = [digest(i) for i in COMMITTED[:5]]
    long_ago = utcnow() - DAY

    def condemn(session: Any) -> None:
        session.execute(
            update(BlobRow)
            .where(BlobRow.digest.in_(damaged))
            .values(state=BlobState.CONDEMNED, condemned_at=long_ago)
        )

    db.write(condemn)
    dry = collect_garbage(db, store, grace=HOUR, dry_run=True)
    assert (dry.swept, dry.swept_bytes) == (len(CONDEMNED), sum(CONDEMNED))
    report = collect_garbage(db, store, grace=HOUR)
    assert (report.swept, report.swept_bytes) == (len(CONDEMNED), sum(CONDEMNED))
    states = rows(db)
    assert {d: states.get(d) for d in damaged} == dict.fromkeys(damaged, BlobState.CONDEMNED)
    assert keys(COMMITTED) <= objects(store)
    assert not keys(CONDEMNED) & objects(store)


def test_pace_hands_out_every_item_once_while_its_size_changes() -> None:
    pace = Pace(size=4, most=64, target=0.1, least=2)
    items = list(range(100))
    seen: list[int] = []
    sizes = []
    for n, batch in enumerate(pace.batches(items)):
        seen.extend(batch)
        sizes.append(len(batch))
        pace.took(0.01 if n % 3 else 1.0, len(batch))  # fast, fast, slow, ...
    assert seen == items
    assert len(set(sizes)) > 2  # it really changed size on the way


def test_pace_aims_at_its_target_within_its_bounds() -> None:
    pace = Pace(size=1000, most=4000, target=0.25, least=16)
    pace.took(1.0, 1000)  # four times too slow: halves (never more at once)
    assert pace.size == 500
    pace.took(0.0625, 500)  # four times as fast as wanted: doubles (never more at once)
    assert pace.size == 1000
    for _ in range(5):
        pace.took(0.001, pace.size)
    assert pace.size == 4000  # never past its most
    for _ in range(20):
        pace.took(30.0, pace.size)
    assert pace.size == 16  # nor under its least
    pace.took(0.0, 3)  # a short last batch says nothing
    assert pace.size == 16


def test_a_gc_with_nothing_to_do_does_not_wait_for_commits(
    pg_schema_url: str, store: LocalStore
) -> None:
    db = Database(pg_schema_url)
    populate(db, store)
    collect_garbage(db, store, grace=dt.timedelta(0))  # everything unprotected is gone
    holder = create_engine(pg_schema_url)
    done = threading.Event()
    try:
        with holder.connect() as conn:
            # What a commit holds for its whole transaction.
            conn.execute(text("LOCK TABLE gc_lease IN ROW SHARE MODE"))
            worker = threading.Thread(
                target=lambda: (collect_garbage(db, store, grace=dt.timedelta(0)), done.set())
            )
            worker.start()
            finished = done.wait(30)
            conn.rollback()
            worker.join(30)
        assert finished, "a GC with nothing to do waited for a commit's lock"
    finally:
        holder.dispose()
        db.close()
