"""summary views for people

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30

``checkpoint_summary``: one row per checkpoint with its run's name, sizes and timings.
``run_summary``: one row per run with checkpoint counts, the latest committed step, the best
value of the run's metric, bytes, and the deduplication ratio of its committed checkpoints.
"""

from __future__ import annotations

from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

CHECKPOINT_SUMMARY = """
CREATE VIEW checkpoint_summary AS
SELECT c.id AS checkpoint_id,
       r.name AS run,
       c.step,
       c.status,
       c."trigger",
       c.writer_epoch,
       c.created_at,
       c.committed_at,
       c.logical_bytes,
       c.stored_bytes,
       c.uploaded_bytes,
       c.save_seconds,
       c.blocked_seconds,
       (SELECT COUNT(*) FROM components k WHERE k.checkpoint_id = c.id) AS components,
       c.metrics,
       c.training_info,
       c.error
FROM checkpoints c JOIN runs r ON r.id = c.run_id
"""

# The metric is read from the metrics JSON with each dialect's own JSON operator.
_METRIC = {
    # Only numbers count: a string or boolean metric value must not rank as 0 or 1.
    "sqlite": (
        "CASE WHEN json_type(c.metrics, '$.\"' || r.metric_name || '\"') IN ('integer', 'real') "
        "THEN CAST(json_extract(c.metrics, '$.\"' || r.metric_name || '\"') AS REAL) END"
    ),
    "postgresql": (
        "CASE WHEN json_typeof(c.metrics -> r.metric_name) = 'number' "
        "THEN (c.metrics ->> r.metric_name)::float8 END"
    ),
}

RUN_SUMMARY = """
CREATE VIEW run_summary AS
SELECT r.id AS run_id,
       r.name AS run,
       r.created_at,
       r.writer_epoch,
       (SELECT COUNT(*) FROM checkpoints c WHERE c.run_id = r.id) AS checkpoints,
       (SELECT COUNT(*) FROM checkpoints c
         WHERE c.run_id = r.id AND c.status = 'committed') AS committed,
       (SELECT COUNT(*) FROM checkpoints c
         WHERE c.run_id = r.id AND c.status = 'failed') AS failed,
       (SELECT MAX(c.step) FROM checkpoints c
         WHERE c.run_id = r.id AND c.status = 'committed') AS latest_step,
       r.metric_name,
       CASE WHEN r.higher_is_better
            THEN (SELECT MAX({metric}) FROM checkpoints c
                   WHERE c.run_id = r.id AND c.status = 'committed')
            ELSE (SELECT MIN({metric}) FROM checkpoints c
                   WHERE c.run_id = r.id AND c.status = 'committed')
       END AS best_metric,
       CAST((SELECT SUM(c.logical_bytes) FROM checkpoints c
         WHERE c.run_id = r.id AND c.status = 'committed') AS BIGINT) AS logical_bytes,
       CAST((SELECT SUM(b.stored_bytes) FROM blobs b WHERE b.digest IN (
           SELECT cb.digest FROM checkpoint_blobs cb
           JOIN checkpoints c ON c.id = cb.checkpoint_id
           WHERE c.run_id = r.id AND c.status = 'committed')) AS BIGINT) AS stored_bytes,
       -- Logical bytes of the committed checkpoints per byte actually stored for them
       -- (deduplication across checkpoints and compression together).
       CAST((SELECT SUM(c.logical_bytes) FROM checkpoints c
         WHERE c.run_id = r.id AND c.status = 'committed') AS REAL)
         / NULLIF((SELECT SUM(b.stored_bytes) FROM blobs b WHERE b.digest IN (
           SELECT cb.digest FROM checkpoint_blobs cb
           JOIN checkpoints c ON c.id = cb.checkpoint_id
           WHERE c.run_id = r.id AND c.status = 'committed')), 0) AS dedup_ratio
FROM runs r
"""


def upgrade() -> None:
    dialect = op.get_bind().dialect.name
    op.execute(CHECKPOINT_SUMMARY)
    op.execute(RUN_SUMMARY.replace("{metric}", _METRIC.get(dialect, _METRIC["sqlite"])))


def downgrade() -> None:
    op.execute("DROP VIEW run_summary")
    op.execute("DROP VIEW checkpoint_summary")
