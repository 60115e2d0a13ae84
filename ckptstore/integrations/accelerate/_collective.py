"""One save or load across an Accelerate job's processes: workers store, the main process commits.

Save (every process calls it, in the same order):

1. Each process builds its own ``process/<rank>`` component; a process other than the main
   one stores it through a :class:`~ckptstore.extending.ShardWriter` (the object store only,
   never the manifest) and keeps its receipt, or the error that stopped it.
2. The outcomes are gathered (JSON text) on every process.
3. The main process commits its shared components, its own component and every receipt as
   one checkpoint row -- only if every process succeeded -- and broadcasts the verdict; every
   process raises the same ``SaveError`` otherwise, so nothing partial is ever committed.

Load: the main process alone asks the manifest (the step asked for, or the newest committed
one) and broadcasts the record; every process reads the shared components and its own from the
store into fresh memory; the outcomes are gathered; only when every process read everything
does each one put its state back. When the newest checkpoint fails verification, the main
process marks it corrupt and all processes fall back to the one before it, together.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ckptstore.errors import CheckpointNotFoundError, CkptStoreError, IntegrityError, SaveError
from ckptstore.extending import (
    CheckpointInfo,
    ComponentReader,
    ObjectStore,
    Run,
    ShardWriter,
    checkpoint_info_from_json,
    checkpoint_info_to_json,
    mark_corrupt,
    open_store,
    receipt_from_json,
    receipt_to_json,
)

log = logging.getLogger("ckptstore.integrations.accelerate")

Target = Run | ObjectStore | str


@dataclass(frozen=True, slots=True)
class Job:
    """Where this process stands: its rank, the number of processes, what it saves to."""

    rank: int
    world: int
    target: Target

    @property
    def main(self) -> bool:
        """Whether this is the process that talks to the manifest."""
        return self.rank == 0

    def run(self, what: str) -> Run:
        """The main process's run; a clear error if it was given something else."""
        if not isinstance(self.target, Run):
            raise CkptStoreError(
                f"the main process {what} and needs the run: pass open_run(name, ...) there "
                "(the other processes need only the store: its URL or an ObjectStore)"
            )
        return self.target

    def store(self) -> tuple[ObjectStore, bool]:
        """The object store, and whether this call opened it (so must close it)."""
        if isinstance(self.target, Run):
            return self.target.store, False
        if isinstance(self.target, ObjectStore):
            return self.target, False
        return open_store(self.target, create=False), True


def describe(exc: BaseException) -> str:
    """One line naming an exception's type and message."""
    return f"{type(exc).__name__}: {exc}"


def _gather(job: Job, text: str) -> list[str]:
    if job.world == 1:
        return [text]
    texts: list[Any] = [None] * job.world
    dist.all_gather_object(texts, text)
    return [str(t) for t in texts]


def _broadcast(job: Job, text: str | None) -> str:
    if job.world == 1:
        assert text is not None
        return text
    box: list[Any] = [text]
    dist.broadcast_object_list(box, src=0)
    return str(box[0])


# -- save ---------------------------------------------------------------------------------


def save(
    job: Job,
    step: int,
    own: Callable[[], tuple[str, Any]],
    shared: Callable[[], dict[str, Any]],
    commit: Callable[[Run, dict[str, Any], list[Any]], Any],
) -> Any:
    """Every process: store ``own()`` (component, state); the main process commits it with
    ``shared()`` through ``commit(run, components, receipts)``, whose result it returns (the
    others return None). Collective: see the module docstring."""
    if job.world == 1:
        run = job.run("commits")
        component, state = own()
        return commit(run, {**shared(), component: state}, [])
    outcome: dict[str, Any] = {"rank": job.rank, "error": None, "receipt": None}
    mine: dict[str, Any] = {}
    failure: BaseException | None = None
    try:
        component, state = own()
        if job.main:
            mine = {**shared(), component: state}
        else:
            store, opened = job.store()
            try:
                with ShardWriter(store) as writer:
                    outcome["receipt"] = receipt_to_json(writer.write(component, state))
            finally:
                if opened:
                    store.close()
    except Exception as exc:
        failure, outcome["error"] = exc, describe(exc)
    outcomes = [json.loads(t) for t in _gather(job, json.dumps(outcome))]
    result = None
    verdict = None
    if job.main:
        failed = [f"process {o['rank']}: {o['error']}" for o in outcomes if o["error"]]
        if failed:
            verdict = f"nothing was committed ({'; '.join(failed)}); save again"
        else:
            try:
                receipts = [receipt_from_json(o["receipt"]) for o in outcomes if o["receipt"]]
                result = commit(job.run("commits"), mine, receipts)
            except Exception as exc:
                failure, verdict = exc, f"the commit failed: {describe(exc)}"
    error = json.loads(_broadcast(job, json.dumps(verdict)))
    if error is not None:
        raise SaveError(f"save of step {step} failed: {error}") from failure
    return result


