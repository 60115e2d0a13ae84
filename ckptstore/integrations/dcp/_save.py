"""Saving through DCP (see :mod:`ckptstore.integrations.dcp`): :func:`save` commits on the
coordinator; :func:`save_shards` only uploads and hands the receipts to a caller that commits.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from concurrent.futures import Future as ConcurrentFuture
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Generic, TypeVar

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import SavePlanner
from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.checkpoint.stateful import Stateful

from ckptstore.errors import SaveError
from ckptstore.extending import CheckpointInfo, ObjectStore, Run, ShardReceipt, WriterOptions
from ckptstore.integrations.dcp._dist import distributed, single_process_ok, summary
from ckptstore.integrations.dcp._planners import NoPickleSavePlanner, SnapshotStager
from ckptstore.integrations.dcp._writer import CkptStoreWriter

T = TypeVar("T")

#: One stager per run (or store) object, so repeated async saves reuse their buffers.
_stagers: weakref.WeakKeyDictionary[Any, SnapshotStager] = weakref.WeakKeyDictionary()

_NOT_COMMITTED = "nothing was committed"
_NO_RECEIPTS = "no receipts were returned: nothing from it can be committed, save again"


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
    what = f"the DCP save of step {step}" + (
        f" of run {run.name!r}" if isinstance(run, Run) else ""
    )
    outcome = _Outcome(writer, what, _NOT_COMMITTED, lambda: writer.committed)
    key = run if not isinstance(run, str) else None
    return _start(state_dict, outcome, process_group, planner, async_save, stager, key)


def save_shards(
    state_dict: dict[str, Any],
    store: ObjectStore | str,
    *,
    process_group: dist.ProcessGroup | None = None,
    planner: SavePlanner | None = None,
    async_save: bool = False,
    stager: SnapshotStager | None = None,
    writer_options: WriterOptions | None = None,
) -> list[ShardReceipt] | ConcurrentFuture[list[ShardReceipt]]:
    """Upload ``state_dict`` from every rank as :func:`save` does, and commit nothing.

    Call it on every rank of the group with the store (or its URL); no rank needs a run or
    the database. Each rank stores its items as ``dcp/rank<r>``; the coordinator (rank 0)
    also stores DCP's metadata as ``dcp/metadata`` and returns every receipt (the rank
    components', then the metadata's); the other ranks return ``[]``. Whoever commits -- rank 0
    itself, or a controller that is no rank, given the receipts (``receipt_to_json``) --
    calls ``run.save(step, {...its own components...}, receipts=receipts)``; that checkpoint
    loads, verifies and shows as one :func:`save` committed. Pass ``expect_changed=[r.component
    for r in receipts if r.component != "dcp/metadata"]`` there for :func:`save`'s guard.

    With ``async_save`` it returns once the state is staged (as :func:`save`): a future of the
    same list, whose failure is a ``SaveError``; a failure on any rank fails it on every rank
    and leaves no receipts. In a group the upload's collectives run on a background thread:
    when training also runs collectives on the default group, pass a separate gloo group for
    the checkpoint's (``process_group=dist.new_group(backend="gloo")``), so the two never
    interleave on one group.
    """
    writer = CkptStoreWriter(store, writer_options=writer_options, commit=False)
    outcome = _Outcome(writer, "the DCP shard save", _NO_RECEIPTS, lambda: list(writer.receipts))
    key = store if isinstance(store, ObjectStore) else None
    return _start(state_dict, outcome, process_group, planner, async_save, stager, key)


class _Outcome(Generic[T]):
    """One save's writer, what a failure message says, and what the caller gets back."""

    def __init__(
        self, writer: CkptStoreWriter, what: str, consequence: str, result: Callable[[], T]
    ) -> None:
        self.writer = writer
        self.what = what
        self.consequence = consequence
        self.result = result

    def failure(self, error: BaseException) -> SaveError:
        """The ``SaveError`` every rank raises for ``error``."""
        if isinstance(error, CheckpointException):
            text, first = summary(error)
            failure = SaveError(f"{self.what} failed and {self.consequence}: failed on {text}")
            failure.__cause__ = first
            return failure
        failure = SaveError(
            f"{self.what} failed: {type(error).__name__}: {error}; {self.consequence}"
        )
        failure.__cause__ = error
        return failure


def _start(
    state_dict: dict[str, Any],
    outcome: _Outcome[T],
    process_group: dist.ProcessGroup | None,
    planner: SavePlanner | None,
    async_save: bool,
    stager: SnapshotStager | None,
    key: Any,
) -> T | ConcurrentFuture[T]:
    """Run the save now, or stage it and run the rest in the background (a future)."""
    planner = planner or NoPickleSavePlanner()
    writer = outcome.writer
    if not async_save:
        try:
            with single_process_ok():
                dcp_save(
                    state_dict, storage_writer=writer, planner=planner, process_group=process_group
                )
        except CheckpointException as exc:
            raise outcome.failure(exc) from None
        return outcome.result()
    if stager is None:
        stager = _stagers.get(key) if key is not None else None
        if stager is None:
            stager = SnapshotStager()
            if key is not None:
                _stagers[key] = stager
    result: ConcurrentFuture[T] = ConcurrentFuture()
    if distributed():
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
            result.set_result(outcome.result())
        else:
            result.set_exception(outcome.failure(error))

    assert isinstance(upload, ConcurrentFuture)  # the stager stages synchronously
    stager.in_flight = result
    upload.add_done_callback(settle)
    return result


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
        with single_process_ok():
            dcp_save(staged, storage_writer=writer, planner=planner)

    executor = ThreadPoolExecutor(1, thread_name_prefix="ckpt-dcp-async")
    upload = executor.submit(save_staged)
    upload.add_done_callback(lambda _: executor.shutdown(wait=False))
    return upload
