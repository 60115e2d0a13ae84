"""The DCP ``StorageWriter`` of :mod:`ckptstore.integrations.dcp`: every rank stores its items
as one component, ``dcp/rank<r>``, and the coordinator commits them with the metadata -- or,
with ``commit=False``, stores the metadata as one more component and hands every receipt to a
caller that commits them itself (``Run.save(step, ..., receipts=...)``)."""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ckptstore.errors import CkptStoreError, ConfigError, SaveError, SerializationError
from ckptstore.extending import (
    CheckpointInfo,
    ObjectStore,
    Run,
    ShardReceipt,
    ShardWriter,
    WriterOptions,
    check_step,
    open_store,
    parse_step_id,
)
from ckptstore.integrations.dcp._metadata import (
    METADATA_COMPONENT,
    METADATA_FORMAT,
    Location,
    encode_metadata,
    rank_component,
)
from ckptstore.integrations.dcp._plainvalues import decode_plain


@dataclass(frozen=True, slots=True)
class _RankPlan:
    """What the coordinator tells each rank: its place in the group."""

    rank: int


@dataclass(frozen=True, slots=True)
class _Written:
    """A write result's storage data: where the item went, and (on a rank's first result)
    the rank's receipt -- digests and sizes, gathered to the coordinator by DCP."""

    rank: int
    position: int
    receipt: ShardReceipt | None = None


