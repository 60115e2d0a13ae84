"""SQLite: blobs and checkpoint_blobs stored in key order (WITHOUT ROWID)

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-04

A SQLite table keeps its rows in rowid order -- for ``blobs``, the order they were inserted --
and its primary key in a separate index. Digests are random, so every blob row that garbage
collection reads (a window of 10^4 consecutive digests) or deletes (a batch of them) is a
lookup in the key's index and then a different, random page of the table: at 10^6 rows that
page is seldom in the cache, and each batch's deletes rewrite pages all over the file. As a
``WITHOUT ROWID`` table the rows themselves are the key's B-tree, in digest order: a window's
rows are neighbours, a batch's deletes touch neighbouring pages, and there is one B-tree less
to keep. ``checkpoint_blobs`` (a checkpoint id and a digest, nothing else) is stored the same
way, by (checkpoint, digest): a commit's references are neighbours, and again one B-tree less.
Measured for ``blobs`` in a standalone sqlite3 test (10^6 rows, 10^5 deleted with their references
in batches of 5,000): 9,170 deletes/s before, 18,700/s after; reading every row window by
window 3.2 s before, 1.0 s after (issue 25, bench/RESULTS.md).

SQLite cannot convert a table in place, and a referenced table cannot be dropped while foreign
keys are enforced (``PRAGMA foreign_keys`` cannot be turned off inside the migration's
transaction; renaming a table with them on rewrites every reference to it). So the three tables
whose rows name a blob -- ``blobs``, ``checkpoint_blobs``, ``components`` -- are renamed aside
(with ``legacy_alter_table`` on, so the views keep naming the originals), created again from
their own statements (``blobs`` and ``checkpoint_blobs`` as ``WITHOUT ROWID``), filled from the
old ones (every reference checked again on the way), the old ones dropped children first, and
their indexes created again: 27 s for 10^6 blob rows and as many references here (the old
tables' pages stay in the file as free pages until a ``VACUUM``). PostgreSQL: nothing to do
(its tables are heaps in any order).
"""

from __future__ import annotations

import re

from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

#: Tables rebuilt, parents before children (created in this order, dropped in reverse).
_TABLES = ("blobs", "checkpoint_blobs", "components")
#: The tables stored in their primary key's order.
_CLUSTERED = ("blobs", "checkpoint_blobs")
_WITHOUT_ROWID = re.compile(r"\s*WITHOUT\s+ROWID\s*$", re.IGNORECASE)


def _rebuild(without_rowid: bool) -> None:
    bind = op.get_bind()
    if bind.dialect.name != "sqlite":
        return
    run = bind.exec_driver_sql
    creates = {
        table: run(
            "SELECT sql FROM sqlite_master WHERE type = 'table' AND name = ?", (table,)
        ).scalar_one()
        for table in _TABLES
    }
    indexes = [
        sql
        for table in _TABLES
        for sql in run(
            "SELECT sql FROM sqlite_master WHERE type = 'index' AND tbl_name = ? "
            "AND sql IS NOT NULL ORDER BY name",
            (table,),
        ).scalars()
    ]
    for table in _CLUSTERED:
        plain = _WITHOUT_ROWID.sub("", creates[table].rstrip())
        creates[table] = plain + (" WITHOUT ROWID" if without_rowid else "")
    run("PRAGMA legacy_alter_table = ON")
    try:
        for table in _TABLES:
            run(f"ALTER TABLE {table} RENAME TO _old_{table}")
        for table in _TABLES:
            run(creates[table])
            run(f"INSERT INTO {table} SELECT * FROM _old_{table}")
        for table in reversed(_TABLES):
            run(f"DROP TABLE _old_{table}")
        for index in indexes:
            run(index)
    finally:
        run("PRAGMA legacy_alter_table = OFF")


def upgrade() -> None:
    _rebuild(without_rowid=True)


def downgrade() -> None:
    _rebuild(without_rowid=False)
