"""A commit of many rank receipts (issue 25), on SQLite and PostgreSQL: set-based statements that
still claim every reused blob row, revive condemned ones, and insert every new one.

- One commit of 3,000 claims (a third new, a third live and last claimed a day ago, a third
  condemned) and 1,000 components: every row is then live and claimed by this commit, every
  blob is referenced once, and the revived ones are reported.
- The number of statements a commit runs does not grow with its receipts (10 against 3,000):
  the set-based statements of ``manifest/_sql/sets.py`` bind each set as one parameter.
- The sets themselves: strings with commas, quotes and non-ASCII letters, NULLs and 64-bit
  integers survive the trip; strings that would break the PostgreSQL encoding are refused.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import BigInteger, String, column, event, insert, select, table, update

from ckptstore.manifest import Database
from ckptstore.manifest import committing as tx
from ckptstore.manifest._sql.sets import among, select_rows
from ckptstore.manifest.models import (
    BlobRow,
    BlobState,
    CheckpointBlobRow,
    ComponentRow,
    RunRow,
    utcnow,
)
from ckptstore.manifest.records import BlobClaim, ComponentInfo

DAY = dt.timedelta(days=1)


@pytest.fixture
def db(db_url: str) -> Iterator[Database]:
    database = Database(db_url)
    yield database
    database.close()


def digest(i: int) -> str:
    return f"b3:{i:064x}"


def claim(i: int, *, uploaded: bool = False) -> BlobClaim:
    return BlobClaim(digest(i), "chunk", 1000 + i, 500 + i, "zstd" if i % 2 else None, uploaded)


def new_run(db: Database, name: str = "run") -> tuple[int, int]:
    """A run row with writer epoch 1: (run id, epoch)."""

    def transaction(session: Any) -> int:
        row = RunRow(name=name, writer_epoch=1, higher_is_better=True)
        session.add(row)
        session.flush()
        return int(row.id)

    return db.write(transaction), 1


def existing_blobs(db: Database, ids: range, state: BlobState, claimed: dt.datetime) -> None:
    """Blob rows for ``ids`` in ``state``, last claimed at ``claimed``."""
    rows = [
        {
            "digest": digest(i),
            "kind": "chunk",
            "logical_bytes": 1000 + i,
            "stored_bytes": 7,  # what the row says wins over the claim's size
            "codec": "raw",
            "created_at": claimed,
            "last_claimed_at": claimed,
            "state": state,
            "condemned_at": claimed if state == BlobState.CONDEMNED else None,
        }
        for i in ids
    ]
    db.write(lambda s: s.execute(insert(BlobRow.__table__), rows))


def commit(
    db: Database, run: tuple[int, int], step: int, claims: list[BlobClaim], components: int
) -> tuple[int, list[str], list[list[str]]]:
    """Commit ``claims`` and ``components`` component rows; (checkpoint id, revived digests,
    the objects checked). Every object "exists" with size 11."""
    run_id, epoch = run
    checkpoint_id = tx.begin_checkpoint(db, run_id, step, epoch, "manual")
    checked: list[list[str]] = []

    def check_objects(digests: Any) -> dict[str, int | None]:
        checked.append(list(digests))
        return dict.fromkeys(digests, 11)

    revived = tx.commit_checkpoint(
        db,
        run_id=run_id,
        epoch=epoch,
        checkpoint_id=checkpoint_id,
        step=step,
        claims={c.digest: c for c in claims},
        components=[
            ComponentInfo(f"policy/rank-{r:05d},x", "state", claims[r].digest, r, r, 1)
            for r in range(components)
        ],
        values=lambda stored: {"stored_bytes": stored, "logical_bytes": 0, "uploaded_bytes": 0},
        check_objects=check_objects,
    )
    return checkpoint_id, revived, checked


def test_a_commit_of_many_receipts_claims_every_row(db: Database) -> None:
    run = new_run(db)
    long_ago = utcnow() - DAY
    existing_blobs(db, range(1000, 2000), BlobState.LIVE, long_ago)
    existing_blobs(db, range(2000, 3000), BlobState.CONDEMNED, long_ago)
    claims = [claim(i, uploaded=i < 1000) for i in range(3000)]
    before = utcnow()

    checkpoint_id, revived, checked = commit(db, run, 1, claims, components=1000)

    assert sorted(revived) == [digest(i) for i in range(2000, 3000)]
    # The store is asked about every blob that was not a live row, in one call.
    assert len(checked) == 1
    assert sorted(checked[0]) == sorted([digest(i) for i in range(1000)] + revived)
    with db.read() as session:
        rows = {
            r.digest: r
            for r in session.execute(
                select(
                    BlobRow.digest,
                    BlobRow.state,
                    BlobRow.last_claimed_at,
                    BlobRow.stored_bytes,
                    BlobRow.codec,
                )
            )
        }
        refs = list(
            session.scalars(
                select(CheckpointBlobRow.digest).where(
                    CheckpointBlobRow.checkpoint_id == checkpoint_id
                )
            )
        )
        components = list(
            session.execute(
                select(ComponentRow.name, ComponentRow.index_digest).where(
                    ComponentRow.checkpoint_id == checkpoint_id
                )
            )
        )
    assert len(rows) == 3000
    assert {r.state for r in rows.values()} == {BlobState.LIVE}
    claimed_at = {_utc(r.last_claimed_at) for r in rows.values()}
    assert len(claimed_at) == 1
    assert claimed_at.pop() >= before - dt.timedelta(seconds=1)
    # New rows take the claim's values (NULL codecs included); reused rows keep theirs.
    assert (rows[digest(0)].stored_bytes, rows[digest(0)].codec) == (500, None)
    assert (rows[digest(1)].stored_bytes, rows[digest(1)].codec) == (501, "zstd")
    assert rows[digest(1500)].stored_bytes == rows[digest(2500)].stored_bytes == 7
    assert sorted(refs) == sorted(c.digest for c in claims)
    assert sorted(components) == sorted((f"policy/rank-{r:05d},x", digest(r)) for r in range(1000))


def test_the_statements_of_a_commit_do_not_grow_with_its_receipts(db: Database) -> None:
    run = new_run(db)
    statements: list[str] = []

    @event.listens_for(db.engine, "before_cursor_execute")
    def count(*args: Any) -> None:
        statements.append(args[2])

    counts = []
    for step, size in ((1, 10), (2, 3000)):
        first = 10_000 * step
        existing_blobs(db, range(first, first + size // 2), BlobState.LIVE, utcnow() - DAY)
        statements.clear()
        commit(db, run, step, [claim(first + i) for i in range(size)], components=size)
        counts.append(len(statements))
    event.remove(db.engine, "before_cursor_execute", count)
    assert counts[0] == counts[1], statements


def test_a_concurrently_condemned_row_is_revived_by_the_commit_that_claims_it(
    db: Database,
) -> None:
    """A row condemned after the save decided to reuse it: the commit checks its object and
    brings it back, claimed."""
    run = new_run(db)
    existing_blobs(db, range(5), BlobState.LIVE, utcnow() - DAY)
    db.write(
        lambda s: s.execute(
            update(BlobRow)
            .where(BlobRow.digest == digest(3))
            .values(state=BlobState.CONDEMNED, condemned_at=utcnow())
        )
    )
    _, revived, checked = commit(db, run, 1, [claim(i) for i in range(5)], components=1)
    assert revived == [digest(3)]
    assert checked == [[digest(3)]]
    with db.read() as session:
        states = set(session.scalars(select(BlobRow.state)))
    assert states == {BlobState.LIVE}


def _utc(value: dt.datetime) -> dt.datetime:
    return value if value.tzinfo else value.replace(tzinfo=dt.UTC)


# -- the sets ------------------------------------------------------------------------------------

STRINGS = ["plain", "a,b", 'quote"s', "{brace}", "naïve/ünïcode", "back\\slash", " spaced "]


def test_sets_of_strings_integers_and_nulls_survive_the_trip(db: Database) -> None:
    dialect = db.engine.dialect.name
    scratch = table("scratch", column("name"), column("size"), column("note"))
    with db.engine.begin() as conn:
        conn.exec_driver_sql(
            "CREATE TABLE scratch (name VARCHAR(40) PRIMARY KEY, size BIGINT, note VARCHAR(9))"
        )
        sizes = [2**62, -1, 0, None, 7, 8, 9]
        notes = [None, "x", None, "y", "z", None, "w"]
        rows = select_rows(
            {"name": (String, STRINGS), "size": (BigInteger, sizes), "note": (String, notes)},
            dialect,
        )
        conn.execute(insert(scratch).from_select(["name", "size", "note"], rows))
        found = conn.execute(
            select(scratch.c.name, scratch.c.size, scratch.c.note).where(
                among(scratch.c.name, [*STRINGS[::2], "absent"], dialect)
            )
        ).all()
        assert sorted(found, key=lambda r: r[0]) == sorted(
            [(n, s, t) for n, s, t in zip(STRINGS, sizes, notes, strict=True)][::2],
            key=lambda r: r[0],
        )
        none = select(scratch.c.name).where(among(scratch.c.name, [], dialect))
        assert conn.execute(none).all() == []
        conn.exec_driver_sql("DROP TABLE scratch")


@pytest.mark.parametrize("bad", ["", "unit\x1fseparator", "\x1e"])
def test_postgresql_sets_refuse_strings_they_cannot_carry(bad: str) -> None:
    with pytest.raises(ValueError, match="control characters"):
        among(column("name"), ["fine", bad], "postgresql")
