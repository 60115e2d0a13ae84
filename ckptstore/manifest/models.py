"""SQLAlchemy models of the manifest database (DESIGN.md §6).

Every constraint has a name (so migrations can refer to it on every dialect), enums are CHECK
constraints, and times are timezone-aware UTC.
"""

from __future__ import annotations

import datetime as dt
import enum
from typing import Any, ClassVar

from sqlalchemy import (
    JSON,
    BigInteger,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    func,
    true,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# The enums live in their own module, without the ORM, for the readers that must not import
# it; they are re-exported here, where the constraints that check them are declared.
from ckptstore.manifest.statuses import BlobState as BlobState
from ckptstore.manifest.statuses import Status as Status
from ckptstore.manifest.statuses import Trigger as Trigger

NAMING = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def _in(column: str, values: type[enum.StrEnum]) -> str:
    # Quoted: "trigger" is a keyword in SQL.
    return f'"{column}" IN ({", ".join(repr(v.value) for v in values)})'


def utcnow() -> dt.datetime:
    """Now, timezone-aware UTC."""
    return dt.datetime.now(dt.UTC)


class Base(DeclarativeBase):
    """The declarative base: naming convention and type map."""

    metadata = MetaData(naming_convention=NAMING)
    type_annotation_map: ClassVar[dict[Any, Any]] = {
        dict[str, Any]: JSON,
        dt.datetime: DateTime(timezone=True),
    }


class RunRow(Base):
    """A row of ``runs``."""

    __tablename__ = "runs"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(255), unique=True)
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow, server_default=func.now())
    config: Mapped[dict[str, Any] | None]
    config_fingerprint: Mapped[str | None] = mapped_column(String(64))
    #: The checkpoint this run was forked from (lineage); None for a fresh run.
    parent_checkpoint_id: Mapped[int | None] = mapped_column(
        ForeignKey("checkpoints.id", use_alter=True, ondelete="SET NULL")
    )
    #: Bumped by every writer that opens the run; only the newest writer may commit.
    writer_epoch: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    #: Metric that retention ranks by and the run summary reports as "best".
    metric_name: Mapped[str | None] = mapped_column(String(255))
    higher_is_better: Mapped[bool] = mapped_column(default=True, server_default=true())


class CheckpointRow(Base):
    """A row of ``checkpoints``."""

    __tablename__ = "checkpoints"
    __table_args__ = (
        CheckConstraint(_in("status", Status), name="status"),
        CheckConstraint(_in("trigger", Trigger), name="trigger"),
        Index("ix_checkpoints_run_status_step", "run_id", "status", "step"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column(BigInteger)
    status: Mapped[str] = mapped_column(String(16), default=Status.PENDING)
    writer_epoch: Mapped[int] = mapped_column(Integer)
    trigger: Mapped[str] = mapped_column(String(16), default=Trigger.MANUAL)
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow, server_default=func.now())
    committed_at: Mapped[dt.datetime | None]
    training_info: Mapped[dict[str, Any] | None]
    metrics: Mapped[dict[str, Any] | None]
    logical_bytes: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    stored_bytes: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    uploaded_bytes: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    save_seconds: Mapped[float | None] = mapped_column(Float)
    blocked_seconds: Mapped[float | None] = mapped_column(Float)
    #: Why the save failed or the checkpoint was marked corrupt.
    error: Mapped[str | None] = mapped_column(Text)


class ComponentRow(Base):
    """A row of ``components``."""

    __tablename__ = "components"
    #: GC deletes blob rows; the foreign key from here is checked through this index.
    __table_args__ = (Index("ix_components_index_digest", "index_digest"),)

    checkpoint_id: Mapped[int] = mapped_column(
        ForeignKey("checkpoints.id", ondelete="CASCADE"), primary_key=True
    )
    name: Mapped[str] = mapped_column(String(255), primary_key=True)
    kind: Mapped[str] = mapped_column(String(32), default="state")
    index_digest: Mapped[str] = mapped_column(ForeignKey("blobs.digest"))
    logical_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    stored_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    entries: Mapped[int] = mapped_column(Integer, default=0)


class BlobRow(Base):
    """A row of ``blobs``."""

    __tablename__ = "blobs"
    __table_args__ = (
        CheckConstraint(_in("state", BlobState), name="state"),
        Index("ix_blobs_state_last_claimed_at", "state", "last_claimed_at"),
        # SQLite: rows stored in digest order, no separate key index (migration 0006).
        {"sqlite_with_rowid": False},
    )

    digest: Mapped[str] = mapped_column(String(67), primary_key=True)
    kind: Mapped[str] = mapped_column(String(8))
    logical_bytes: Mapped[int] = mapped_column(BigInteger)
    stored_bytes: Mapped[int] = mapped_column(BigInteger)
    codec: Mapped[str | None] = mapped_column(String(8))
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow, server_default=func.now())
    last_claimed_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    state: Mapped[str] = mapped_column(String(16), default=BlobState.LIVE)
    #: When garbage collection condemned it; a later GC deletes it once this is old enough.
    condemned_at: Mapped[dt.datetime | None]
    #: Whether the object store holds it (false: only node-local tiers do, see ``blob_copies``,
    #: until a drain uploads it). Every row older than migration 0007 is in the store.
    in_store: Mapped[bool] = mapped_column(default=True, server_default=true())


class CheckpointBlobRow(Base):
    """A row of ``checkpoint_blobs``: a checkpoint references a blob."""

    __tablename__ = "checkpoint_blobs"
    __table_args__ = (
        Index("ix_checkpoint_blobs_digest", "digest"),
        # SQLite: rows stored in key order, no rowid B-tree (migration 0006).
        {"sqlite_with_rowid": False},
    )

    checkpoint_id: Mapped[int] = mapped_column(
        ForeignKey("checkpoints.id", ondelete="CASCADE"), primary_key=True
    )
    digest: Mapped[str] = mapped_column(ForeignKey("blobs.digest"), primary_key=True)


class BlobCopyRow(Base):
    """A row of ``blob_copies``: a verified copy of a blob on one node's local tier.

    Written only once the copy is fsynced and was hashed by the process that wrote it; a copy
    that fails verification when read loses its row. Recovery plans from these rows alone."""

    __tablename__ = "blob_copies"
    __table_args__ = (
        Index("ix_blob_copies_node", "node"),
        {"sqlite_with_rowid": False},
    )

    digest: Mapped[str] = mapped_column(ForeignKey("blobs.digest"), primary_key=True)
    node: Mapped[str] = mapped_column(String(255), primary_key=True)
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)


class StepMetricRow(Base):
    """A row of ``step_metrics``: one metric's value at one training step of a run (the
    per-step curve; checkpoints' ``metrics`` hold the values at saves only).

    Written in batches by ``Run.log_metrics`` (one transaction per flush); logging a step
    again replaces its value. NULL: the value was NaN (SQLite stores no NaN)."""

    __tablename__ = "step_metrics"
    __table_args__ = ({"sqlite_with_rowid": False},)

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    name: Mapped[str] = mapped_column(String(255), primary_key=True)
    step: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    value: Mapped[float | None] = mapped_column(Float)
    recorded_at: Mapped[dt.datetime] = mapped_column(default=utcnow)


class GcLeaseRow(Base):
    """One row while a garbage collection runs: only one GC at a time."""

    __tablename__ = "gc_lease"
    __table_args__ = (CheckConstraint("id = 1", name="singleton"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    holder: Mapped[str] = mapped_column(String(255))
    expires_at: Mapped[dt.datetime]
