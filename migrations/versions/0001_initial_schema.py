"""initial schema

Revision ID: 0001
Revises:
Create Date: 2026-11-30

Tables for runs, checkpoints, components, blobs and their references, and the GC lease.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "blobs",
        sa.Column("digest", sa.String(length=67), nullable=False),
        sa.Column("kind", sa.String(length=8), nullable=False),
        sa.Column("logical_bytes", sa.BigInteger(), nullable=False),
        sa.Column("stored_bytes", sa.BigInteger(), nullable=False),
        sa.Column("codec", sa.String(length=8), nullable=True),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("(CURRENT_TIMESTAMP)"),
            nullable=False,
        ),
        sa.Column("last_claimed_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.CheckConstraint("\"state\" IN ('live', 'condemned')", name=op.f("ck_blobs_state")),
        sa.PrimaryKeyConstraint("digest", name=op.f("pk_blobs")),
    )
    with op.batch_alter_table("blobs", schema=None) as batch_op:
        batch_op.create_index(
            "ix_blobs_state_last_claimed_at", ["state", "last_claimed_at"], unique=False
        )

    op.create_table(
        "gc_lease",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("holder", sa.String(length=255), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint("id = 1", name=op.f("ck_gc_lease_singleton")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_gc_lease")),
    )
    op.create_table(
        "runs",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("(CURRENT_TIMESTAMP)"),
            nullable=False,
        ),
        sa.Column("config", sa.JSON(), nullable=True),
        sa.Column("config_fingerprint", sa.String(length=64), nullable=True),
        sa.Column("parent_checkpoint_id", sa.Integer(), nullable=True),
        sa.Column("writer_epoch", sa.Integer(), server_default="0", nullable=False),
        sa.Column("metric_name", sa.String(length=255), nullable=True),
        sa.Column("higher_is_better", sa.Boolean(), server_default=sa.true(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_runs")),
        sa.UniqueConstraint("name", name=op.f("uq_runs_name")),
    )
    op.create_table(
        "checkpoints",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("writer_epoch", sa.Integer(), nullable=False),
        sa.Column("trigger", sa.String(length=16), nullable=False),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("(CURRENT_TIMESTAMP)"),
            nullable=False,
        ),
        sa.Column("committed_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("training_info", sa.JSON(), nullable=True),
        sa.Column("metrics", sa.JSON(), nullable=True),
        sa.Column("logical_bytes", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("stored_bytes", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("uploaded_bytes", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("save_seconds", sa.Float(), nullable=True),
        sa.Column("blocked_seconds", sa.Float(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.CheckConstraint(
            "\"status\" IN ('pending', 'committed', 'failed', 'corrupt', 'deleted')",
            name=op.f("ck_checkpoints_status"),
        ),
        sa.CheckConstraint(
            "\"trigger\" IN ('period', 'last', 'timeout', 'manual')",
            name=op.f("ck_checkpoints_trigger"),
        ),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_checkpoints_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_checkpoints")),
    )
    with op.batch_alter_table("checkpoints", schema=None) as batch_op:
        batch_op.create_index(
            "ix_checkpoints_run_status_step", ["run_id", "status", "step"], unique=False
        )

    op.create_table(
        "checkpoint_blobs",
        sa.Column("checkpoint_id", sa.Integer(), nullable=False),
        sa.Column("digest", sa.String(length=67), nullable=False),
        sa.ForeignKeyConstraint(
            ["checkpoint_id"],
            ["checkpoints.id"],
            name=op.f("fk_checkpoint_blobs_checkpoint_id_checkpoints"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["digest"], ["blobs.digest"], name=op.f("fk_checkpoint_blobs_digest_blobs")
        ),
        sa.PrimaryKeyConstraint("checkpoint_id", "digest", name=op.f("pk_checkpoint_blobs")),
    )
    with op.batch_alter_table("checkpoint_blobs", schema=None) as batch_op:
        batch_op.create_index("ix_checkpoint_blobs_digest", ["digest"], unique=False)

    # runs <-> checkpoints reference each other: add the lineage key once both exist.
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.create_foreign_key(
            op.f("fk_runs_parent_checkpoint_id_checkpoints"),
            "checkpoints",
            ["parent_checkpoint_id"],
            ["id"],
            ondelete="SET NULL",
        )

    op.create_table(
        "components",
        sa.Column("checkpoint_id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("index_digest", sa.String(length=67), nullable=False),
        sa.Column("logical_bytes", sa.BigInteger(), nullable=False),
        sa.Column("stored_bytes", sa.BigInteger(), nullable=False),
        sa.Column("entries", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(
            ["checkpoint_id"],
            ["checkpoints.id"],
            name=op.f("fk_components_checkpoint_id_checkpoints"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["index_digest"], ["blobs.digest"], name=op.f("fk_components_index_digest_blobs")
        ),
        sa.PrimaryKeyConstraint("checkpoint_id", "name", name=op.f("pk_components")),
    )


def downgrade() -> None:
    op.drop_table("components")
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.drop_constraint(
            op.f("fk_runs_parent_checkpoint_id_checkpoints"), type_="foreignkey"
        )

    with op.batch_alter_table("checkpoint_blobs", schema=None) as batch_op:
        batch_op.drop_index("ix_checkpoint_blobs_digest")

    op.drop_table("checkpoint_blobs")
    with op.batch_alter_table("checkpoints", schema=None) as batch_op:
        batch_op.drop_index("ix_checkpoints_run_status_step")

    op.drop_table("checkpoints")
    op.drop_table("runs")
    op.drop_table("gc_lease")
    with op.batch_alter_table("blobs", schema=None) as batch_op:
        batch_op.drop_index("ix_blobs_state_last_claimed_at")

    op.drop_table("blobs")
