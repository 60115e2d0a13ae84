"""Loading through DCP (see :mod:`ckptstore.integrations.dcp`): only the coordinator asks the
manifest which checkpoint to load; every other rank reads it from the store alone.

One load is a sequence of rounds, each a single ``all_gather_object`` of small plain tuples
(never a ckptstore object, never anything read from storage), so every rank reaches the same
verdict and none waits for a rank that has already raised:

1. **The plan.** Rank 0 with its run resolves a :class:`LoadPlan` (``plan_load``) and sends it
   as JSON; the other ranks send the step they asked for, if any. Or every rank sends the key
   of the plan it was handed. Any rank's error (a missing ``store=``, no checkpoint) is raised
   on every rank.
2. **The metadata.** Every rank fetches and checks the metadata document before DCP starts
   (inside DCP, a failure would lose its type). A rank other than 0 that cannot read the
   document rank 0 verified reads another store: nothing is marked corrupt for it.
3. DCP's load itself; its failures reach every rank through DCP's own collectives. On an
   ``IntegrityError`` rank 0 marks the checkpoint corrupt and starts over at 1 with the one
   before it (or says "stop": a step was asked for, or ``fallback=False``). With plans handed
   in by the caller there is no step 3 fallback: the caller drives it.
"""

from __future__ import annotations

import contextlib
import logging
from types import TracebackType
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import LoadPlanner
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from ckptstore import errors
from ckptstore.errors import (
    CheckpointNotFoundError,
    CkptStoreError,
    ConfigError,
    IntegrityError,
    StoreNotFoundError,
    UnreadableError,
)
from ckptstore.extending import CheckpointInfo, ObjectStore, Run, mark_corrupt, open_store
from ckptstore.integrations.dcp._dist import distributed, failures, rank, single_process_ok, summary
from ckptstore.integrations.dcp._plan import LoadPlan
from ckptstore.integrations.dcp._planners import NoPickleLoadPlanner
from ckptstore.integrations.dcp._reader import CkptStoreReader

log = logging.getLogger("ckptstore.integrations.dcp")

#: A message of one round: ("plan", plan JSON, step asked) from rank 0; ("follow", step asked)
#: from a rank that follows it; ("given", [run, step, digest]) from a rank handed a plan;
#: ("stop",) from rank 0 that does not fall back; ("ok",); ("error", class, text, digest).
Message = tuple[Any, ...]


def plan_load(
    run: Run, step: int | None = None, *, before_step: int | None = None, fallback: bool = True
) -> LoadPlan:
    """The coordinator's half of a load: the newest committed checkpoint of ``run`` (below
    ``before_step``, if given), or ``step``, with its metadata document fetched and checked as
    a whole (every tensor's chunks tile it, every chunk and value has one location).

    A checkpoint whose document fails is marked corrupt (``mark_corrupt``) and the one before
    it is planned (``fallback``; never past an asked ``step``: its ``IntegrityError`` is
    raised). ``CheckpointNotFoundError`` when none is left. Hand the plan to every rank of the
    load (``load(state_dict, plan, store=...)``; ``plan.to_json()`` travels anywhere)."""
    plan, reader = _plan(run, step, before_step, fallback, [], 1)
    reader.close()
    return plan


