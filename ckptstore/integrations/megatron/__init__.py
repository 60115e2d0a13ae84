"""Megatron-Core ``dist_checkpointing`` through ckptstore: sharded save/load strategies.

Quick use (every rank; only rank 0 opens the manifest database, the others need the store)::

    from ckptstore.integrations import megatron as ckpt_megatron
    run = ckptstore.open_run(name, db=db_url, store=url) if rank == 0 else None
    sd = model.sharded_state_dict()
    ckpt_megatron.save(sd, run, step, store=url)             # or async_save=True
    state = ckpt_megatron.load(sd, run, store=url)           # newest that holds up; any TP split
    state = ckpt_megatron.load(sd, run, step, store=url)     # a given step

Rank 0 chooses what to load (the newest committed checkpoint whose metadata holds, falling past
corrupt ones) and hands the other ranks its record and metadata, so they read from the store
alone (DESIGN.md §12); in a save, they upload their shards and rank 0 commits. A Run on every
rank works too (a read-only one elsewhere): the other ranks still leave the database to rank 0.

Or, with Megatron's own entry points: ``dist_checkpointing.save(sd, dir,
sharded_strategy=CkptStoreSaveStrategy(run, step))``, and :func:`register` to make
``"ckptstore"`` a backend that ``dist_checkpointing.load`` finds through metadata.json. Those
load strategies find the checkpoint themselves, so they need a Run on every rank; :func:`load`
is the form whose other ranks need no database.

Each rank uploads the main replicas of its shards itself (``megatron/rank<r>``); rank 0
commits them with ``megatron/meta`` (metadata.json and the layout) and ``megatron/common``
(the common state dict) in one transaction, at the end of ``save`` or in the async request's
finalize function -- only if every rank succeeded (see ``_commit``). Loading reads
metadata.json and the common state from the store, never a pickle: the common state dict is
taken in memory from Megatron's own common strategy as it writes ``common.pt`` into the local
``checkpoint_dir`` (the file is never read back; ckptstore's own private directories get
none, see ``_scratch``) and stored through ckptstore's serializer; a common state that
is not plain (tensors, numbers, strings, containers) is refused. Before a load or an export
reads anything, the layout is checked as a whole (``Layout.check``: each tensor's shards tile
it exactly), and each rank component as it is opened (its entries are what the layout says).
Loading the newest checkpoint falls back past one that fails, as ``ckpt_dcp.load`` does: rank 0
checks the metadata before anything is loaded, and the ranks agree on damage found while
reading data (``_resume``; what rank 0 sends the others is in ``_choice``, which store a rank
uses in ``_targets``). The stored layout and the reader that needs no Megatron-Core
(so ``ckptstore verify`` and ``export`` work without it) are in
``ckptstore.integrations._common`` (``megatron_layout``, ``megatron_source``).
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing  # type: ignore[import-untyped]
from megatron.core.dist_checkpointing.dict_utils import (  # type: ignore[import-untyped]
    nested_values,
)
from megatron.core.dist_checkpointing.mapping import (  # type: ignore[import-untyped]
    ShardedObject,
    ShardedTensor,
    is_main_replica,
)
from megatron.core.dist_checkpointing.strategies.async_utils import (  # type: ignore[import-untyped]
    AsyncRequest,
)
from megatron.core.dist_checkpointing.strategies.base import (  # type: ignore[import-untyped]
    AsyncSaveShardedStrategy,
    SaveCommonStrategy,
    StrategyAction,
    get_default_strategy,
    register_default_strategy,
)

from ckptstore.errors import ConfigError, SerializationError
from ckptstore.extending import CheckpointInfo, ObjectStore, Run, check_savable
from ckptstore.integrations._common.megatron_layout import (
    META,
    SHARD_PREFIX,
    Layout,
    ObjectShard,
    TensorShard,
    tensor_shard,
)
from ckptstore.integrations._common.megatron_source import Source, validate_checkpoint
from ckptstore.integrations.megatron import _scratch as scratch
from ckptstore.integrations.megatron._commit import (
    Commit,
    Outcome,
    StoreSpec,
    describe,
    finish_save,
    read_outcome,
    upload,
    upload_to_file,
)
from ckptstore.integrations.megatron._load import (
    BACKEND,
    BACKEND_VERSION,
    CONFIG,
    CkptStoreLoadCommonStrategy,
    CkptStoreLoadStrategy,
    StepOf,
    iteration_of,
)
from ckptstore.integrations.megatron._resume import load_chosen
from ckptstore.integrations.megatron._targets import rank_store, save_target, store_of

__all__ = [
    "BACKEND",
    "BACKEND_VERSION",
    "CkptStoreLoadCommonStrategy",
    "CkptStoreLoadStrategy",
    "CkptStoreSaveStrategy",
    "is_megatron_checkpoint",
    "iter_full_tensors",
    "iteration_of",
    "load",
    "register",
    "save",
    "validate_checkpoint",
]


def _local_shards(
    sharded_state_dict: Any, rank: int, *, snapshot: bool
) -> tuple[dict[str, Any], Layout]:
    """This rank's main replicas as one component's state, and their layout records."""
    component = f"{SHARD_PREFIX}{rank}"
    state: dict[str, Any] = {}
    tensors: list[TensorShard] = []
    objects: list[ObjectShard] = []
    for item in nested_values(sharded_state_dict):
        if isinstance(item, ShardedTensor) and is_main_replica(item.replica_id):
            path = f"t{len(tensors)}"
            record = tensor_shard(item, component, path)
            data = item.data.detach().reshape(record.shape)
            state[path] = data.to("cpu", copy=True) if snapshot else data
            tensors.append(record)
        elif isinstance(item, ShardedObject) and is_main_replica(item.replica_id):
            path = f"o{len(objects)}"
            state[path] = item.data
            shape, offset = tuple(item.global_shape), tuple(item.global_offset)
            objects.append(ObjectShard(item.key, component, path, shape, offset))
        elif not isinstance(item, (ShardedTensor, ShardedObject)):
            raise ConfigError(
                f"the sharded state dict holds a {type(item).__name__}; the ckptstore strategy "
                "saves ShardedTensors and ShardedObjects"
            )
    return state, Layout(tuple(tensors), tuple(objects))


class _KeepCommonStrategy(SaveCommonStrategy):  # type: ignore[misc]
    """Megatron's own common strategy, which also hands the common state dict to ckptstore's
    save strategy in memory: ``common.pt`` is written for Megatron's tools as before (except in
    ckptstore's private directories, where no tool would look), and is never read back
    (Megatron's ``save`` accepts no other common strategy than its default)."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner.backend, inner.version)
        self.inner = inner

    def save_common(self, common_state_dict: Any, checkpoint_dir: str | Path) -> None:
        """Keep a copy of the common state for this save's commit, then save it as Megatron does
        -- unless the directory is ckptstore's own, which a killed rank could leave behind."""
        if dist.get_rank() == 0:
            _kept_common[os.path.abspath(checkpoint_dir)] = copy.deepcopy(common_state_dict)
        if not scratch.is_private(checkpoint_dir):
            self.inner.save_common(common_state_dict, checkpoint_dir)

    def save_sharded_objects(self, sharded_objects_state_dict: Any, checkpoint_dir: Any) -> None:
        """As Megatron's own strategy does."""
        self.inner.save_sharded_objects(sharded_objects_state_dict, checkpoint_dir)

    @property
    def can_handle_sharded_objects(self) -> bool:
        """As Megatron's own strategy."""
        return bool(self.inner.can_handle_sharded_objects)


#: checkpoint_dir -> the common state dict Megatron saved there in this process (rank 0).
_kept_common: dict[str, Any] = {}


def _keep_common_states() -> None:
    """Put :class:`_KeepCommonStrategy` in front of Megatron's default common strategy (once)."""
    current = get_default_strategy(StrategyAction.SAVE_COMMON, "torch", 1)
    if not isinstance(current, _KeepCommonStrategy):
        register_default_strategy(
            StrategyAction.SAVE_COMMON, "torch", 1, _KeepCommonStrategy(current)
        )


def _take_common(checkpoint_dir: str) -> Any:
    """The common state Megatron just saved to ``checkpoint_dir`` (None if it saved none),
    checked to be plain data ckptstore can store."""
    common = _kept_common.pop(os.path.abspath(checkpoint_dir), None)
    if common is not None:
        try:
            check_savable(common)
        except SerializationError as exc:
            raise ConfigError(
                f"Megatron's common state dict holds objects that are not plain data ({exc}); "
                "ckptstore stores tensors, numbers, strings and containers only -- convert the "
                "rest (e.g. argparse.Namespace -> vars(args)) before saving"
            ) from None
    return common


class CkptStoreSaveStrategy(AsyncSaveShardedStrategy):  # type: ignore[misc]
    """Megatron save strategy (sync and async) that stores shards and commits through ckptstore.

    ``target``: a writable :class:`Run` on rank 0; a run, store or store URL on other ranks.
    ``step``: the checkpoint's step; None takes it from ``checkpoint_dir`` with ``step_of``.
    ``expect_changed``: as for :func:`save`.
    """

    def __init__(
        self,
        target: Run | ObjectStore | str,
        step: int | None = None,
        *,
        training_info: dict[str, Any] | None = None,
        metrics: dict[str, Any] | None = None,
        step_of: StepOf = iteration_of,
        expect_changed: bool = False,
    ) -> None:
        super().__init__(BACKEND, BACKEND_VERSION)
        _keep_common_states()
        self.run = target if isinstance(target, Run) else None
        self.store = store_of(target)
        self.step = step
        self.training_info = training_info
        self.metrics = metrics
        self.step_of = step_of
        self.expect_changed = expect_changed

    @property
    def can_handle_sharded_objects(self) -> bool:
        """ShardedObjects are stored with the tensors (through ckptstore's serializer)."""
        return True

    def save(self, sharded_state_dict: Any, checkpoint_dir: str | Path) -> None:
        """Store this rank's shards, then commit on rank 0 (collective; SaveError on failure)."""
        rank, commit = dist.get_rank(), self._commit(str(checkpoint_dir))
        try:
            state, layout = _local_shards(sharded_state_dict, rank, snapshot=False)
            outcome = upload(self.store, f"{SHARD_PREFIX}{rank}", state, rank, layout.to_json())
        except Exception as exc:
            outcome = Outcome(rank, error=describe(exc))
        finish_save(_with_error(outcome, commit), commit, CONFIG)

    def async_save(self, sharded_state_dict: Any, checkpoint_dir: str | Path) -> Any:
        """Snapshot this rank's shards to host memory and return Megatron's AsyncRequest: the
        upload runs in Megatron's background process, the commit in its finalize function."""
        rank, commit = dist.get_rank(), self._commit(str(checkpoint_dir))
        workdir = scratch.private_dir("async")
        result = os.path.join(workdir, "outcome.json")
        try:
            state, layout = _local_shards(sharded_state_dict, rank, snapshot=True)
            args = (StoreSpec.of(self.store), f"{SHARD_PREFIX}{rank}", state, rank)
            request = AsyncRequest(upload_to_file, (*args, layout.to_json(), result), [])
            failed: Outcome | None = None
        except Exception as exc:
            request, failed = AsyncRequest(None, (), []), Outcome(rank, error=describe(exc))

        def finalize() -> None:
            try:
                outcome = failed or read_outcome(result, rank)
            finally:
                scratch.remove(workdir)
            finish_save(_with_error(outcome, commit), commit, CONFIG)

        request.add_finalize_fn(finalize)
        return request

    def _commit(self, checkpoint_dir: str) -> Commit:
        """The step, and on rank 0 the run and the common state, for this save."""
        step = self.step if self.step is not None else self.step_of(checkpoint_dir)
        if step is None:
            raise ConfigError(
                f"no step for the Megatron save to {checkpoint_dir!r}: name the directory "
                "iter_<step> or pass CkptStoreSaveStrategy(run, step)"
            )
        commit = Commit(
            step,
            self.run,
            None,
            self.training_info,
            self.metrics,
            expect_changed=self.expect_changed,
        )
        if dist.get_rank() == 0:
            try:
                commit.common = _take_common(checkpoint_dir)
            except ConfigError as exc:
                commit.error = str(exc)
        return commit


def _with_error(outcome: Outcome, commit: Commit) -> Outcome:
    """``outcome``, failed with rank 0's own preparation error if it had one."""
    if commit.error is None or outcome.error is not None:
        return outcome
    return Outcome(outcome.rank, outcome.layout, None, commit.error)


def register(target: Run | ObjectStore | str, *, step_of: StepOf = iteration_of) -> None:
    """Make ``"ckptstore"`` a Megatron backend bound to ``target``: save with
    ``sharded_strategy=("ckptstore", 1)``; ``dist_checkpointing.load`` then finds it through
    metadata.json (load needs a Run). The step comes from the directory name (``step_of``)."""
    save_strategy = CkptStoreSaveStrategy(target, step_of=step_of)
    register_default_strategy(StrategyAction.SAVE_SHARDED, BACKEND, BACKEND_VERSION, save_strategy)
    if isinstance(target, Run):
        for action, cls in (
            (StrategyAction.LOAD_SHARDED, CkptStoreLoadStrategy),
            (StrategyAction.LOAD_COMMON, CkptStoreLoadCommonStrategy),
        ):
            register_default_strategy(
                action, BACKEND, BACKEND_VERSION, cls(target, step_of=step_of)
            )


def save(
    sharded_state_dict: Any,
    target: Run | ObjectStore | str | None,
    step: int,
    *,
    store: ObjectStore | str | None = None,
    checkpoint_dir: str | None = None,
    async_save: bool = False,
    training_info: dict[str, Any] | None = None,
    metrics: dict[str, Any] | None = None,
    validate_access_integrity: bool = True,
    expect_changed: bool = False,
) -> Any:
    """Save a Megatron sharded state dict as checkpoint ``step`` (collective, every rank).

    ``target`` as for :class:`CkptStoreSaveStrategy`: the writable Run on rank 0 (which
    commits); on the other ranks a run, a store or its URL -- or None and ``store=``, so the
    same call serves every rank: ``save(sd, run if rank == 0 else None, step, store=url)``.
    Only rank 0 touches the database. A run and ``store=`` together must name the same
    store (else ConfigError, on that rank, before anything is saved). Megatron's local files go to
    ``checkpoint_dir`` (default: a private directory under ``$TMPDIR``, removed afterwards --
    or, if this process is killed, by the next save or load on this host). Returns None, or
    with ``async_save`` Megatron's ``AsyncRequest`` to schedule (``AsyncCallsQueue``); its
    finalize functions commit.

    ``expect_changed``: the state must differ from the previous committed checkpoint's. A rank
    component (``megatron/rank<r>``) that stored the same shards is logged as a warning and
    listed in the committed row's ``training_info["stale_components"]`` -- ``Run.save``'s
    guard against a writer that saves stale weights.
    """
    strategy = CkptStoreSaveStrategy(
        save_target(target, store),
        step,
        training_info=training_info,
        metrics=metrics,
        expect_changed=expect_changed,
    )
    directory = checkpoint_dir or scratch.private_dir("save")

    def cleanup() -> None:
        if checkpoint_dir is None:
            scratch.remove(directory)

    try:
        request = dist_checkpointing.save(
            sharded_state_dict,
            directory,
            sharded_strategy=strategy,
            async_sharded_save=async_save,
            validate_access_integrity=validate_access_integrity,
        )
    except BaseException:
        cleanup()
        raise
    if request is None:
        cleanup()
    else:
        request.add_finalize_fn(cleanup)
    return request


def load(
    sharded_state_dict: Any,
    run: Run | None,
    step: int | None = None,
    *,
    store: ObjectStore | str | None = None,
    checkpoint_dir: str | None = None,
    strict: Any = "assume_ok_unexpected",
    fallback: bool = True,
) -> Any:
    """Load checkpoint ``step`` into the split the sharded state dict asks for (collective,
    every rank); returns Megatron's loaded state dict.

    Only rank 0 opens the manifest: it needs the ``run``; any other rank may pass None and
    ``store=`` (the store URL or an open store; a URL is opened and closed here) and never
    touches the database. Rank 0 chooses the checkpoint and hands the others its record and
    metadata. A rank that passes a run and ``store=`` too must name the run's store. Wrong
    arguments on any rank raise ``ConfigError`` on every rank before anything is read.

    Without a step, rank 0 picks the newest committed checkpoint and every rank loads that one.
    When it fails verification -- metadata that rank 0 finds wrong before anything is loaded,
    or damaged data any rank finds while loading -- rank 0 marks it corrupt (a writable run;
    a read-only one only reports) and every rank falls back to the previous committed one
    (``fallback``; ``CheckpointNotFoundError`` when none is left).

    metadata.json is staged from the store into ``checkpoint_dir`` (default: a private
    directory, as for :func:`save`); anything else in that directory, a ``common.pt``
    included, is never read.
    """

    def attempt(source: Source) -> Any:
        return _load_source(sharded_state_dict, source, checkpoint_dir, strict)

    reading: ObjectStore | None = None
    opened: ObjectStore | None = None
    problem: str | None = None
    try:
        reading, opened = rank_store(run, store)
    except ConfigError as exc:
        problem = str(exc)
    try:
        return load_chosen(run, reading, step, attempt, fallback=fallback, problem=problem)
    finally:
        if opened is not None:
            opened.close()


def _load_source(
    sharded_state_dict: Any, source: Source, checkpoint_dir: str | None, strict: Any
) -> Any:
    """Megatron's load of the checkpoint ``source`` opens (collective, every rank)."""
    sharded = CkptStoreLoadStrategy._over(source)
    common = CkptStoreLoadCommonStrategy._over(source)
    directory = checkpoint_dir or scratch.private_dir("load")
    try:
        with open(os.path.join(directory, "metadata.json"), "w", encoding="utf-8") as out:
            json.dump(source.config, out)
        return dist_checkpointing.load(
            sharded_state_dict,
            directory,
            sharded_strategy=sharded,
            common_strategy=common,
            strict=strict,
        )
    finally:
        if checkpoint_dir is None:
            scratch.remove(directory)


def iter_full_tensors(
    store: ObjectStore, info: CheckpointInfo
) -> Iterator[tuple[str, torch.Tensor]]:
    """The whole (consolidated) tensors of a Megatron checkpoint, by ShardedTensor key."""
    return Source(store, info).full_tensors()


def is_megatron_checkpoint(info: CheckpointInfo) -> bool:
    """Whether ``info`` was saved through this module (it has a ``megatron/meta`` component)."""
    return any(component.name == META for component in info.components)
