"""tiers: local-durable checkpoints, blob copies on node-local tiers, blobs.in_store

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-07

A checkpoint may now be *local-durable* before it is remote-durable (DESIGN.md §13): every blob
it needs is fsynced on the local tiers (RAM disk, NVMe) of R distinct nodes, and some are not in
the object store yet. Three changes record that:

- ``checkpoints.status`` may be ``local``: committed to the nodes' tiers, not yet drained to the
  store. A drain makes it ``committed`` (remote-durable, as before). Every reader that knows
  only the store keeps looking for ``committed`` and never sees a checkpoint it could not read.
  ``checkpoints.trigger`` may be ``local`` too: a frequent save every ``local_period`` steps.
- ``blobs.in_store``: whether the object store holds the blob. Every row before this revision
  does (true); a blob first written by a local save has a row with ``in_store`` false until a
  drain uploads and checks it.
- ``blob_copies`` (digest, node): a verified copy of the blob on that node's tier. A row is
  written only once its copy is fsynced and was hashed by the process that wrote it; a copy that
  fails verification when read loses its row. Recovery plans from these rows alone, never from a
  directory listing.

SQLite has no ALTER for a CHECK constraint: the table's stored statement gets the new one (see
``_sqlite_check``). PostgreSQL replaces the constraint and grants ``ckptstore_reader`` SELECT on
the new table, as migration 0004 asks of every later table.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

#: Each CHECKed column's values before and after this revision (in the models' order).
_OLD = {
    "status": ("pending", "committed", "failed", "corrupt", "deleted"),
    "trigger": ("period", "last", "timeout", "manual"),
}
_NEW = {
    "status": (*_OLD["status"], "local"),
    "trigger": (*_OLD["trigger"], "local"),
}
_READER = "ckptstore_reader"


def _check(column: str, values: tuple[str, ...]) -> str:
    return f'"{column}" IN (' + ", ".join(f"'{v}'" for v in values) + ")"


def _sqlite_check(old: dict[str, tuple[str, ...]], new: dict[str, tuple[str, ...]]) -> None:
    """Swap the status CHECK's text in the table's stored statement: SQLite's documented way
    for a change that leaves every stored row valid and the file's content as it is (its ALTER
    TABLE page, "simpler procedure"), instant at any size. Rebuilding ``checkpoints`` instead
    would have to rebuild ``runs`` too (each names the other in a foreign key) and copy every
    reference row."""
    run = op.get_bind().exec_driver_sql
    create = run(
        "SELECT sql FROM sqlite_master WHERE type = 'table' AND name = 'checkpoints'"
    ).scalar_one()
    for column, values in old.items():
        if _check(column, values) not in create:
            raise RuntimeError(
                f"migration 0007: the checkpoints table's {column} CHECK is not the one the "
                "revision before left; restore the database from a backup taken before it was "
                "changed by hand"
            )
        create = create.replace(_check(column, values), _check(column, new[column]))
    version = run("PRAGMA schema_version").scalar_one()
    run("PRAGMA writable_schema = ON")
    try:
        run(
            "UPDATE sqlite_master SET sql = ? WHERE type = 'table' AND name = 'checkpoints'",
            (create,),
        )
        # Every connection reads the schema again before its next statement.
        run(f"PRAGMA schema_version = {int(version) + 1}")
    finally:
        run("PRAGMA writable_schema = OFF")


def _postgres_check(values: dict[str, tuple[str, ...]]) -> None:
    for column, allowed in values.items():
        op.execute(
            f"ALTER TABLE checkpoints DROP CONSTRAINT ck_checkpoints_{column}, "
            f"ADD CONSTRAINT ck_checkpoints_{column} CHECK ({_check(column, allowed)})"
        )


def _grant_reader() -> None:
    """SELECT on the new table for ckptstore_reader, where migration 0004 made the role."""
    bind = op.get_bind()
    exists = bind.execute(sa.text("SELECT 1 FROM pg_roles WHERE rolname = :r"), {"r": _READER})
    if exists.first() is not None:
        op.execute(f"GRANT SELECT ON blob_copies TO {_READER}")


def upgrade() -> None:
    dialect = op.get_bind().dialect.name
    if dialect == "sqlite":
        _sqlite_check(_OLD, _NEW)
    else:
        _postgres_check(_NEW)
    # A plain ADD COLUMN with a constant default: no table copy on either database.
    op.execute(
        "ALTER TABLE blobs ADD COLUMN in_store BOOLEAN DEFAULT "
        + ("1" if dialect == "sqlite" else "true")
        + " NOT NULL"
    )
    op.create_table(
        "blob_copies",
        sa.Column("digest", sa.String(67), nullable=False),
        sa.Column("node", sa.String(255), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["digest"], ["blobs.digest"], name="fk_blob_copies_digest_blobs"),
        sa.PrimaryKeyConstraint("digest", "node", name="pk_blob_copies"),
        sqlite_with_rowid=False,
    )
    op.create_index("ix_blob_copies_node", "blob_copies", ["node"])
    if dialect == "postgresql":
        _grant_reader()


def downgrade() -> None:
    dialect = op.get_bind().dialect.name
    held = (
        op.get_bind()
        .execute(sa.text("SELECT COUNT(*) FROM checkpoints WHERE status = 'local'"))
        .scalar_one()
    )
    if held:
        raise RuntimeError(
            f"cannot downgrade below 0007: {held} checkpoint(s) are local-durable only; drain "
            "them first (`ckptstore drain RUN`) or mark them deleted"
        )
    # Older revisions know no 'local' trigger: such saves become 'manual' ones.
    op.execute("UPDATE checkpoints SET \"trigger\" = 'manual' WHERE \"trigger\" = 'local'")
    # Rows of blobs the store does not hold would read as stored once the column is gone:
    # condemned instead, so an older writer checks the store before it trusts one (and GC
    # sweeps them).
    op.execute(
        "UPDATE blobs SET state = 'condemned', condemned_at = CURRENT_TIMESTAMP WHERE NOT in_store"
    )
    op.drop_index("ix_blob_copies_node", table_name="blob_copies")
    op.drop_table("blob_copies")
    op.execute("ALTER TABLE blobs DROP COLUMN in_store")
    if dialect == "sqlite":
        _sqlite_check(_NEW, _OLD)
    else:
        _postgres_check(_OLD)