def load(
    state_dict: dict[str, Any],
    source: Run | LoadPlan | None,
    step: int | None = None,
    *,
    store: ObjectStore | str | None = None,
    process_group: dist.ProcessGroup | None = None,
    planner: LoadPlanner | None = None,
    fallback: bool = True,
    max_workers: int = 8,
    share: bool | None = None,
) -> CheckpointInfo:
    """Load a committed checkpoint into ``state_dict`` in place, resharded to its layout; call
    it on every rank of the group. Returns the checkpoint that was loaded, on every rank.

    ``source``, the same kind on every rank:

    - a ``Run`` on rank 0 (read-only is enough), and on the others a ``Run`` or None: rank 0
      alone asks the manifest -- ``step``, else the newest committed checkpoint -- and tells
      the others, which read from their run's store, or from ``store`` (an ``ObjectStore`` or
      its URL; required with None) and never open the database. When the checkpoint fails
      verification on any rank, rank 0 marks it corrupt and every rank falls back to the
      previous committed one (``fallback``; never past an asked ``step``). Rank 0's ``step``
      and ``fallback`` decide; another rank's ``step``, if given, must be the same.
    - a :class:`LoadPlan` (``plan_load``), the same on every rank: no rank opens the database;
      each reads from ``store``, else the plan's ``store_url``. A damaged checkpoint raises
      ``IntegrityError`` on every rank: whoever planned it marks it corrupt and plans again.

    ``share``: read once (``CkptStoreReader.share``): a blob several ranks need is read from
    the store by one of them and sent to the others over the group (gloo). None (the default):
    on when the store is remote (S3, GCS, Azure); True also for a local directory (data-parallel
    replicas on several nodes sharing one file system), False never. Rank 0's decides (DCP plans
    the load there).

    One process alone passes a ``Run`` or a ``LoadPlan``. Errors, raised on every rank:
    ``IntegrityError`` (damaged data), ``CheckpointNotFoundError``, ``ConfigError`` (a
    source or store that cannot work, naming the fix), or the ckptstore error a rank raised.
    """
    planner = planner or NoPickleLoadPlanner()
    with _Load(source, step, store, process_group, fallback, max_workers) as coordinated:
        reader = coordinated.start()
        while True:
            try:
                reader.share = share
                _read(state_dict, reader, coordinated.current(), planner, process_group)
            except IntegrityError as exc:
                reader = coordinated.after(exc)
                continue
            return coordinated.done()


