"""The ``CheckpointIO`` plugin (see the package docstring).

Lightning calls, on the global-zero rank: ``save_checkpoint(checkpoint, path)`` for each
checkpoint (``ModelCheckpoint`` or ``Trainer.save_checkpoint``), then
``remove_checkpoint(old_path)`` for what ``ModelCheckpoint`` no longer keeps; on every rank:
``load_checkpoint(path)`` to resume or test; ``teardown()`` at the end of each stage.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

from lightning.fabric.plugins import CheckpointIO

from ckptstore import open_run
from ckptstore.errors import CheckpointNotFoundError, ConfigError
from ckptstore.extending import CheckpointInfo, Database, ObjectStore, Run, check_step
from ckptstore.integrations.lightning import _names, _tree

log = logging.getLogger("ckptstore.integrations.lightning")


class CkptstoreCheckpointIO(CheckpointIO):
    """Lightning checkpoints as committed manifest rows of one ckptstore run.

    Args:
        run: The ckptstore run the checkpoints belong to.
        db: Manifest database URL or SQLite path (default: ``$CKPTSTORE_DB`` or
            ``./.ckptstore/manifest.db``).
        store: Object store URL or directory (default: ``$CKPTSTORE_STORE`` or
            ``./.ckptstore/store``).
        async_save: Return from each save once the state is copied to host memory; upload and
            commit in the background (the next save, a load or ``teardown`` waits for it).
        config: The run's configuration (JSON), recorded with it (see ``ckptstore.open_run``).
    """

    def __init__(
        self,
        run: str = "lightning",
        *,
        db: str | Path | Database | None = None,
        store: str | Path | ObjectStore | None = None,
        async_save: bool = True,
        config: dict[str, Any] | None = None,
    ) -> None:
        self.run_name = run
        self._db = db
        self._store = store
        self._async = async_save
        self._config = config
        self._run: Run | None = None
        # Lightning's AsyncCheckpointIO calls save from its thread, remove from the trainer's.
        self._lock = threading.RLock()
        #: Names Lightning removed while the save that supersedes them was still in flight.
        self._deferred: list[str] = []
        self._in_flight = False

    def __repr__(self) -> str:
        return f"CkptstoreCheckpointIO(run={self.run_name!r})"

    @property
    def run(self) -> Run:
        """The run, opened as its writer at first use (fencing any older writer)."""
        if self._run is None:
            self._run = open_run(
                self.run_name,
                db=self._db,
                store=self._store,
                config=self._config,
                async_save=self._async,
            )
        return self._run

    # -- Lightning's calls ------------------------------------------------------------------

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        """Store ``checkpoint`` as the run's checkpoint at its ``global_step`` (async: once
        its tensors are copied), and put a pointer file at ``path``."""
        if storage_options is not None:
            raise ConfigError(
                f"storage_options={storage_options!r}: CkptstoreCheckpointIO takes none; "
                "configure the store with CkptstoreCheckpointIO(store=...)"
            )
        target = _names.local_path(path, "checkpoint path")
        step = check_step(checkpoint.get("global_step"))
        components = _tree.split(checkpoint)
        with self._lock:
            run = self.run
            self._settle()
            names = [n for n in self._names_at(step) if n != target.name] + [target.name]
            handle = run.save(
                step,
                components,
                training_info=_names.training_info(names, target.parent, checkpoint),
                metrics=_names.metrics(checkpoint),
                trigger="last" if _names.is_last(target.name) else "period",
            )
            self._in_flight = self._async
            _names.write_pointer(target, self.run_name, step)
        log.debug("saving %s as step %d of run %r", target.name, step, self.run_name)
        del handle

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """The checkpoint ``path`` names, found by a manifest query: a ``last`` name loads
        the run's newest committed checkpoint, another name the checkpoint saved under it.
        No file is read; nothing is unpickled (``weights_only`` holds whatever it says)."""
        target = _names.local_path(path, "ckpt_path")
        move = _tree.mover(map_location)
        with self._lock:
            run = self._reader()
            try:
                info = self._resolve(run, target)
                loaded = run.load(info.step, fallback=False) if info is not None else run.load()
            finally:
                if run is not self._run:
                    run.close()
        where = f"run {self.run_name!r} step {loaded.info.step} ({target.name})"
        log.info("loading %s", where)
        return move(_tree.join(loaded.state, where))

    def remove_checkpoint(self, path: Any) -> None:
        """Lightning no longer keeps ``path``: its pointer goes, and its checkpoint is marked
        deleted once no other name holds it (GC reclaims the blobs; nothing is deleted here)."""
        target = _names.local_path(path, "checkpoint path")
        with self._lock:
            _names.remove_pointer(target)
            if self._in_flight:
                # The save that replaces it is not committed yet: release after it is.
                self._deferred.append(target.name)
                return
            self._release(target.name)

    def teardown(self) -> None:
        """Wait for the save in flight (raising its error), apply removals, close the run."""
        with self._lock:
            if self._run is None:
                return
            try:
                self._settle()
            finally:
                run, self._run = self._run, None
                run.close()

    # -- helpers ----------------------------------------------------------------------------

    def _settle(self) -> None:
        """The save in flight is committed (or raises); then Lightning's removals that waited
        for it are applied."""
        if self._run is None:
            return
        self._run.finalize()
        self._in_flight = False
        deferred, self._deferred = self._deferred, []
        for name in deferred:
            self._release(name)

    def _release(self, name: str) -> None:
        run = self.run
        row = _names.released_by(name, run.checkpoints(["committed"]))
        if row is not None and run.release(row.step):
            log.info("released %s (step %d) of run %r", name, row.step, self.run_name)

    def _names_at(self, step: int) -> list[str]:
        """The names of the committed checkpoint at ``step`` (a save of the step replaces it
        and carries them over)."""
        try:
            return _names.names_of(self.run.checkpoint(step))
        except CheckpointNotFoundError:
            return []

    def _reader(self) -> Run:
        """The writer if this process opened it; else the run read-only (every rank loads,
        and only the saving rank may open the writer: opening one fences the others)."""
        if self._run is not None:
            self._settle()
            return self._run
        return open_run(self.run_name, db=self._db, store=self._store, writable=False)

    def _resolve(self, run: Run, target: Path) -> CheckpointInfo | None:
        """The checkpoint ``target`` names; None for a ``last`` name (the newest committed,
        with fallback past a damaged one)."""
        if _names.is_last(target.name):
            if run.latest() is None:
                raise CheckpointNotFoundError(
                    f"run {self.run_name!r} has no committed checkpoint to resume from "
                    f"({target}); start without ckpt_path, or name the run that has them"
                )
            return None
        held = _names.holders(run.checkpoints(["committed"])).get(target.name)
        if held is None:
            raise CheckpointNotFoundError(
                f"{target}: run {self.run_name!r} has no committed checkpoint saved as "
                f"{target.name!r} (removed, or never saved through ckptstore; a file at that "
                "path is never read); pass ckpt_path='last' or a name `ckptstore ls "
                f"{self.run_name}` lists"
            )
        return held
