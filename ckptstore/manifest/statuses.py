"""The values a manifest row's status, trigger and state may take (DESIGN.md §6).

Apart from the ORM models (:mod:`ckptstore.manifest.models`, which re-exports them and makes
each a CHECK constraint) so that readers on SQLAlchemy Core (:mod:`ckptstore.manifest._sql`,
:mod:`ckptstore.manifest.reporting`) and the CLI's read commands can name them without
importing the ORM.
"""

from __future__ import annotations

import enum


class Status(enum.StrEnum):
    """The life of a checkpoint row."""

    PENDING = "pending"
    COMMITTED = "committed"
    FAILED = "failed"
    CORRUPT = "corrupt"
    DELETED = "deleted"
    #: Local-durable: every blob is fsynced on the node-local tiers of enough nodes, and the
    #: object store may not hold them all yet; a drain makes it ``committed`` (DESIGN.md §13).
    LOCAL = "local"


class Trigger(enum.StrEnum):
    """Why a checkpoint was saved."""

    PERIOD = "period"
    LAST = "last"
    TIMEOUT = "timeout"
    MANUAL = "manual"
    #: A frequent save to the node-local tiers (every ``local_period`` steps).
    LOCAL = "local"


class BlobState(enum.StrEnum):
    """A blob row: live, or condemned by GC (or as damaged)."""

    LIVE = "live"
    CONDEMNED = "condemned"
