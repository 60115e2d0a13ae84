"""index components.index_digest (GC deletes blob rows by the thousand)

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-03

``components.index_digest`` references ``blobs.digest``. Deleting a blob row makes the database
look for components that still reference it (the foreign key), and GC's sweep deletes the
components of deleted checkpoints by that column: without an index each is a scan of every
component row of the manifest -- per deleted blob, on PostgreSQL. A run with 10^5 checkpoints
made a sweep of 10^4 blobs take minutes (issue 25's cost curves, bench/bench_scale.py
``gc-history``).
"""

from __future__ import annotations

from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_components_index_digest", "components", ["index_digest"])


def downgrade() -> None:
    op.drop_index("ix_components_index_digest", table_name="components")
