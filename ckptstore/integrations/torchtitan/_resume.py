"""Which checkpoint a torchtitan job resumes from, decided once by rank 0, loaded by every rank.

Rank 0 alone asks the manifest (one query for the newest committed step, or the step asked
for, or the ``initial_load_path`` checkpoint of a new run) and broadcasts a :class:`Choice` --
the step and the digest of its DCP metadata -- or the error it met, so no rank waits for an
answer that will not come. Every rank then reads only its own boxes from the store. When the
newest checkpoint fails verification, rank 0 marks it corrupt and all ranks fall back to the
one before it, together.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from ckptstore import errors, open_run
from ckptstore.errors import CheckpointNotFoundError, CkptStoreError, ConfigError, IntegrityError
from ckptstore.extending import (
    CheckpointInfo,
    ObjectStore,
    Run,
    TierConfig,
    mark_corrupt,
    nearest_copies,
    open_store,
    parse_step_id,
)
from ckptstore.integrations.dcp import METADATA_COMPONENT, CkptStoreReader, NoPickleLoadPlanner

log = logging.getLogger("ckptstore.integrations.torchtitan")


@dataclass(frozen=True, slots=True)
class Choice:
    """The checkpoint every rank loads: where it is and what it holds."""

    run: str
    step: int
    digest: str
    #: Only the model's state was saved (a last checkpoint with ``last_save_model_only``) or is
    #: wanted (``initial_load_model_only``).
    model_only: bool
    #: It is another run's checkpoint (``initial_load_path``): no fallback past it.
    initial: bool = False
    #: A run with node-local tiers: where each blob is (``Run.copies``) and the nodes whose
    #: tiers answer, so every rank reads each blob from its nearest copy; None: the store.
    copies: dict[str, tuple[bool, tuple[str, ...]]] | None = None
    reachable: tuple[str, ...] = ()


def parse_initial_load_path(path: str) -> tuple[str, int]:
    """``"RUN@STEP"`` (STEP may be torchtitan's ``step-N``) -> (run, step), else ConfigError."""
    name, sep, step = path.strip().rpartition("@")
    if not sep or not name:
        raise ConfigError(
            f"checkpoint.initial_load_path={path!r}: with ckptstore it names a checkpoint of "
            "another run in the same database as 'RUN@STEP' (e.g. 'llama3-base@1000'); the new "
            "run records it as its parent"
        )
    return name, parse_step_id(step, what="checkpoint.initial_load_path step")


def choose(
    run: Run, step: int, before: int | None, initial: tuple[str, int] | None, model_only: bool
) -> tuple[Choice, CheckpointInfo, Run] | None:
    """Rank 0: the checkpoint to load (``step``, else the newest committed below ``before``,
    else ``initial``'s), its record and the run that holds it; None for a fresh start."""
    found = run.checkpoint(step) if step >= 0 else run.latest(before_step=before)
    if found is not None:
        return _choice(found, run, model_only=None), found, run
    if initial is None or before is not None:
        return None
    parent = _open_parent(run, initial[0])
    info = parent.checkpoint(initial[1])
    return _choice(info, parent, model_only=model_only, initial=True), info, parent


def _open_parent(run: Run, name: str) -> Run:
    """``name`` read-only, in ``run``'s database and store."""
    return open_run(name, db=run.db, store=run.store, writable=False)


def _choice(
    info: CheckpointInfo, run: Run, *, model_only: bool | None, initial: bool = False
) -> Choice:
    digest = next((c.index_digest for c in info.components if c.name == METADATA_COMPONENT), None)
    if digest is None:
        raise ConfigError(
            f"run {run.name!r} step {info.step} was not saved through torch DCP (no "
            f"{METADATA_COMPONENT!r} component), so torchtitan cannot load it; point "
            "checkpoint.run at a run the torchtitan manager saved"
        )
    saved_model_only = bool((info.training_info or {}).get("model_only", False))
    wanted = saved_model_only if model_only is None else model_only or saved_model_only
    if run.tiers is None:
        return Choice(run.name, info.step, digest, wanted, initial)
    return Choice(run.name, info.step, digest, wanted, initial, run.copies(info), run.reachable())


def share(choice: Choice | CkptStoreError | None) -> Choice | None:
    """Rank 0's choice (or its error, raised on every rank), the same on every rank."""
    if dist.is_available() and dist.is_initialized():
        sent: list[Any] = [_as_message(choice)]
        dist.broadcast_object_list(sent, src=0)
        choice = _from_message(sent[0]) if dist.get_rank() != 0 else choice
    if isinstance(choice, CkptStoreError):
        raise choice
    return choice


def _as_message(choice: Choice | CkptStoreError | None) -> Any:
    """Plain values only: the broadcast carries no ckptstore objects."""
    if isinstance(choice, CkptStoreError):
        return ("error", type(choice).__name__, str(choice))
    if choice is None:
        return None
    return (
        "choice",
        choice.run,
        choice.step,
        choice.digest,
        choice.model_only,
        choice.initial,
        choice.copies,
        choice.reachable,
    )


def _from_message(message: Any) -> Choice | CkptStoreError | None:
    if message is None:
        return None
    if message[0] == "error":
        kind = getattr(errors, message[1], CkptStoreError)
        return kind(f"on rank 0: {message[2]}")
    return Choice(*message[1:])


def load_choice(
    states: dict[str, Any],
    store: ObjectStore | str,
    choice: Choice,
    max_workers: int = 8,
    *,
    tiers: TierConfig | None = None,
) -> None:
    """Every rank: load ``choice`` into ``states`` in place, reading only its own boxes (with
    ``tiers`` and a choice that lists copies: each blob from its nearest copy)."""
    with contextlib.ExitStack() as opened:
        if tiers is not None and choice.copies is not None:
            remote = store if isinstance(store, ObjectStore) else open_store(store, create=False)
            if remote is not store:
                opened.callback(remote.close)
            store = nearest_copies(tiers, choice.copies, choice.reachable, remote)
        _load_choice(states, store, choice, max_workers)


def _load_choice(
    states: dict[str, Any], store: ObjectStore | str, choice: Choice, max_workers: int
) -> None:
    reader = CkptStoreReader(
        store,
        choice.digest,
        context=f"run {choice.run!r}, step {choice.step}",
        max_workers=max_workers,
    )
    try:
        reader.stored_metadata()  # a malformed document is refused here, by name
        with _single_process_ok():
            dcp_load(states, storage_reader=reader, planner=NoPickleLoadPlanner())
    except CheckpointException as failed:
        raise _rank_error(failed, choice) from None
    finally:
        reader.close()


def resume(
    run: Run | None,
    step: int,
    initial: tuple[str, int] | None,
    initial_model_only: bool,
    load: Callable[[Choice], None],
) -> Choice | None:
    """Choose on rank 0 (``run`` is None elsewhere), load on every rank with ``load``, and fall
    back past a newest checkpoint that fails verification. Returns what was loaded."""
    before: int | None = None
    skipped: list[int] = []
    while True:
        picked: tuple[Choice, CheckpointInfo, Run] | None = None
        if run is not None:
            try:
                picked = choose(run, step, before, initial, initial_model_only)
            except CkptStoreError as exc:
                share(exc)
        choice = share(picked[0] if picked else None)
        if choice is None:
            if skipped:
                raise CheckpointNotFoundError(
                    f"every committed checkpoint failed verification (steps {skipped})"
                )
            return None
        try:
            load(choice)
        except IntegrityError as damaged:
            if step >= 0 or choice.initial:
                raise
            if picked is not None:
                # Every rank moves on together, so rank 0 must not stop here on its own.
                mark_corrupt(picked[2], picked[1], damaged, check_store=False)
            skipped.append(choice.step)
            before = choice.step
            continue
        finally:
            if picked is not None and picked[2] is not run:
                picked[2].close()
        if skipped:
            log.warning(
                "run %r: resumed from step %d, skipping corrupt %s",
                choice.run,
                choice.step,
                skipped,
            )
        return choice


def _rank_error(failed: CheckpointException, choice: Choice) -> CkptStoreError:
    """The error to raise on every rank: damage first (it decides the fallback), then any
    ckptstore error, else DCP's failure wrapped with the ranks that failed."""
    found = [
        (rank, error[0] if isinstance(error, tuple) else error)
        for rank, error in sorted(failed.failures.items())
    ]
    for wanted in (IntegrityError, CkptStoreError):
        for _, error in found:
            if isinstance(error, wanted):
                return error
    ranks = [rank for rank, _ in found]
    first = found[0][1] if found else failed
    wrapped = CkptStoreError(
        f"loading run {choice.run!r} step {choice.step} failed on rank(s) {ranks}: "
        f"{type(first).__name__}: {first}"
    )
    wrapped.__cause__ = first if isinstance(first, BaseException) else None
    return wrapped


@contextlib.contextmanager
def _single_process_ok() -> Iterator[None]:
    """DCP warns that it assumes one process when torch.distributed is not initialized; in a
    single process that is what the caller means."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield
