"""blobs.condemned_at for two-phase garbage collection

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30

GC condemns unreferenced blobs in one run and deletes them in a later one, once they have been
condemned for the grace period; a save that commits in between revives them.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("blobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("condemned_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    # Plain ALTER (SQLite >= 3.35 has DROP COLUMN): batch mode would copy the table, which
    # foreign keys from checkpoint_blobs forbid while they are enforced.
    op.execute("ALTER TABLE blobs DROP COLUMN condemned_at")
