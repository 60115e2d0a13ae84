"""step_metrics: per-step training metrics of a run

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-07

A checkpoint's ``metrics`` hold the values at saves only; a curve of the loss needs every
step. ``step_metrics`` (run_id, name, step) -> value holds them, written in batches by
``Run.log_metrics`` (one transaction per flush, never one per step), read as plain SQL
(``ckptstore sql``) and by the web view's charts. Its primary key serves the one question
asked of it, a run's curve of one metric in step order; on SQLite the rows are stored in that
order (no rowid). A run's rows go with the run (ON DELETE CASCADE).

PostgreSQL grants ``ckptstore_reader`` SELECT on the new table, as migration 0004 asks of every
later table. The downgrade drops the table and its rows.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

_READER = "ckptstore_reader"


def _grant_reader() -> None:
    """SELECT on the new table for ckptstore_reader, where migration 0004 made the role."""
    bind = op.get_bind()
    exists = bind.execute(sa.text("SELECT 1 FROM pg_roles WHERE rolname = :r"), {"r": _READER})
    if exists.first() is not None:
        op.execute(f"GRANT SELECT ON step_metrics TO {_READER}")


def upgrade() -> None:
    op.create_table(
        "step_metrics",
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("value", sa.Float(), nullable=True),
        sa.Column("recorded_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name="fk_step_metrics_run_id_runs", ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("run_id", "name", "step", name="pk_step_metrics"),
        sqlite_with_rowid=False,
    )
    if op.get_bind().dialect.name == "postgresql":
        _grant_reader()


def downgrade() -> None:
    op.drop_table("step_metrics")
