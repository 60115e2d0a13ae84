"""Logical, referenced, unique and stored bytes, per run and overall (``ckptstore du``; ``ckptstore
runs`` shows the same figures).

The statements and the one definition of the dedup and compression ratios live in
:mod:`ckptstore.manifest.reports` (:class:`~ckptstore.manifest.reports.Usage`); this is the
maintenance API over them.
"""

from __future__ import annotations

from ckptstore.manifest import reports
from ckptstore.manifest.db import Database
from ckptstore.manifest.reports import Usage

__all__ = ["Usage", "disk_usage"]


def disk_usage(db: Database) -> tuple[list[Usage], Usage, int]:
    """Per-run usage, the total over committed checkpoints, and every blob row's bytes."""
    report = reports.usage(db)
    return list(report.runs), report.total, report.all_blob_rows_stored_bytes
