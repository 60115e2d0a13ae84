"""Opening a run: find or create its row, take over as its writer (fencing), record its config.

Whether a changed config may be recorded is not the manifest's call: the caller passes its rule
in (``check_config``), and it runs inside the opening transaction on what the run recorded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy.exc import IntegrityError as SQLIntegrityError
from sqlalchemy.orm import Session

from ckptstore.errors import CheckpointNotFoundError
from ckptstore.manifest._orm import runs
from ckptstore.manifest._sql.lookups import fetch_committed_at_step
from ckptstore.manifest.db import Database
from ckptstore.manifest.models import RunRow

#: (the config an existing run recorded, its fingerprint) -> None, or raises to refuse the open.
CheckConfig = Callable[[dict[str, Any] | None, str | None], None]


@dataclass(frozen=True, slots=True)
class OpenedRun:
    """What opening a run for reading or writing found."""

    run_id: int
    #: The writer epoch this writer holds; None for a reader.
    epoch: int | None


def open_run_row(
    db: Database,
    name: str,
    *,
    writable: bool,
    config: dict[str, Any] | None,
    fingerprint: str | None,
    fork_from: tuple[str, int] | None,
    metric_name: str | None,
    higher_is_better: bool,
    check_config: CheckConfig,
) -> OpenedRun:
    """Find or create the run; a writer bumps its epoch (fencing older writers), marks their
    pending checkpoints abandoned and records its ``config``. An existing run's recorded config
    is first given to ``check_config``, which refuses the open by raising."""

    def transaction(session: Session) -> OpenedRun:
        run = runs.load_run_row(session, name)
        if run is None:
            if not writable:
                raise CheckpointNotFoundError(f"no run named {name!r} in {db!r}")
            run = _create(
                session, name, config, fingerprint, fork_from, (metric_name, higher_is_better)
            )
        else:
            check_config(run.config, run.config_fingerprint)
            if writable:
                _record_settings(run, config, fingerprint, metric_name, higher_is_better)
        epoch = runs.bump_epoch(session, run.id) if writable else None
        if epoch is not None:
            runs.abandon_pending(session, run.id, epoch)
        return OpenedRun(run.id, epoch)

    try:
        return db.write(transaction, what=f"opening run {name!r}")
    except SQLIntegrityError:
        # Another process created the same run at the same moment: open the existing row.
        return db.write(transaction, what=f"opening run {name!r}")


def _create(
    session: Session,
    name: str,
    config: dict[str, Any] | None,
    fingerprint: str | None,
    fork_from: tuple[str, int] | None,
    metric: tuple[str | None, bool],
) -> RunRow:
    parent = None
    if fork_from is not None:
        parent_run = runs.load_run_row(session, fork_from[0])
        if parent_run is None:
            raise CheckpointNotFoundError(f"fork_from: no run named {fork_from[0]!r}")
        parent = fetch_committed_at_step(session, parent_run.id, fork_from[1]).id
    return runs.insert_run(
        session,
        name,
        config=config,
        fingerprint=fingerprint,
        parent_checkpoint_id=parent,
        metric_name=metric[0],
        higher_is_better=metric[1],
    )


def _record_settings(
    run: RunRow,
    config: dict[str, Any] | None,
    fingerprint: str | None,
    metric_name: str | None,
    higher_is_better: bool,
) -> None:
    if fingerprint is not None:
        run.config, run.config_fingerprint = config, fingerprint
    if metric_name is not None:
        run.metric_name = metric_name
        run.higher_is_better = higher_is_better
