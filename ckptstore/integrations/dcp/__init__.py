"""torch.distributed.checkpoint (DCP) on ckptstore: every rank uploads its own blobs, the
coordinator commits one checkpoint row, and nothing is ever pickled.

Use the wrappers (they pick the no-pickle planners and turn DCP's failures into ckptstore's
errors)::

    import ckptstore
    from ckptstore.integrations import dcp as ckpt_dcp

    run = ckptstore.open_run("llama-8b", db=..., store=..., writable=rank == 0)
    ckpt_dcp.save({"model": model.state_dict(), "optim": optim.state_dict()}, run, step)
    ckpt_dcp.load(state_dict, run)            # newest committed step, resharded to this layout

or pass the parts to DCP yourself: ``dcp.save(sd, storage_writer=CkptStoreWriter(run, step),
planner=NoPickleSavePlanner())`` and ``dcp.load(sd, storage_reader=CkptStoreReader.from_run(run),
planner=NoPickleLoadPlanner())``.

How a checkpoint is laid out: rank ``r`` stores the items DCP planned for it as the component
``dcp/rank<r>`` (a list: tensors -- chunked, packed, compressed and deduplicated as any
component -- and plain values as JSON text); the coordinator stores DCP's metadata as JSON in
``dcp/metadata`` and commits everything in one transaction in ``finish()``, which DCP calls only
when every rank's writes succeeded. A failed rank commits nothing.

Only the coordinator (rank 0 of the process group) needs a writable run; the other ranks pass a
read-only run or just the store. Loading needs the metadata component's digest (``from_run``
finds it); every rank then reads only the blobs that hold the boxes it asks for.

Before anything is read, the metadata is checked as a whole: every tensor's chunks tile it
exactly and its shape is one a tensor can have (``ckptstore.serialize.tiling``), every chunk
and value has one location (``_validate``), and each rank component, when opened, holds what
the metadata places in it. A checkpoint that fails is treated like a corrupt one:
``IntegrityError``, and ``load`` falls back to the previous committed checkpoint. The writer
is in ``_writer``, the reader in ``_reader``, the no-pickle planners in ``_planners`` (plain
values as JSON: ``_plainvalues``) and the metadata document in ``_metadata``; this module is
the public face.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
import weakref
from collections.abc import Iterator, Mapping
from concurrent.futures import Future as ConcurrentFuture
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import LoadPlanner, SavePlanner
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.checkpoint.stateful import Stateful

from ckptstore.errors import CheckpointNotFoundError, CkptStoreError, IntegrityError, SaveError
from ckptstore.floor import CheckpointInfo, ObjectStore, Run, WriterOptions, mark_corrupt
from ckptstore.integrations.dcp._metadata import METADATA_COMPONENT, rank_component
from ckptstore.integrations.dcp._planners import (
    NoPickleLoadPlanner,
    NoPickleSavePlanner,
    SnapshotStager,
)
from ckptstore.integrations.dcp._reader import (
    CkptStoreReader,
    is_dcp_checkpoint,
    iter_full_tensors,
    validate_checkpoint,
)
from ckptstore.integrations.dcp._writer import CkptStoreWriter

log = logging.getLogger("ckptstore.integrations.dcp")

__all__ = [
    "METADATA_COMPONENT",
    "CkptStoreReader",
    "CkptStoreWriter",
    "NoPickleLoadPlanner",
    "NoPickleSavePlanner",
    "SnapshotStager",
    "is_dcp_checkpoint",
    "iter_full_tensors",
    "load",
    "rank_component",
    "save",
    "validate_checkpoint",
]


# -- the wrappers -----------------------------------------------------------------------------

#: One stager per run (or store) object, so repeated async saves reuse their buffers.
_stagers: weakref.WeakKeyDictionary[Any, SnapshotStager] = weakref.WeakKeyDictionary()


def save(
    state_dict: dict[str, Any],
    run: Run | ObjectStore | str,
    step: int,
    *,
    process_group: dist.ProcessGroup | None = None,
    planner: SavePlanner | None = None,
    async_save: bool = False,
    stager: SnapshotStager | None = None,
    training_info: Mapping[str, Any] | None = None,
    metrics: Mapping[str, Any] | None = None,
    trigger: str = "manual",
    writer_options: WriterOptions | None = None,
    expect_changed: bool = False,
) -> CheckpointInfo | ConcurrentFuture[CheckpointInfo | None] | None:
    """Save ``state_dict`` (DTensors, tensors, plain values) from every rank as ``step``.

    Call it on every rank of the group: the coordinator (rank 0) with its writable run, the
    others with a read-only run or the store. Returns the committed checkpoint on the
    coordinator, None elsewhere. With ``async_save`` it returns once the state is copied into
    the stager's reused host buffers and the rest runs in the background: the result is a
    future of the same value (its failure is a ``SaveError``); the next save waits for it.
    A failure on any rank commits nothing and raises ``SaveError`` on every rank.

    ``expect_changed``: the state must differ from the previous committed checkpoint's. A rank
    component (``dcp/rank<r>``) that stored the same content is logged as a warning and listed
    in the committed row's ``training_info["stale_components"]`` -- ``Run.save``'s guard
    against a writer that saves stale weights.
    """
    writer = CkptStoreWriter(
        run,
        step,
        training_info=training_info,
        metrics=metrics,
        trigger=trigger,
        writer_options=writer_options,
        expect_changed=expect_changed,
    )
    planner = planner or NoPickleSavePlanner()
    what = f"the DCP save of step {step}" + (
        f" of run {run.name!r}" if isinstance(run, Run) else ""
    )
    if not async_save:
        try:
            with _single_process_ok():
                dcp_save(
                    state_dict, storage_writer=writer, planner=planner, process_group=process_group
                )
        except CheckpointException as exc:
            raise _save_error(exc, what) from None
        return writer.committed
    if stager is None:
        key = run if not isinstance(run, str) else None
        stager = _stagers.get(key) if key is not None else None
        if stager is None:
            stager = SnapshotStager()
            if key is not None:
                _stagers[key] = stager
    result: ConcurrentFuture[CheckpointInfo | None] = ConcurrentFuture()
    if _distributed():
        upload = dcp_async_save(
            state_dict,
            storage_writer=writer,
            planner=planner,
            process_group=process_group,
            async_stager=stager,
        )
    else:
        upload = _async_in_one_process(state_dict, writer, planner, stager)

    def settle(done: ConcurrentFuture[Any]) -> None:
        error = done.exception()
        stager.release()  # stored (or failed): the snapshot's memory may go
        if error is None:
            result.set_result(writer.committed)
        elif isinstance(error, CheckpointException):
            result.set_exception(_save_error(error, what))
        else:
            failure = SaveError(
                f"{what} failed: {type(error).__name__}: {error}; nothing committed"
            )
            failure.__cause__ = error
            result.set_exception(failure)

    assert isinstance(upload, ConcurrentFuture)  # the stager stages synchronously
    stager.in_flight = result
    upload.add_done_callback(settle)
    return result


def load(
    state_dict: dict[str, Any],
    run: Run,
    step: int | None = None,
    *,
    process_group: dist.ProcessGroup | None = None,
    planner: LoadPlanner | None = None,
    fallback: bool = True,
    max_workers: int = 8,
) -> CheckpointInfo:
    """Load ``step`` (default: the newest committed checkpoint) into ``state_dict`` in place,
    resharded to its layout; call it on every rank with a run (read-only is enough).

    Without a step, the coordinator picks the newest committed checkpoint and tells the others,
    so every rank loads the same one even while a writer commits newer ones. When it fails
    verification on any rank, the coordinator marks it corrupt and every rank falls back to the
    previous committed one (``fallback``).
    Returns the checkpoint that was loaded. Errors: ``IntegrityError`` (damaged data),
    ``CheckpointNotFoundError``, or the ckptstore error a rank raised.
    """
    planner = planner or NoPickleLoadPlanner()
    if step is not None:
        info = run.checkpoint(step)
        _load_one(state_dict, run, info, planner, process_group, max_workers)
        return info
    before: int | None = None
    skipped: list[int] = []
    while True:
        found = _newest_for_all(run, before, process_group)
        if found is None:
            detail = f"; skipped corrupt steps {skipped}" if skipped else ""
            raise CheckpointNotFoundError(
                f"run {run.name!r} has no committed checkpoint to load{detail}"
            )
        try:
            _load_one(state_dict, run, found, planner, process_group, max_workers)
        except IntegrityError as exc:
            if not fallback:
                raise
            if _rank(process_group) == 0:
                # Without the store check: the other ranks go on to the next checkpoint, so
                # rank 0 must not raise here alone.
                mark_corrupt(run, found, exc, check_store=False)
            skipped.append(found.step)
            before = found.step
            continue
        if skipped:
            log.warning(
                "run %r: loaded step %d after skipping corrupt %s", run.name, found.step, skipped
            )
        return found


def _newest_for_all(
    run: Run, before: int | None, process_group: dist.ProcessGroup | None
) -> CheckpointInfo | None:
    """The newest committed checkpoint (below ``before``) as the coordinator sees it, the same
    on every rank: ranks that asked the database themselves could see different ones."""
    if not _distributed():
        return run.latest(before_step=before)
    found = run.latest(before_step=before) if _rank(process_group) == 0 else None
    chosen: list[int | None] = [None if found is None else found.step]
    source = 0 if process_group is None else dist.get_global_rank(process_group, 0)
    dist.broadcast_object_list(chosen, src=source, group=process_group)
    step = chosen[0]
    if found is not None or step is None:
        return found
    return run.checkpoint(step)


def _load_one(
    state_dict: dict[str, Any],
    run: Run,
    info: CheckpointInfo,
    planner: LoadPlanner,
    process_group: dist.ProcessGroup | None,
    max_workers: int,
) -> None:
    reader = CkptStoreReader.for_checkpoint(run.store, info, max_workers=max_workers)
    reader.stored_metadata()  # a malformed document is refused here, by name, not inside DCP
    try:
        with _single_process_ok():
            dcp_load(
                state_dict, storage_reader=reader, planner=planner, process_group=process_group
            )
    except CheckpointException as exc:
        raise _load_error(exc, f"run {run.name!r} step {info.step}") from None


def _failures(exc: CheckpointException) -> list[tuple[int, BaseException]]:
    found = []
    for rank, failure in sorted(exc.failures.items()):
        error = failure[0] if isinstance(failure, tuple) else failure
        found.append((rank, error if isinstance(error, BaseException) else RuntimeError(error)))
    return found


def _summary(exc: CheckpointException) -> tuple[str, BaseException]:
    """Which ranks failed and the first rank's error, for a message; and that error."""
    failures = _failures(exc)
    rank, first = failures[0] if failures else (-1, exc)
    ranks = [r for r, _ in failures]
    return f"rank(s) {ranks}; rank {rank}: {type(first).__name__}: {first}", first


