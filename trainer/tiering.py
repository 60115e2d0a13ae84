"""The trainer's side of node-local tiers (``checkpointing.local_dir``; DESIGN.md §13): which
node a process is on, the check that every node sees the same object store, starting the tiers
on the job's nodes, and the drains of local checkpoints to the store."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ckptstore import CheckpointInfo, CkptStoreError, LoadedCheckpoint, Run, SaveHandle
from ckptstore.extending import (
    ObjectStore,
    RayTransport,
    TierConfig,
    node_name,
    put_nonce,
    remove_nonce,
)
from ckptstore.extending import check_nonce as check_store_nonce
from trainer.policy_state import TierSources

if TYPE_CHECKING:
    from trainer.checkpointing import TrainerCheckpointer
    from trainer.config import CheckpointingConfig, TrainerConfig


def tier_node() -> tuple[str, str | None]:
    """This process's node: its name for the tiers (``$CKPTSTORE_NODE`` or the host name), and
    its Ray node id (None outside Ray)."""
    import ray

    node_id = str(ray.get_runtime_context().get_node_id()) if ray.is_initialized() else None
    return node_name(), node_id


def on_this_node(tiers: TierConfig) -> TierConfig:
    """The controller's tier config, for a process on this process's node."""
    return dataclasses.replace(tiers, node=node_name())


def check_nonce(store: ObjectStore | str, key: str, nonce: str) -> None:
    """The controller's nonce, read back as this node sees the store (ConfigError if not)."""
    check_store_nonce(store, key, nonce, node=node_name())


async def check_store(checkpointer: TrainerCheckpointer, policy: Any) -> None:
    """Every node the policy runs on sees the controller's store: a nonce written here is read
    back there, before anything is trained or saved."""
    _, store = await asyncio.to_thread(checkpointer.locations)
    key, nonce = await asyncio.to_thread(put_nonce, store)
    try:
        await policy.check_store.remote(key, nonce)
    finally:
        await asyncio.to_thread(remove_nonce, store, key)


async def start_tiers(cfg: TrainerConfig, checkpointer: TrainerCheckpointer, policy: Any) -> None:
    """With checkpointing.local_dir: the job's nodes (the controller's and the policy's), a
    tier agent on each (backend=ray), and the policy's saves routed through the tiers."""
    local_dir = cfg.checkpointing.local_dir
    if local_dir is None:
        return
    me, my_id = tier_node()
    found = await policy.tier_node.remote()
    workers = found if isinstance(found, list) else [found]
    nodes = dict([(me, my_id), *workers])
    transport = None
    if cfg.backend == "ray":
        transport = RayTransport(local_dir)
        ids = {name: node_id for name, node_id in nodes.items() if node_id is not None}
        await asyncio.to_thread(transport.start, ids)
    tiers = checkpointer.use_tiers(me, list(nodes), transport)
    if tiers is not None:
        await policy.use_tiers.remote(tiers)


def tier_config(
    ck: CheckpointingConfig,
    node: str,
    nodes: list[str],
    transport: Any,
    emit: Callable[[str], None],
) -> TierConfig | None:
    """The run's tiers (None without checkpointing.local_dir), announced in one line."""
    if ck.local_dir is None:
        return None
    tiers = TierConfig(
        local_dir=ck.local_dir,
        node=node,
        nodes=tuple(sorted(set(nodes))),
        replicas=ck.local_replicas,
        keep_last=ck.local_keep_last,
        transport=transport,
    )
    emit(
        f"node-local tiers at {ck.local_dir} on {len(tiers.ring())} node(s), "
        f"{tiers.replica_count()} replica(s): a local save every {ck.local_period} step(s), "
        f"drained to the store every {ck.save_period}"
    )
    return tiers


def tier_sources(run: Run | None, info: CheckpointInfo) -> TierSources | None:
    """Where ``info``'s blobs are, for ranks that read it without the manifest (None without
    tiers, or for another run's checkpoint, which the store holds)."""
    if run is None or run.tiers is None or info.run != run.name:
        return None
    return TierSources(run.copies(info), run.reachable())


def resume_reads(loaded: LoadedCheckpoint, policy_read: dict[str, int]) -> str:
    """The line that says where a resume read its bytes: each node's tier, the store."""
    total = dict(loaded.read_bytes)
    for source, n in policy_read.items():
        total[source] = total.get(source, 0) + n
    tiers = sorted((source, n) for source, n in total.items() if source != "store")
    listed = ", ".join(f"{node} {n / 2**20:.2f} MiB" for node, n in tiers) or "none"
    return (
        f"resume read step {loaded.info.step} ({loaded.info.status}) from node-local tiers: "
        f"{listed}; from the store: {total.get('store', 0) / 2**20:.2f} MiB"
    )


class Drains:
    """Drains of local checkpoints to the store, in the background, one at a time (each waits
    for the one before), never past the time budget's end (``deadline()``, a
    ``time.monotonic()`` instant or None)."""

    def __init__(self, emit: Callable[[str], None], deadline: Callable[[], float | None]) -> None:
        self.emit = emit
        self.deadline = deadline
        self._task: asyncio.Future[None] | None = None
        #: The last drain's failure, if it failed: raised by :meth:`settle`.
        self.error: CkptStoreError | None = None

    def after(self, run: Run, handle: SaveHandle | None, step: int | None) -> None:
        """Drain ``step`` of ``run`` (None: its newest checkpoint, if local) once ``handle``'s
        commit is done."""
        previous = self._task

        async def drain() -> None:
            if previous is not None:
                await previous
            if handle is not None:
                await asyncio.to_thread(handle.wait)
            try:
                report = await asyncio.to_thread(run.drain, step, deadline=self.deadline())
            except CkptStoreError as exc:
                # The checkpoint stays local-durable and training goes on; the next drain (or
                # start) tries again. The last drain's failure fails the run at close.
                self.error = exc
                what = "the newest checkpoint" if step is None else f"step {step}"
                self.emit(
                    f"warning: draining {what} to the store failed ({exc}); it stays "
                    "local-durable and the next drain retries"
                )
                return
            self.error = None
            if report is None or (report.drained and not report.uploaded_blobs and step is None):
                return
            if report.drained:
                mib = report.uploaded_bytes / 2**20
                self.emit(
                    f"drained step {report.step} to the store: {mib:.2f} MiB in "
                    f"{report.seconds:.2f}s (remote-durable)"
                )
            else:
                self.emit(
                    f"step {report.step} stays local-durable: {report.stopped}; the next start "
                    "drains the rest"
                )

        self._task = asyncio.ensure_future(drain())

    async def settle(self) -> None:
        """Wait for the drains in flight; the last one's failure is raised (a finished run
        must leave its last checkpoint remote-durable)."""
        task, self._task = self._task, None
        if task is not None:
            await task
        error, self.error = self.error, None
        if error is not None:
            raise error