class CkptStoreWriter(StorageWriter):
    """A DCP ``StorageWriter`` that stores each rank's items through ckptstore and commits the
    checkpoint (run, step) in ``finish()``.

    ``target`` is the run on the coordinator (it must be writable) and the run, the store or a
    store URL on the other ranks. ``step`` may also come as DCP's ``checkpoint_id``. The
    committed :class:`CheckpointInfo` is ``self.committed`` on the coordinator afterwards.

    ``expect_changed``: every rank component must differ from the previous committed
    checkpoint's; one that does not is logged as a warning and listed in the committed row's
    ``training_info["stale_components"]`` (``Run.save``'s guard against saving stale weights).

    ``commit=False``: nothing is committed and no rank needs a run (``target`` is the store or
    its URL everywhere, or a run whose store is used). The coordinator's ``finish()`` stores
    the metadata as the component ``dcp/metadata`` -- the same content a commit would -- and
    ``self.receipts`` then holds every receipt (the rank components' in rank order, then the
    metadata's) for ``run.save(step, {...}, receipts=writer.receipts)``; on other ranks it is
    empty. Step, training info, metrics, trigger and ``expect_changed`` go to that call.
    """

    def __init__(
        self,
        target: Run | ObjectStore | str,
        step: int | None = None,
        *,
        training_info: Mapping[str, Any] | None = None,
        metrics: Mapping[str, Any] | None = None,
        trigger: str = "manual",
        kind: str = "state",
        writer_options: WriterOptions | None = None,
        expect_changed: bool = False,
        commit: bool = True,
    ) -> None:
        super().__init__()
        if not commit:
            given = {"step": step, "training_info": training_info, "metrics": metrics}
            _nothing_to_commit(
                [k for k, v in given.items() if v is not None]
                + (["expect_changed"] if expect_changed else [])
            )
        self.run = target if isinstance(target, Run) else None
        # A run with node-local tiers saves this rank's items to them (and its peers').
        self._store_target = target.save_target() if isinstance(target, Run) else target
        self.step = None if step is None else check_step(step)
        self.training_info = training_info
        self.metrics = metrics
        self.trigger = trigger
        self.kind = kind
        # Those given, else the run's (open_run(writer_options=...)), as Run.save uses them.
        run_options = target.writer_options if isinstance(target, Run) else None
        self.writer_options = writer_options if writer_options is not None else run_options
        self.expect_changed = expect_changed
        self.commit = commit
        self.committed: CheckpointInfo | None = None
        #: With ``commit=False``, after ``finish()`` on the coordinator: every receipt.
        self.receipts: list[ShardReceipt] = []
        self.uploaded_bytes = 0
        self.is_coordinator = False

    def __repr__(self) -> str:
        if not self.commit:
            return f"CkptStoreWriter(store={self._store_target!r}, commit=False)"
        return f"CkptStoreWriter(run={getattr(self.run, 'name', None)!r}, step={self.step})"

    def reset(self, checkpoint_id: Any = None) -> None:
        """A new save begins; a ``checkpoint_id`` is the step to save."""
        if checkpoint_id is not None:
            if not self.commit:
                _nothing_to_commit(["checkpoint_id"])
            self.step = _step_of(checkpoint_id)
        self._clear()

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Check this rank can play its part; per-save state is reset here (DCP calls
        ``reset`` only when a ``checkpoint_id`` is passed)."""
        self.is_coordinator = is_coordinator
        self._clear()
        if not is_coordinator or not self.commit:
            return
        if self.run is None or self.run.epoch is None:
            raise ConfigError(
                "the coordinator rank of a DCP save commits the checkpoint: give its "
                "CkptStoreWriter a writable run (ckptstore.open_run(name, writable=True)); "
                "the other ranks may pass a read-only run or the store"
            )
        if self.step is None:
            raise ConfigError(
                "CkptStoreWriter needs the step to save: CkptStoreWriter(run, step) or "
                "dcp.save(..., checkpoint_id=step)"
            )

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """The planner's plan, unchanged."""
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Tell each rank its place in the group."""
        return [dataclasses.replace(p, storage_data=_RankPlan(i)) for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Store this rank's items as one component; the future holds a result per item."""
        rank = plan.storage_data.rank if isinstance(plan.storage_data, _RankPlan) else 0
        items: list[Any] = []
        sizes: list[int] = []
        for item in plan.items:
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                text = _plain_text(data, item.index.fqn)
                items.append(text)
                sizes.append(len(text))
            else:
                assert isinstance(data, torch.Tensor)
                tensor = data.detach()
                items.append(tensor)
                sizes.append(tensor.numel() * tensor.element_size())
        results: list[WriteResult] = []
        if items:
            receipt = self._write(rank_component(rank), items, self.kind)
            self.uploaded_bytes = receipt.uploaded_bytes
            results = [
                WriteResult(
                    index=item.index,
                    size_in_bytes=size,
                    storage_data=_Written(rank, i, receipt if i == 0 else None),
                )
                for i, (item, size) in enumerate(zip(plan.items, sizes, strict=True))
            ]
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Commit the checkpoint: every rank's components and the metadata, one transaction
        (with ``commit=False``: store the metadata component and keep every receipt)."""
        receipts: list[ShardReceipt] = []
        locations: dict[MetadataIndex, Location] = {}
        for rank_results in results:
            for result in rank_results:
                written = result.storage_data
                if not isinstance(written, _Written):
                    raise SaveError(
                        f"a write result for {result.index.fqn!r} did not come from a "
                        "CkptStoreWriter; every rank must use one"
                    )
                locations[result.index] = Location(written.rank, written.position)
                if written.receipt is not None:
                    receipts.append(written.receipt)
        receipts.sort(key=lambda r: int(r.component.removeprefix("dcp/rank")))
        rank_indexes = {
            int(r.component.removeprefix("dcp/rank")): r.result.index_digest for r in receipts
        }
        document = encode_metadata(metadata, locations, rank_indexes)
        state = {"format": METADATA_FORMAT, "metadata": document}
        if not self.commit:
            self.receipts = [*receipts, self._write(METADATA_COMPONENT, state, "state")]
            return
        assert self.run is not None  # checked in set_up_storage_writer
        assert self.step is not None
        handle = self.run.save(
            self.step,
            {METADATA_COMPONENT: state},
            receipts=receipts,
            training_info=self.training_info,
            metrics=self.metrics,
            trigger=self.trigger,
            expect_changed=[r.component for r in receipts] if self.expect_changed else (),
        )
        self.committed = handle.wait()

    def storage_meta(self) -> None:
        """No storage-specific metadata (the step is the checkpoint's identity)."""
        return None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        """Never picked automatically by DCP: pass the writer explicitly."""
        return False

    def _clear(self) -> None:
        """Forget the previous save's outcome."""
        self.committed = None
        self.receipts = []
        self.uploaded_bytes = 0

    def _write(self, component: str, state: Any, kind: str) -> ShardReceipt:
        """Store one component; a store this writer opened from a URL is closed after."""
        target = self._store_target
        store = target if isinstance(target, ObjectStore) else open_store(target)
        try:
            with ShardWriter(store, options=self.writer_options) as writer:
                return writer.write(component, state, kind=kind)
        finally:
            if store is not target:
                store.close()


def _nothing_to_commit(given: list[str]) -> None:
    """``commit=False`` with what only a commit uses: ConfigError naming where it goes."""
    if given:
        raise ConfigError(
            f"CkptStoreWriter(commit=False) commits nothing, so it takes no {', '.join(given)}: "
            "pass the step, training_info, metrics and expect_changed to whoever commits, "
            "run.save(step, ..., receipts=writer.receipts)"
        )


def _plain_text(data: Any, fqn: str) -> str:
    """The JSON text of a plain value written by :class:`NoPickleSavePlanner`."""
    raw = data.getvalue() if isinstance(data, io.BytesIO) else data
    try:
        decode_plain(raw, fqn)
    except SerializationError:
        raise SerializationError(
            f"{fqn}: this value was serialized by a planner that pickles (DCP's default "
            "planner); pass planner=NoPickleSavePlanner() -- ckptstore never stores pickles"
        ) from None
    return bytes(raw).decode("utf-8")


def _step_of(checkpoint_id: Any) -> int:
    try:
        return parse_step_id(checkpoint_id)
    except (ValueError, CkptStoreError):
        raise ConfigError(
            f"checkpoint_id={checkpoint_id!r}: with ckptstore the checkpoint id is the step to "
            "save or load (an integer >= 0, or a path ending in step-N such as 'ckpt/step-30')"
        ) from None
