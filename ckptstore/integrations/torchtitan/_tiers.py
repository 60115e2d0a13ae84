"""Node-local tiers for the torchtitan manager (``checkpoint.local_dir``): the job's nodes, and
the drains of its local-durable checkpoints to the store, one at a time on a thread of rank 0
(training goes on meanwhile)."""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor

import torch.distributed as dist

from ckptstore.errors import CkptStoreError
from ckptstore.extending import Run, TierConfig, node_name

log = logging.getLogger("ckptstore.integrations.torchtitan")


def job_tiers(local_dir: str | None, replicas: int, distributed: bool) -> TierConfig | None:
    """The job's tiers (None without ``local_dir``): this rank's node, and every rank's node
    as the ring replicas are placed on (one collective, on every rank)."""
    if local_dir is None:
        return None
    me = node_name()
    nodes = [me]
    if distributed:
        gathered: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, me)
        nodes = [n for n in gathered if n is not None]
    return TierConfig(
        local_dir=local_dir, node=me, nodes=tuple(sorted(set(nodes))), replicas=replicas
    )


class Drains:
    """Rank 0's drains: the newest local checkpoint to the store after each commit, in the
    background, one at a time; the last one waited for (and its failure raised) at the end."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._drain: Future[object] | None = None

    def start(self, run: Run) -> None:
        """Drain the newest checkpoint if it is local, unless a drain is still running (the
        next one then takes the newest)."""
        if self._drain is not None and not self._drain.done():
            return
        self._report()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="ckpt-titan-drain")
        self._drain = self._pool.submit(run.drain)

    def _report(self) -> None:
        drain, self._drain = self._drain, None
        if drain is None:
            return
        try:
            drain.result()
        except CkptStoreError:  # the checkpoint stays local-durable; the next drain retries
            log.exception("draining a local checkpoint to the store failed; the next one retries")

    def finish(self, run: Run) -> None:
        """Wait for the drain in flight, then drain the newest checkpoint (raising its error)."""
        try:
            if self._drain is not None:
                self._drain.result()
            run.drain()
        finally:
            self._drain = None
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
