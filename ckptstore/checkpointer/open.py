"""Opening a run: defaults, names, config fingerprint, fork lineage, fencing (DESIGN.md §8)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ckptstore.cas.writer import WriterOptions
from ckptstore.checkpointer.jsonvalues import plain_json
from ckptstore.checkpointer.retention import RetentionPolicy
from ckptstore.checkpointer.run import Run
from ckptstore.errors import ConfigError
from ckptstore.manifest import reads
from ckptstore.manifest import transactions as tx
from ckptstore.manifest.db import Database
from ckptstore.manifest.records import RunInfo
from ckptstore.names import check_run_name, check_step, parse_target
from ckptstore.objectstore import ObjectStore, open_store
from ckptstore.settings import default_db, default_store


def open_run(
    name: str,
    *,
    db: str | Path | Database | None = None,
    store: str | Path | ObjectStore | None = None,
    config: Mapping[str, Any] | None = None,
    writable: bool = True,
    retention: RetentionPolicy | None = None,
    writer_options: WriterOptions | None = None,
    async_save: bool = True,
    keep_snapshot_buffers: bool = False,
    fork_from: str | tuple[str, int] | None = None,
    allow_config_change: bool = False,
) -> Run:
    """Open (or create) the run ``name``.

    Args:
        db: Manifest database URL or SQLite path; default ``$CKPTSTORE_DB`` or
            ``./.ckptstore/manifest.db``.
        store: Object store URL or directory; default ``$CKPTSTORE_STORE`` or
            ``./.ckptstore/store``.
        config: The run's configuration (JSON). Reopening a run with a different config is
            refused unless ``allow_config_change``.
        writable: Open as the run's writer. This bumps the run's writer epoch, so an older
            writer still alive can no longer commit (fencing). Only a writer creates a missing
            database or store; a reader gets a ConfigError naming the path.
        retention: Which committed checkpoints to keep; default keeps all.
        async_save: ``save`` returns once the state is copied into host buffers, and stores
            and commits it in the background (False: ``save`` returns once it is committed,
            storing straight from the caller's tensors).
        keep_snapshot_buffers: Keep the async snapshot's host buffers resident between saves
            (a second copy of the state for the run's lifetime, for runs that prefer the
            fastest snapshot to memory). By default their memory goes back to the kernel once
            each save is stored, and is reused without page faults while the kernel has not
            needed it.
        fork_from: ``"RUN@STEP"`` of the checkpoint a new run starts from (lineage).
    """
    check_run_name(name)
    retention = retention or RetentionPolicy()
    parent = parse_fork(fork_from) if fork_from is not None else None
    owns: list[Any] = []
    database = (
        db
        if isinstance(db, Database)
        else Database(db if db is not None else default_db(), create=writable)
    )
    if not isinstance(db, Database):
        owns.append(database)
    try:
        objects = (
            store
            if isinstance(store, ObjectStore)
            else open_store(store if store is not None else default_store(), create=writable)
        )
        if not isinstance(store, ObjectStore):
            owns.append(objects)
        cfg = plain_json(config, "config")
        opened = tx.open_run_row(
            database,
            name,
            writable=writable,
            config=cfg,
            fingerprint=config_fingerprint(cfg) if cfg is not None else None,
            fork_from=parent,
            metric_name=retention.metric_name,
            higher_is_better=retention.higher_is_better,
            allow_config_change=allow_config_change,
        )
        return Run(
            db=database,
            store=objects,
            run_id=opened.run_id,
            name=name,
            epoch=opened.epoch,
            retention=retention,
            writer_options=writer_options,
            async_save=async_save,
            keep_snapshot_buffers=keep_snapshot_buffers,
            owns=owns,
        )
    except BaseException:
        for resource in reversed(owns):
            resource.close()
        raise


def run_info(name: str, *, db: str | Path | Database | None = None) -> RunInfo | None:
    """The run ``name`` as recorded (config, lineage, writer epoch), or None; read-only."""
    check_run_name(name)
    if isinstance(db, Database):
        return reads.find_run(db, name)
    database = Database(db if db is not None else default_db(), create=False)
    try:
        return reads.find_run(database, name)
    finally:
        database.close()


def config_fingerprint(config: Mapping[str, Any]) -> str:
    """A stable SHA-256 of a JSON config (key order does not matter)."""
    canonical = json.dumps(config, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


def parse_fork(fork_from: str | tuple[str, int]) -> tuple[str, int]:
    """``"RUN@STEP"`` or ``(RUN, STEP)``, checked."""
    if isinstance(fork_from, tuple):
        name, step = fork_from
        return check_run_name(name), check_step(step)
    name, step_or_none = parse_target(fork_from, what="fork_from")
    if step_or_none is None:
        raise ConfigError(f"fork_from={fork_from!r}: use 'RUN@STEP', e.g. 'base@100'")
    return name, step_or_none
