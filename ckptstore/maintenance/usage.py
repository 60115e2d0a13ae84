"""Logical, referenced, unique and stored bytes, per run and overall (``ckptstore du`` and the web
UI's storage page; ``ckptstore runs`` shows the same figures).

The statements and the one definition of the dedup and compression ratios live in
:mod:`ckptstore.manifest.reporting` (:class:`~ckptstore.manifest.reporting.Usage`); this is the
maintenance API over them, and the records its readers show (:class:`DiskUsage`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ckptstore.manifest import reporting as reports
from ckptstore.manifest.db import Database
from ckptstore.manifest.reporting import Usage

__all__ = ["DiskUsage", "RunUsage", "Usage", "disk_usage"]


def disk_usage(db: Database) -> tuple[list[Usage], Usage, int]:
    """Per-run usage, the total over committed checkpoints, and every blob row's bytes."""
    report = reports.usage(db)
    return list(report.runs), report.total, report.all_blob_rows_stored_bytes


@dataclass(frozen=True, slots=True)
class RunUsage:
    """One line of the usage table: a run's usage (or the total's) with its ratios."""

    run: str
    checkpoints: int
    logical_bytes: int
    referenced_bytes: int
    unique_bytes: int
    stored_bytes: int
    dedup_ratio: float | None
    compression_ratio: float | None

    @classmethod
    def of(cls, usage: Usage) -> RunUsage:
        """The line for ``usage``."""
        return cls(
            usage.name,
            usage.checkpoints,
            usage.logical_bytes,
            usage.referenced_bytes,
            usage.unique_bytes,
            usage.stored_bytes,
            usage.dedup_ratio,
            usage.compression_ratio,
        )


@dataclass(frozen=True, slots=True)
class DiskUsage:
    """What ``ckptstore du`` and the storage page show."""

    runs: list[RunUsage]
    total: RunUsage
    all_blob_rows_stored_bytes: int

    @classmethod
    def of(cls, runs: Iterable[Usage], total: Usage, all_blob_rows_stored_bytes: int) -> DiskUsage:
        """The table for :func:`disk_usage`'s three results."""
        return cls([RunUsage.of(u) for u in runs], RunUsage.of(total), all_blob_rows_stored_bytes)