class _Load:
    """One rank's part in the rounds of one load (see the module docstring)."""

    def __init__(
        self,
        source: Run | LoadPlan | None,
        step: int | None,
        store: ObjectStore | str | None,
        process_group: dist.ProcessGroup | None,
        fallback: bool,
        max_workers: int,
    ) -> None:
        self.source = source
        self.step = step
        self.store_arg = store
        self.process_group = process_group
        self.fallback = fallback
        self.max_workers = max_workers
        self.rank = rank(process_group)
        self.given = isinstance(source, LoadPlan)
        self.skipped: list[int] = []
        self.plan: LoadPlan | None = None
        self.store: ObjectStore | None = None
        self._opened = contextlib.ExitStack()

    def __enter__(self) -> _Load:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._opened.close()

    def current(self) -> LoadPlan:
        """The plan every rank agreed on."""
        assert self.plan is not None
        return self.plan

    def start(self) -> CkptStoreReader:
        """Rounds 1 and 2 of the first attempt: the agreed plan's reader, metadata checked."""
        reader = None
        try:
            self.store = self._open_store()
            if isinstance(self.source, LoadPlan):
                message: Message = ("given", _key(self.source))
            elif self.rank == 0:
                assert isinstance(self.source, Run)
                plan, reader = _plan(
                    self.source, self.step, None, self.fallback, self.skipped, self.max_workers
                )
                message = ("plan", plan.to_json(), self.step)
            else:
                message = ("follow", self.step)
        except Exception as error:
            return self._round(_error_message(error), error, None)
        return self._round(message, None, reader)

    def after(self, damage: IntegrityError) -> CkptStoreReader:
        """The agreed plan failed verification: raise ``damage`` everywhere, or fall back."""
        if self.given:
            raise damage  # every rank has it (DCP shares failures): the caller drives
        plan = self.current()
        reader = None
        message: Message = ("follow", None)
        if self.rank == 0:
            assert isinstance(self.source, Run)
            if self.step is not None or not self.fallback:
                message = ("stop",)
            else:
                try:
                    mark_corrupt(self.source, plan.info, damage)
                    self.skipped.append(plan.step)
                    nxt, reader = _plan(
                        self.source, None, plan.step, True, self.skipped, self.max_workers
                    )
                    message = ("plan", nxt.to_json(), None)
                except Exception as error:
                    return self._round(_error_message(error), error, None, damage)
        return self._round(message, None, reader, damage)

    def done(self) -> CheckpointInfo:
        """The loaded checkpoint (and, on rank 0, a word about the ones skipped)."""
        plan = self.current()
        if self.skipped:
            log.warning(
                "run %r: loaded step %d after skipping corrupt %s",
                plan.run,
                plan.step,
                self.skipped,
            )
        return plan.info

    def _round(
        self,
        message: Message,
        error: BaseException | None,
        reader: CkptStoreReader | None,
        damage: IntegrityError | None = None,
    ) -> CkptStoreReader:
        messages = _gather(message, self.process_group)
        _raise_any(messages, error)
        if damage is not None and messages[0] == ("stop",):
            raise damage
        self.plan = self._agreed(messages)
        if reader is None:
            assert self.store is not None
            reader = CkptStoreReader.for_plan(self.store, self.plan, max_workers=self.max_workers)
        self._check_metadata(reader)
        return reader

    def _agreed(self, messages: list[Message]) -> LoadPlan:
        """The plan every rank loads, decided from every rank's message alike."""
        given = [r for r, m in enumerate(messages) if m[0] == "given"]
        if given and len(given) < len(messages):
            others = [r for r in range(len(messages)) if r not in given]
            raise ConfigError(
                f"DCP load: ranks {given} passed a LoadPlan and ranks {others} did not; pass "
                "the same LoadPlan on every rank, or a Run on rank 0 and a Run or None (with "
                "store=) on the others"
            )
        if given:
            differ = [r for r, m in enumerate(messages) if m[1] != messages[0][1]]
            if differ:
                raise ConfigError(
                    f"DCP load: the ranks were handed different LoadPlans (rank 0: "
                    f"{messages[0][1]}, rank {differ[0]}: {messages[differ[0]][1]}); hand "
                    "every rank the same plan"
                )
            assert isinstance(self.source, LoadPlan)
            return self.source
        asked = messages[0][2]
        for r, m in enumerate(messages[1:], 1):
            if m[1] is not None and m[1] != asked:
                wanted = "the newest checkpoint" if asked is None else f"step {asked}"
                raise ConfigError(
                    f"DCP load: rank {r} asked for step {m[1]} and rank 0 for {wanted}; every "
                    "rank loads what rank 0 resolves: pass the same step on every rank, or "
                    "step= on rank 0 alone"
                )
        return LoadPlan.from_json(messages[0][1])

    def _check_metadata(self, reader: CkptStoreReader) -> None:
        """Round 2: every rank has the metadata document, checked, before DCP starts."""
        error: BaseException | None = None
        try:
            reader.stored_metadata()
        except Exception as exc:
            error = exc
            if isinstance(exc, IntegrityError) and not self.given and self.rank != 0:
                error = self._not_rank0s_store(exc)
        _raise_any(
            _gather(("ok",) if error is None else _error_message(error), self.process_group), error
        )

    def _not_rank0s_store(self, exc: IntegrityError) -> StoreNotFoundError:
        plan, store = self.current(), self.store
        assert store is not None
        error = StoreNotFoundError(
            f"rank {self.rank} cannot read the DCP metadata of run {plan.run!r} step "
            f"{plan.step} that rank 0 read and verified ({type(exc).__name__}: {exc}); it reads "
            f"{store.url}: every rank must read rank 0's store -- check its store=. Nothing "
            "was marked corrupt."
        )
        error.__cause__ = exc
        return error

    def _open_store(self) -> ObjectStore:
        """Where this rank reads: its run's store, ``store=``, or a given plan's store URL."""
        source, store = self.source, self.store_arg
        if isinstance(source, Run):
            return source.store
        if not isinstance(source, LoadPlan) and source is not None:
            raise ConfigError(
                f"ckpt_dcp.load(state_dict, source): source is a Run, a LoadPlan or None, not "
                f"{type(source).__name__}"
            )
        if source is None and self.rank == 0:
            raise ConfigError(
                "ckpt_dcp.load: rank 0 (or a single process) passed no run: it resolves the "
                "checkpoint, so pass it the Run (ckptstore.open_run(name, writable=False) is "
                "enough), or hand every rank the same plan from ckpt_dcp.plan_load(run)"
            )
        if source is None and store is None:
            raise ConfigError(
                f"ckpt_dcp.load on rank {self.rank} with no run: it reads the checkpoint rank 0 "
                "resolves from the object store alone -- pass store= (an ObjectStore or the URL "
                "of rank 0's run's store)"
            )
        if store is None:
            assert isinstance(source, LoadPlan)
            store = source.store_url
            if store is None:
                raise ConfigError(
                    f"the load plan of run {source.run!r} step {source.step} names no store: "
                    "pass store= (an ObjectStore or its URL)"
                )
        if isinstance(store, ObjectStore):
            return store
        return self._opened.enter_context(contextlib.closing(open_store(store)))


