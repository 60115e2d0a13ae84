"""Opening a run: defaults, names, config fingerprint, fork lineage, fencing (DESIGN.md §8)."""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ckptstore.cas.writer import WriterOptions
from ckptstore.checkpointer.jsonvalues import plain_json
from ckptstore.checkpointer.retention import RetentionPolicy
from ckptstore.checkpointer.run import Run
from ckptstore.checkpointer.tiered import Tiers
from ckptstore.errors import ConfigError
from ckptstore.manifest import reading
from ckptstore.manifest.db import Database
from ckptstore.manifest.opening import CheckConfig, open_run_row
from ckptstore.manifest.records import RunInfo
from ckptstore.names import check_run_name, check_step, parse_target
from ckptstore.objectstore import ObjectStore, open_store
from ckptstore.settings import default_db, default_store
from ckptstore.tiers.config import TierConfig

log = logging.getLogger("ckptstore.checkpointer")


def open_run(
    name: str,
    *,
    db: str | Path | Database | None = None,
    store: str | Path | ObjectStore | None = None,
    config: Mapping[str, Any] | None = None,
    identity: Mapping[str, Any] | None = None,
    writable: bool = True,
    retention: RetentionPolicy | None = None,
    writer_options: WriterOptions | None = None,
    async_save: bool = True,
    keep_snapshot_buffers: bool = True,
    fork_from: str | tuple[str, int] | None = None,
    tiers: TierConfig | None = None,
) -> Run:
    """Open (or create) the run ``name``.

    Args:
        db: Manifest database URL or SQLite path; default ``$CKPTSTORE_DB`` or
            ``./.ckptstore/manifest.db``.
        store: Object store URL or directory; default ``$CKPTSTORE_STORE`` or
            ``./.ckptstore/store``.
        config: The run's configuration (JSON). A writer records the config it opens with.
        identity: The part of ``config`` that identifies the run (what its checkpoints were
            trained with, e.g. the model), itself a mapping: nested mappings are compared key
            by key, and what it leaves out (learning rate, step counts) may change between
            opens. Reopening a run whose recorded config differs in ``identity`` is refused
            (ConfigError naming the keys). None (the default): the whole config identifies
            the run, so any change is refused; ``{}``: every change is recorded.
        writable: Open as the run's writer. This bumps the run's writer epoch, so an older
            writer still alive can no longer commit (fencing). Only a writer creates a missing
            database or store; a reader gets a ConfigError naming the path.
        retention: Which committed checkpoints to keep; default keeps all.
        async_save: ``save`` returns once the state is copied into host buffers, and stores
            and commits it in the background (False: ``save`` returns once it is committed,
            storing straight from the caller's tensors).
        keep_snapshot_buffers: Keep the async snapshot's host buffers resident between saves
            (the default): the run holds one copy of its CPU state (the state's size) from its
            first async save to ``close``, and every later snapshot is a copy into mapped
            memory. False hands their memory back to the kernel once each save is stored
            (``MADV_FREE``), for runs that need that memory between saves. The kernel takes
            such pages before anything else when it needs memory -- on a host whose page cache
            has filled memory, for any new file data -- and the next snapshot then faults in
            and zeroes the state's size of fresh pages (measured 2-3x the time of the copy
            itself). Buffers for GPU tensors are pinned and always stay.
        fork_from: ``"RUN@STEP"`` of the checkpoint a new run starts from (lineage).
        tiers: Node-local tiers (:class:`~ckptstore.tiers.TierConfig`): saves go to this
            node's tier and its replica peers' (local-durable), ``Run.drain`` sends them to
            the store, and loads read the nearest verified copy. A writer first removes from
            this node's tier what the manifest does not know (a crash's leftovers).
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
        if writable:
            objects.check_usable()  # a missing bucket fails here, not at the first save
        tiering = Tiers(tiers, create=writable) if tiers is not None else None
        if tiering is not None:
            owns.append(tiering)
        cfg = plain_json(config, "config")
        fingerprint = config_fingerprint(cfg) if cfg is not None else None
        opened = open_run_row(
            database,
            name,
            writable=writable,
            config=cfg,
            fingerprint=fingerprint,
            fork_from=parent,
            metric_name=retention.metric_name,
            higher_is_better=retention.higher_is_better,
            check_config=config_check(name, cfg, fingerprint, plain_json(identity, "identity")),
        )
        run = Run(
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
            tiers=tiering,
        )
        if tiering is not None and writable:
            swept, _ = tiering.start(database, opened.run_id)
            if swept:
                log.info("removed %d unknown object(s) from the tier of %s", swept, tiering.node)
        return run
    except BaseException:
        for resource in reversed(owns):
            resource.close()
        raise


def run_info(name: str, *, db: str | Path | Database | None = None) -> RunInfo | None:
    """The run ``name`` as recorded (config, lineage, writer epoch), or None; read-only."""
    check_run_name(name)
    if isinstance(db, Database):
        return reading.find_run(db, name)
    database = Database(db if db is not None else default_db(), create=False)
    try:
        return reading.find_run(database, name)
    finally:
        database.close()


def config_fingerprint(config: Mapping[str, Any]) -> str:
    """A stable SHA-256 of a JSON config (key order does not matter)."""
    canonical = json.dumps(config, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


def config_check(
    name: str,
    config: dict[str, Any] | None,
    fingerprint: str | None,
    identity: dict[str, Any] | None,
) -> CheckConfig:
    """The rule :func:`open_run` gives the manifest: a run that recorded a config may be
    reopened with ``config`` only if ``identity`` (None: the whole config) is unchanged."""
    if identity is not None:
        if config is None:
            raise ConfigError("identity names a part of config: pass config=... as well")
        if stray := identity_changes(config, identity):
            raise ConfigError(
                f"identity must be a part of config, but config differs at {', '.join(stray)}; "
                "take identity's values from config"
            )

    def check(recorded: dict[str, Any] | None, recorded_fingerprint: str | None) -> None:
        if config is None or recorded_fingerprint in (None, fingerprint):
            return
        fix = (
            "open a new run name instead, forked from this one if its checkpoints should carry "
            f"over (fork_from='{name}@STEP' records the lineage)"
        )
        if identity is None:
            changed = changed_keys(recorded or {}, config)
            raise ConfigError(
                f"run {name!r} was created with a different config (changed: "
                f"{', '.join(changed)}); {fix}, or pass identity=<the part of config that "
                "must not change> so that the rest may (identity={} records any change)"
            )
        if changed := identity_changes(recorded, identity):
            raise ConfigError(
                f"run {name!r} was created with a different identity (changed: "
                f"{', '.join(changed)}): its checkpoints do not belong to this config; {fix}"
            )

    return check


def changed_keys(old: Any, new: Any, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two nested configs (a key one lacks differs
    unless the other's value is None)."""
    if isinstance(old, Mapping) and isinstance(new, Mapping):
        keys = sorted(set(old) | set(new))
        return [
            k for key in keys for k in changed_keys(old.get(key), new.get(key), f"{prefix}{key}.")
        ]
    return [] if old == new else [prefix.rstrip(".")]


def identity_changes(recorded: Mapping[str, Any] | None, identity: Mapping[str, Any]) -> list[str]:
    """Dotted keys of ``identity`` whose values the ``recorded`` config does not hold: nested
    mappings are compared key by key, and a key ``identity`` leaves out is not compared."""
    return changed_keys(_shaped_like(recorded or {}, identity), identity)


def _shaped_like(value: Any, shape: Any) -> Any:
    """``value`` with only the keys ``shape`` has, at every level where both are mappings."""
    if isinstance(value, Mapping) and isinstance(shape, Mapping):
        return {k: _shaped_like(value[k], shape[k]) for k in shape if k in value}
    return value


def parse_fork(fork_from: str | tuple[str, int]) -> tuple[str, int]:
    """``"RUN@STEP"`` or ``(RUN, STEP)``, checked."""
    if isinstance(fork_from, tuple):
        name, step = fork_from
        return check_run_name(name), check_step(step)
    name, step_or_none = parse_target(fork_from, what="fork_from")
    if step_or_none is None:
        raise ConfigError(f"fork_from={fork_from!r}: use 'RUN@STEP', e.g. 'base@100'")
    return name, step_or_none
