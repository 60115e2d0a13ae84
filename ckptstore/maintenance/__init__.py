"""Looking after a store: garbage collection, verification, export, usage.

The names are imported on first use (``ckptstore._lazy``): ``verify`` and ``export_component``
need torch, and the CLI's read commands import this package without calling them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckptstore._lazy import lazy_exports

if TYPE_CHECKING:
    from ckptstore.maintenance.export import export_component
    from ckptstore.maintenance.gc import GcBusyError, GcReport, collect_garbage
    from ckptstore.maintenance.usage import Usage, disk_usage
    from ckptstore.maintenance.verification import Problem, VerifyReport, verify

__getattr__, __dir__ = lazy_exports(
    __name__,
    globals(),
    {
        "ckptstore.maintenance.export": ["export_component"],
        "ckptstore.maintenance.gc": ["GcBusyError", "GcReport", "collect_garbage"],
        "ckptstore.maintenance.usage": ["Usage", "disk_usage"],
        "ckptstore.maintenance.verification": ["Problem", "VerifyReport", "verify"],
    },
)

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