def _plan(
    run: Run,
    step: int | None,
    before: int | None,
    fallback: bool,
    skipped: list[int],
    max_workers: int,
) -> tuple[LoadPlan, CkptStoreReader]:
    """The plan and a reader of it whose metadata is fetched and checked; a checkpoint whose
    metadata fails is marked corrupt and skipped (into ``skipped``) when falling back."""
    if step is not None and before is not None:
        raise ConfigError("plan_load: pass step= or before_step=, not both")
    while True:
        info = run.checkpoint(step) if step is not None else run.latest(before_step=before)
        if info is None:
            below = "" if before is None else f" below step {before}"
            detail = f"; skipped corrupt steps {skipped}" if skipped else ""
            raise CheckpointNotFoundError(
                f"run {run.name!r} has no committed checkpoint to load{below}{detail}"
            )
        plan = LoadPlan(info, run.store.url)
        # A run with node-local tiers reads the metadata from its nearest copy.
        reader = CkptStoreReader.for_plan(run.source(info), plan, max_workers=max_workers)
        try:
            reader.stored_metadata()
        except IntegrityError as exc:
            if step is not None or not fallback:
                raise
            mark_corrupt(run, info, exc)
            skipped.append(info.step)
            before = info.step
            continue
        return plan, reader


def _read(
    state_dict: dict[str, Any],
    reader: CkptStoreReader,
    plan: LoadPlan,
    planner: LoadPlanner,
    process_group: dist.ProcessGroup | None,
) -> None:
    reader.process_group = process_group  # where read-once sends the blobs ranks share
    try:
        with single_process_ok():
            dcp_load(
                state_dict, storage_reader=reader, planner=planner, process_group=process_group
            )
    except CheckpointException as exc:
        raise _load_error(exc, f"run {plan.run!r} step {plan.step}") from None


def _load_error(exc: CheckpointException, what: str) -> CkptStoreError:
    found = failures(exc)
    for _, error in found:
        if isinstance(error, IntegrityError):
            return error
    for _, error in found:
        if isinstance(error, CkptStoreError):
            return error
    text, first = summary(exc)
    wrapped = CkptStoreError(f"the DCP load of {what} failed on {text}")
    wrapped.__cause__ = first
    return wrapped


def _gather(message: Message, process_group: dist.ProcessGroup | None) -> list[Message]:
    """Every rank's message, by rank (this one's alone in one process)."""
    if not distributed():
        return [message]
    messages: list[Any] = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(messages, message, group=process_group)
    return messages


def _key(plan: LoadPlan) -> list[Any]:
    return [plan.run, plan.step, plan.metadata_digest]


def _error_message(error: BaseException) -> Message:
    """An error as plain values: the nearest ckptstore error class it is, its text, digest."""
    kind = next(
        (c.__name__ for c in type(error).__mro__ if getattr(errors, c.__name__, None) is c),
        None,
    )
    text = str(error) if kind is not None else f"{type(error).__name__}: {error}"
    digest = getattr(error, "digest", None)
    return (
        "error",
        kind or CkptStoreError.__name__,
        text,
        digest if isinstance(digest, str) else None,
    )


def _raise_any(messages: list[Message], own: BaseException | None) -> None:
    """This rank's own error; else the first error another rank sent, as its class."""
    if own is not None:
        raise own
    for r, message in enumerate(messages):
        if message[0] == "error":
            _, kind, text, digest = message
            cls = getattr(errors, kind, None)
            if not (isinstance(cls, type) and issubclass(cls, CkptStoreError)):
                cls, text = CkptStoreError, f"{kind}: {text}"
            error = cls(f"on rank {r}: {text}")
            if isinstance(error, IntegrityError | UnreadableError):
                error.digest = digest
            raise error