# -- load ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Loaded:
    """What this process read: the checkpoint's record and its components' states."""

    info: CheckpointInfo
    states: dict[str, Any]


def load(
    job: Job,
    step: int | None,
    wanted: Callable[[CheckpointInfo], list[str]],
    check: Callable[[Loaded], None],
) -> Loaded | None:
    """Every process: read the components ``wanted(info)`` names of the checkpoint the main
    process chose (``step``, else the newest committed) and ``check`` them; None on every
    process when the run has no checkpoint yet. Collective: see the module docstring."""
    before: int | None = None
    while True:
        choice = _choose(job, step, before)
        if choice is None:
            return None
        loaded, error = _read(job, choice, wanted, check)
        outcomes = [json.loads(t) for t in _gather(job, json.dumps(_report(job, error)))]
        verdict = _verdict(job, choice, step, outcomes, error) if job.main else None
        decided = json.loads(_broadcast(job, json.dumps(verdict)))
        if decided["action"] == "apply":
            assert loaded is not None
            return loaded
        if decided["action"] == "fallback":
            before = choice.step
            continue
        if error is not None:
            raise error  # this process's own failure, as it was raised
        raise CkptStoreError(decided["error"])


def _choose(job: Job, step: int | None, before: int | None) -> CheckpointInfo | None:
    """The main process's choice, the same on every process (its error raised everywhere)."""
    message: dict[str, Any] | None = None
    failure: BaseException | None = None
    if job.main:
        try:
            run = job.run("chooses the checkpoint")
            found = run.checkpoint(step) if step is not None else run.latest(before_step=before)
            message = {"info": None if found is None else checkpoint_info_to_json(found)}
        except CkptStoreError as exc:
            failure, message = exc, {"error": describe(exc), "type": type(exc).__name__}
    doc = json.loads(_broadcast(job, json.dumps(message)))
    if "error" in doc:
        if failure is not None:
            raise failure
        kind = (
            CheckpointNotFoundError if doc["type"] == "CheckpointNotFoundError" else CkptStoreError
        )
        raise kind(f"the main process could not choose a checkpoint: {doc['error']}")
    if doc["info"] is None:
        return None
    return checkpoint_info_from_json(doc["info"], what="the main process's checkpoint choice")


def _read(
    job: Job,
    info: CheckpointInfo,
    wanted: Callable[[CheckpointInfo], list[str]],
    check: Callable[[Loaded], None],
) -> tuple[Loaded | None, BaseException | None]:
    """This process's components of ``info``, read into fresh memory and checked, or the
    error."""
    try:
        names = wanted(info)
        digests = {c.name: c.index_digest for c in info.components}
        store, opened = job.store()
        try:
            states = {n: _reader(store, info, n, digests).load() for n in names}
        finally:
            if opened:
                store.close()
        loaded = Loaded(info, states)
        check(loaded)
    except Exception as exc:
        return None, exc
    return loaded, None


def _reader(
    store: ObjectStore, info: CheckpointInfo, component: str, digests: dict[str, str]
) -> ComponentReader:
    if component not in digests:
        raise CkptStoreError(
            f"run {info.run!r} step {info.step} has no component {component!r} "
            f"(it holds {sorted(digests)}); it was saved by another setup"
        )
    context = f"run {info.run!r} step {info.step} component {component!r}"
    return ComponentReader(store, digests[component], context=context)


def _report(job: Job, error: BaseException | None) -> dict[str, Any]:
    return {
        "rank": job.rank,
        "error": None if error is None else describe(error),
        "damaged": isinstance(error, IntegrityError),
    }


def _verdict(
    job: Job,
    info: CheckpointInfo,
    step: int | None,
    outcomes: list[dict[str, Any]],
    error: BaseException | None,
) -> dict[str, Any]:
    """The main process's decision: apply, fall back past a damaged newest, or fail."""
    failed = [o for o in outcomes if o["error"] is not None]
    if not failed:
        return {"action": "apply"}
    where = f"run {info.run!r} step {info.step}"
    lines = "; ".join(f"process {o['rank']}: {o['error']}" for o in failed)
    if step is None and all(o["damaged"] for o in failed):
        damage = error if isinstance(error, IntegrityError) else IntegrityError(lines)
        try:
            mark_corrupt(job.run("marks damage"), info, damage)
        except CkptStoreError as exc:
            return {"action": "fail", "error": f"{where}: {describe(exc)}"}
        log.error("%s failed verification (%s); falling back to the one before it", where, lines)
        return {"action": "fallback"}
    return {"action": "fail", "error": f"loading {where} failed, nothing was changed: {lines}"}
