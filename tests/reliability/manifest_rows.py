"""Counting what the manifest holds for one checkpoint (shared by the fault suites)."""

from __future__ import annotations

from sqlalchemy import func, select

from ckptstore.checkpointer import Run
from ckptstore.manifest.models import CheckpointBlobRow, ComponentRow


def child_rows(run: Run, checkpoint_id: int) -> tuple[int, int]:
    """(components, blob references) of one checkpoint, counted in the database."""
    with run.db.read() as session:
        components = session.scalar(
            select(func.count())
            .select_from(ComponentRow)
            .where(ComponentRow.checkpoint_id == checkpoint_id)
        )
        refs = session.scalar(
            select(func.count())
            .select_from(CheckpointBlobRow)
            .where(CheckpointBlobRow.checkpoint_id == checkpoint_id)
        )
    return int(components or 0), int(refs or 0)
