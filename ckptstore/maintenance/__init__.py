"""Looking after a store: garbage collection, verification, export, usage."""

from __future__ import annotations

from ckptstore.maintenance.export import export_component
from ckptstore.maintenance.gc import GcBusyError, GcReport, collect_garbage
from ckptstore.maintenance.usage import Usage, disk_usage
from ckptstore.maintenance.verify import Problem, VerifyReport, verify

__all__ = [
    "GcBusyError",
    "GcReport",
    "Problem",
    "Usage",
    "VerifyReport",
    "collect_garbage",
    "disk_usage",
    "export_component",
    "verify",
]