def _save_error(exc: CheckpointException, what: str) -> SaveError:
    summary, first = _summary(exc)
    error = SaveError(f"{what} failed and nothing was committed: failed on {summary}")
    error.__cause__ = first
    return error


def _load_error(exc: CheckpointException, what: str) -> CkptStoreError:
    failures = _failures(exc)
    for _, error in failures:
        if isinstance(error, IntegrityError):
            return error
    for _, error in failures:
        if isinstance(error, CkptStoreError):
            return error
    summary, first = _summary(exc)
    wrapped = CkptStoreError(f"the DCP load of {what} failed on {summary}")
    wrapped.__cause__ = first
    return wrapped


def _rank(process_group: dist.ProcessGroup | None) -> int:
    return dist.get_rank(process_group) if _distributed() else 0


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _async_in_one_process(
    state_dict: dict[str, Any],
    writer: CkptStoreWriter,
    planner: SavePlanner,
    stager: SnapshotStager,
) -> ConcurrentFuture[Any]:
    """``dcp.async_save`` without a process group: staged here, saved on a thread of its own
    -- where DCP's "assuming a single process" warning is raised, and silenced."""
    staged = stager.stage(
        {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state_dict.items()}
    )

    def save_staged() -> None:
        with _single_process_ok():
            dcp_save(staged, storage_writer=writer, planner=planner)

    executor = ThreadPoolExecutor(1, thread_name_prefix="ckpt-dcp-async")
    upload = executor.submit(save_staged)
    upload.add_done_callback(lambda _: executor.shutdown(wait=False))
    return upload


@contextlib.contextmanager
def _single_process_ok() -> Iterator[None]:
    """DCP warns that it assumes one process when torch.distributed is not initialized; in a
    single process that is what the caller means, so the warning is only noise."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield
