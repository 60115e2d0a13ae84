"""Reading a DCP checkpoint from ckptstore: the ``StorageReader`` and consolidation into whole
tensors (see :mod:`ckptstore.integrations.dcp`)."""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
)
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ckptstore.errors import (
    CheckpointNotFoundError,
    ComponentNotFoundError,
    ConfigError,
    IntegrityError,
    SerializationError,
)
from ckptstore.extending import (
    BlobCache,
    CheckpointInfo,
    ComponentReader,
    Entry,
    ObjectStore,
    Piece,
    Run,
    SourceTensor,
    blob_ends,
    open_store,
    torch_dtype,
)
from ckptstore.integrations.dcp import _plan, _share
from ckptstore.integrations.dcp._boxes import (
    BoxWrites,
    box_source,
    check_box,
    run_all,
    stored_text,
)
from ckptstore.integrations.dcp._metadata import (
    METADATA_COMPONENT,
    METADATA_FORMAT,
    Location,
    Locations,
    StoredMetadata,
    decode_metadata,
    rank_component,
)
from ckptstore.integrations.dcp._planners import NoPickleLoadPlanner
from ckptstore.integrations.dcp._validate import (
    Expected,
    check_entries,
    expected_items,
    item_entry,
)

# -- reading ----------------------------------------------------------------------------------


class CkptStoreReader(StorageReader):
    """A DCP ``StorageReader`` over one committed checkpoint, found by the digest of its
    metadata component's index (no database needed) or with :meth:`from_run`.

    Every blob is verified as it arrives; each rank fetches only the blobs holding the boxes it
    reads, each once. Non-tensor values are handed only to a :class:`NoPickleLoadPlanner`.

    ``atomic`` (the default, an attribute any constructor's reader has): the planner's
    tensors and values are written only once every blob of this rank's plan has verified, so
    a load that fails leaves the state dict as it was (the verified bytes are held until
    then: memory for the rank's share). ``reader.atomic = False`` writes each box as its blob
    verifies (memory of the blobs in flight only); a failed load may then leave some
    targets filled and others not.
    """

    #: Write the targets only once every blob has verified (see the class docstring).
    atomic: bool = True
    #: Read once, share: a blob several ranks of the load need is read from the store by one
    #: of them and sent to the others over ``process_group`` (gloo), see ``_share``. None (the
    #: default): when the store is ``remote`` (S3, GCS, Azure), not a local directory.
    share: bool | None = None
    #: The group the load runs on (``dcp.load`` here sets it; None: the default group).
    process_group: Any = None
    #: This rank's part in the last load's sharing: blobs sent (per receiver) / received.
    shared_out = shared_in = 0

    def __init__(
        self,
        store: ObjectStore | str,
        metadata_digest: str,
        *,
        context: str = "",
        max_workers: int = 8,
    ) -> None:
        super().__init__()
        self._owns_store = not isinstance(store, ObjectStore)
        self.store = store if isinstance(store, ObjectStore) else open_store(store)
        self.metadata_digest = metadata_digest
        self.context = context or f"DCP checkpoint {metadata_digest}"
        self.max_workers = max(1, max_workers)
        self._stored: StoredMetadata | None = None
        #: rank -> position -> what the metadata says is stored there (checked on opening).
        self._expected: dict[int, dict[int, Expected]] = {}
        self._readers: dict[int, ComponentReader] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_run(
        cls,
        run: Run,
        step: int | None = None,
        *,
        component: str = METADATA_COMPONENT,
        max_workers: int = 8,
    ) -> CkptStoreReader:
        """The reader for ``run``'s checkpoint at ``step`` (default: the newest committed)."""
        info = run.checkpoint(step) if step is not None else run.latest()
        if info is None:
            raise CheckpointNotFoundError(f"run {run.name!r} has no committed checkpoint to load")
        return cls.for_checkpoint(run.store, info, component=component, max_workers=max_workers)

    @classmethod
    def for_checkpoint(
        cls,
        store: ObjectStore,
        info: CheckpointInfo,
        *,
        component: str = METADATA_COMPONENT,
        max_workers: int = 8,
    ) -> CkptStoreReader:
        """The reader for the checkpoint ``info`` describes."""
        if component == METADATA_COMPONENT:
            return cls.for_plan(store, _plan.LoadPlan(info), max_workers=max_workers)
        digest = next((c.index_digest for c in info.components if c.name == component), None)
        if digest is None:
            raise ComponentNotFoundError(
                f"run {info.run!r} step {info.step} has no component {component!r}: it was not "
                f"saved through torch DCP with ckptstore (components: "
                f"{sorted(c.name for c in info.components)})"
            )
        return cls(store, digest, context=_where(info), max_workers=max_workers)

    @classmethod
    def for_plan(
        cls, store: ObjectStore | str | None, plan: _plan.LoadPlan, *, max_workers: int = 8
    ) -> CkptStoreReader:
        """The reader for the checkpoint a :class:`LoadPlan` names, from the store alone (no
        database): ``store`` (an ``ObjectStore`` or its URL), else the plan's ``store_url``."""
        where = store if store is not None else plan.store_url
        if where is None:
            raise ConfigError(
                f"the load plan of run {plan.run!r} step {plan.step} names no store: pass "
                "store= (an ObjectStore or its URL), or plan with ckpt_dcp.plan_load(run), "
                "which records the run's store"
            )
        return cls(where, plan.metadata_digest, context=_where(plan.info), max_workers=max_workers)

    def close(self) -> None:
        """Release the store if this reader opened it."""
        if self._owns_store:
            self.store.close()

    def reset(self, checkpoint_id: Any = None) -> None:
        """Nothing to reset: a reader reads one checkpoint."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP's metadata, decoded from JSON (never unpickled) and validated."""
        return self.stored_metadata().metadata

    def stored_metadata(self) -> StoredMetadata:
        """The decoded metadata document (fetched, verified and validated once): each
        tensor's chunks tile it, and each chunk and value has one location."""
        with self._lock:
            if self._stored is None:
                stored = self._fetch_metadata()
                self._expected = expected_items(stored, self.context)
                self._stored = stored
            return self._stored

    def validate(self) -> StoredMetadata:
        """Every check a load makes before it reads data, made at once: the metadata as a whole
        (:meth:`stored_metadata`), then each rank component that holds items against it (its
        index only). Reads no tensor data; raises what a load would raise."""
        stored = self.stored_metadata()
        for rank in sorted(self._expected):
            self._rank_reader(stored, rank)
        return stored

    def _fetch_metadata(self) -> StoredMetadata:
        where = _with_context(self.context, f"component {METADATA_COMPONENT!r}")
        doc = ComponentReader(self.store, self.metadata_digest, context=where).load()
        if (
            not isinstance(doc, dict)
            or doc.get("format") != METADATA_FORMAT
            or not isinstance(doc.get("metadata"), str)
        ):
            raise SerializationError(f"{where}: not the metadata of a DCP checkpoint")
        return decode_metadata(doc["metadata"], where)

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *a: Any, **k: Any
    ) -> None:
        """Check the metadata came from this reader (its storage data says where items are)."""
        if not isinstance(metadata.storage_data, Locations):
            raise ConfigError("CkptStoreReader can only load metadata it read itself")

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """The planner's plan, unchanged."""
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """The planners' plans, each carrying the same read-once schedule: who reads each blob
        that several ranks need (see ``_share``; none when sharing is off or impossible)."""
        share = self.store.remote if self.share is None else self.share
        if not share or len(plans) < 2 or not _share.can_share(self.process_group):
            return plans
        stored = self.stored_metadata()
        plan = _share.schedule([self._wanted(stored, p) for p in plans])
        return [dataclasses.replace(p, storage_data=plan) for p in plans]

    def _wanted(self, stored: StoredMetadata, plan: LoadPlan) -> dict[str, int]:
        """digest -> bytes of it the tensor boxes of ``plan`` reach."""
        ends: list[tuple[str, int]] = []
        for item in plan.items:
            location = stored.metadata.storage_data.get(item.storage_index)
            if location is None or item.type != LoadItemType.TENSOR:
                continue  # read_data names a missing location
            reader = self._rank_reader(stored, location.rank)
            _, entry = item_entry(reader, location.position)
            if entry.is_array:
                where = _with_context(reader.context, f"entry {entry.path}")
                ends += blob_ends(entry, *check_box(entry, item, where))
        return _share.wanted_bytes(ends)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read every item of ``plan`` into the planner's tensors (verified), in parallel per
        stored item, fetching each needed blob once and only the chunks a box touches."""
        # First, before anything that could fail on one rank alone: the blobs shared with
        # other ranks (every rank of the schedule walks it, or its peers would wait).
        held: dict[str, memoryview] = {}
        self.shared_out = self.shared_in = 0
        if isinstance(plan.storage_data, _share.Schedule):
            group, walk = self.process_group, plan.storage_data
            held = _share.exchange(
                self.store, walk, group, context=self.context, max_workers=self.max_workers
            )
            self.shared_out, self.shared_in = walk.counts(dist.get_rank(group))
        stored = self.stored_metadata()
        groups: dict[Location, list[ReadItem]] = {}
        for item in plan.items:
            location = stored.metadata.storage_data.get(item.storage_index)
            if location is None:
                raise IntegrityError(
                    f"{self.context}: the metadata has no location for {item.storage_index.fqn!r}"
                )
            if item.type == LoadItemType.BYTE_IO and not isinstance(planner, NoPickleLoadPlanner):
                raise ConfigError(
                    f"{item.storage_index.fqn!r} is a non-tensor value and "
                    f"{type(planner).__name__} would unpickle it; load with "
                    "planner=NoPickleLoadPlanner()"
                )
            groups.setdefault(location, []).append(item)
        cache = BlobCache(self.store, held)
        # Atomic: every write (a plain value, a tensor box) waits until all have verified.
        writes = BoxWrites(planner, atomic=self.atomic)
        tasks: list[tuple[ComponentReader, Entry, str, list[tuple[ReadItem, int, int, int]]]] = []
        for location, items in groups.items():
            reader = self._rank_reader(stored, location.rank)
            _, entry = item_entry(reader, location.position)
            where = _with_context(reader.context, f"entry {entry.path}")
            if not entry.is_array:
                for item in items:
                    writes.value(item, stored_text(entry, item, where))
                continue
            boxes = [(item, *check_box(entry, item, where), writes.target(item)) for item in items]
            cache.need(reader, entry, [(lo, hi) for _, lo, hi, _ in boxes])
            tasks.append((reader, entry, where, boxes))
        # (The pool starts a thread per task at most, and the staged copies left for the end
        # may use every one of max_workers.)
        writes.prepare(self.max_workers)
        try:
            if tasks:
                with ThreadPoolExecutor(
                    self.max_workers, thread_name_prefix="ckpt-dcp-read"
                ) as pool:
                    reads = [functools.partial(self._read_boxes, *t, cache, writes) for t in tasks]
                    run_all(pool, reads)
                    writes.upload(pool)
        finally:
            writes.close()  # no copy into a device tensor outlives the load
        writes.finish()
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _read_boxes(
        self,
        reader: ComponentReader,
        entry: Entry,
        where: str,
        boxes: list[tuple[ReadItem, int, int, int]],
        cache: BlobCache,
        writes: BoxWrites,
    ) -> None:
        """Read each box of one stored tensor (verified) and hand it to ``writes``."""
        dtype = torch_dtype(entry.dtype, where)
        for item, lo, hi, number in boxes:
            lengths = tuple(item.lengths)
            if writes.shape(number) != lengths:
                raise IntegrityError(
                    f"{where}: the target of {item.dest_index.fqn!r} has shape "
                    f"{writes.shape(number)}, the stored box {lengths}"
                )
            source = None
            if hi > lo:
                source = box_source(cache.read(reader, entry, lo, hi), dtype, lengths, entry.shape)
            writes.box(number, source)

    def _rank_reader(self, stored: StoredMetadata, rank: int) -> ComponentReader:
        with self._lock:
            reader = self._readers.get(rank)
            if reader is None:
                digest = stored.rank_indexes.get(rank)
                if digest is None:
                    raise IntegrityError(
                        f"{self.context}: the metadata names no index for rank {rank}"
                    )
                context = _with_context(self.context, f"component {rank_component(rank)!r}")
                reader = ComponentReader(self.store, digest, context=context)
                # Before any of its data is read: its entries are what the metadata says.
                check_entries(reader, self._expected.get(rank, {}))
                self._readers[rank] = reader
            return reader

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        """Never picked automatically by DCP: pass the reader explicitly."""
        return False


def _where(info: CheckpointInfo) -> str:
    return f"run {info.run!r}, step {info.step}"


def _with_context(context: str, detail: str) -> str:
    """``detail`` after the reader's ``context`` (run, step), if it has one."""
    return f"{context}, {detail}" if context else detail


# -- consolidation (export) -------------------------------------------------------------------


def is_dcp_checkpoint(info: CheckpointInfo) -> bool:
    """Whether the checkpoint was saved through :class:`CkptStoreWriter`."""
    return any(c.name == METADATA_COMPONENT for c in info.components)


def validate_checkpoint(store: ObjectStore, info: CheckpointInfo) -> None:
    """Check a DCP checkpoint's metadata as a load or an export does before reading any tensor
    data (:meth:`CkptStoreReader.validate`): an ``IntegrityError`` without a ``digest`` names
    the tensor whose metadata is wrong; one with a ``digest`` names a blob found damaged or
    missing on the way."""
    CkptStoreReader.for_checkpoint(store, info).validate()


def iter_full_tensors(
    store: ObjectStore, info: CheckpointInfo
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a DCP checkpoint, whole (its shards put together), by its fqn -- the
    state dict's own key path joined with dots (a model's ``state_dict()`` names).

    Each rank component's chunks are loaded in one call, so a pack of small tensors is fetched
    and verified once, not once per tensor in it."""
    reader = CkptStoreReader.for_checkpoint(store, info)
    stored = reader.stored_metadata()
    locations = stored.metadata.storage_data
    # Per tensor, its chunks as (chunk, rank, entry number); then one load per rank.
    tensors: dict[str, tuple[TensorStorageMetadata, list[tuple[Any, int, int]]]] = {}
    numbers: dict[int, list[int]] = {}
    for fqn, md in stored.metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            continue
        chunks = []
        for chunk in md.chunks:
            # Every chunk has a location, and opening a rank's component checks its entries.
            location = locations[MetadataIndex(fqn, chunk.offsets)]
            number, _ = item_entry(reader._rank_reader(stored, location.rank), location.position)
            chunks.append((chunk, location.rank, number))
            numbers.setdefault(location.rank, []).append(number)
        tensors[fqn] = (md, chunks)
    values = {
        rank: reader._rank_reader(stored, rank).load_entries(wanted)
        for rank, wanted in numbers.items()
    }
    for fqn, (md, chunks) in tensors.items():
        # The chunks tile the tensor exactly (checked when the metadata was read): every
        # element of ``full`` is written below.
        full = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        for chunk, rank, number in chunks:
            box = tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.sizes, strict=True))
            full[box] = values[rank][number]
        yield fqn, full


def state_dict_items(store: ObjectStore, info: CheckpointInfo) -> list[dict[str, Any]]:
    """The checkpoint's state dict by name (see ``formats.Items``): each item's global dtype
    and shape, and the ranks whose components hold its data."""
    metadata = CkptStoreReader.for_checkpoint(store, info).stored_metadata().metadata
    ranks: dict[str, set[int]] = {}
    for index, location in metadata.storage_data.items():
        ranks.setdefault(index.fqn, set()).add(location.rank)
    items = []
    for fqn, md in metadata.state_dict_metadata.items():
        item: dict[str, Any] = {"name": fqn, "kind": "value", "dtype": None, "shape": None}
        if isinstance(md, TensorStorageMetadata):
            dtype = str(md.properties.dtype).removeprefix("torch.")
            item |= {"kind": "tensor", "dtype": dtype, "shape": list(md.size)}
        items.append(item | {"ranks": sorted(ranks.get(fqn, ()))})
    return items


def tensor_sources(store: ObjectStore, info: CheckpointInfo) -> list[SourceTensor]:
    """The tensors of the checkpoint, by fqn, as the stored pieces that tile each (see
    ``formats.Tensors``), after the checks a load makes; nothing else is read."""
    reader = CkptStoreReader.for_checkpoint(store, info)
    stored = reader.validate()
    locations = stored.metadata.storage_data
    sources = []
    for fqn, md in stored.metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            continue
        pieces = []
        for chunk in md.chunks:
            location = locations[MetadataIndex(fqn, chunk.offsets)]
            rank_reader = reader._rank_reader(stored, location.rank)
            _, entry = item_entry(rank_reader, location.position)
            pieces.append(Piece(rank_reader, entry, tuple(chunk.offsets)))
        sources.append(SourceTensor(fqn, md.properties.dtype, tuple(md.size), tuple(pieces)))
    return sources
