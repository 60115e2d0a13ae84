"""Reaching the nodes' tiers over Ray: a small actor on every node owns its tier directory.

:class:`RayTransport` is what a Ray job's processes pass around (it pickles as its directory
template and a tag): :meth:`RayTransport.start` places one :class:`TierAgent` on each node of the
job (hard node affinity, no CPU), named after the job's tag and the node; any process of the job
then reaches node ``n``'s tier as a store whose calls are that actor's. Bytes travel as numpy
arrays (Ray's object store moves them without pickling them). A node that is gone takes its
agent with it: :meth:`RayTransport.reachable` leaves it out, and its tier's calls fail with an
``ObjectStoreError`` that readers treat as "not reachable", never as damage.

Ray is imported when a transport is used, so ``ckptstore.tiers`` does not need it.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from ckptstore.errors import CkptStoreError, ObjectStoreError
from ckptstore.objectstore import LocalStore
from ckptstore.objectstore.base import ObjectInfo, ObjectStore, PutData, as_parts
from ckptstore.tiers.nodes import check_local_dir, check_node_name, tier_root

#: Seconds to wait for an agent to answer a ping before its node counts as unreachable.
PING_SECONDS = 5.0
#: Seconds any other call to an agent may take (a blob of up to 64 MiB, fsyncs).
CALL_SECONDS = 600.0
NAMESPACE = "ckptstore"


class TierAgent:
    """Owns one node's tier directory; every call is a store call on it."""

    def __init__(self, local_dir: str, node: str, fsync: bool) -> None:
        self.node = node
        self.store = LocalStore(tier_root(local_dir, node), fsync=fsync, create=True)

    def ping(self) -> str:
        """The node's name (it answers)."""
        return self.node

    def put(self, key: str, parts: list[np.ndarray]) -> bool:
        """Create ``key`` from ``parts`` unless it exists."""
        return self.store.put(key, [p.data for p in parts])

    def adopt(self, key: str) -> None:
        """Make ``key`` durable at the next flush."""
        self.store.adopt(key)

    def flush(self) -> None:
        """fsync what was put or adopted."""
        self.store.flush()

    def get(self, key: str, byte_range: tuple[int, int] | None) -> np.ndarray:
        """The object's bytes (a numpy array: Ray moves it without a pickle)."""
        if byte_range is None:
            return np.frombuffer(self.store.get_view(key), dtype=np.uint8)
        return np.frombuffer(self.store.get(key, byte_range), dtype=np.uint8)

    def head(self, key: str) -> tuple[int, float]:
        """(size, mtime)."""
        info = self.store.head(key)
        return info.size, info.mtime

    def sizes(self, keys: list[str]) -> dict[str, int | None]:
        """Each key's size, None where absent."""
        return self.store.sizes(keys)

    def delete(self, keys: list[str]) -> None:
        """Delete the keys (absent ones are ignored)."""
        self.store.delete(keys)

    def listing(self, prefix: str) -> list[tuple[str, int, float]]:
        """(key, size, mtime) of every object under ``prefix`` (cleaning only)."""
        return [(i.key, i.size, i.mtime) for i in self.store.list(prefix)]

    def sweep(self, older_than: float) -> tuple[int, int]:
        """Unfinished writes older than ``older_than`` seconds, removed."""
        return self.store.sweep_incomplete(older_than)


class RayTransport:
    """Every node's tier through its :class:`TierAgent` (see the module)."""

    def __init__(self, local_dir: str, *, fsync: bool = True, tag: str | None = None) -> None:
        self.local_dir = check_local_dir(local_dir)
        self.fsync = fsync
        #: Names this job's agents apart from another job's on the same cluster.
        self.tag = tag or uuid.uuid4().hex[:12]
        self._stores: dict[str, AgentStore] = {}
        #: The handles of the agents this process started: an actor whose every handle is gone
        #: is stopped by Ray, name or not, so the starter keeps them for the job's life.
        self._started: dict[str, Any] = {}

    def __repr__(self) -> str:
        return f"RayTransport({self.local_dir!r}, tag={self.tag!r})"

    def __getstate__(self) -> dict[str, Any]:
        return {"local_dir": self.local_dir, "fsync": self.fsync, "tag": self.tag}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["local_dir"], fsync=state["fsync"], tag=state["tag"])  # type: ignore[misc]

    def name(self, node: str) -> str:
        """The agent's actor name for ``node``."""
        return f"ckptstore-tier:{self.tag}:{check_node_name(node)}"

    def start(self, nodes: Mapping[str, str]) -> None:
        """Place an agent on each node (``{node name: Ray node id}``) that has none yet, and
        wait until each answers."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        pings = []
        for node, node_id in nodes.items():
            agent = ray.remote(num_cpus=0)(TierAgent).options(
                name=self.name(node),
                namespace=NAMESPACE,
                get_if_exists=True,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            )
            handle: Any = agent.remote(self.local_dir, node, self.fsync)
            self._started[node] = handle
            pings.append(handle.ping.remote())
        for ping in pings:
            _wait(ping, CALL_SECONDS)

    def _agent(self, node: str) -> Any:
        import ray

        try:
            return ray.get_actor(self.name(node), namespace=NAMESPACE)
        except ValueError as exc:
            raise ObjectStoreError(f"node {node!r} has no tier agent (lost?): {exc}") from None

    def reachable(self, nodes: Iterable[str]) -> set[str]:
        """The nodes whose agent answers a ping within :data:`PING_SECONDS`."""
        nodes = sorted(set(nodes))
        if not nodes:
            return set()
        with ThreadPoolExecutor(min(16, len(nodes))) as pool:
            answers = dict(zip(nodes, pool.map(self._answers, nodes), strict=True))
        return {node for node, ok in answers.items() if ok}

    def _answers(self, node: str) -> bool:
        try:
            return bool(_wait(self._agent(node).ping.remote(), PING_SECONDS) == node)
        except Exception:  # a dead actor, a lost node, a timeout: not reachable now
            return False

    def tier(self, node: str) -> ObjectStore:
        """``node``'s tier, its calls made to its agent."""
        store = self._stores.get(node)
        if store is None:
            store = self._stores[node] = AgentStore(self, node)
        return store

    def close(self) -> None:
        """Forget the tiers opened (the agents this process started stop with it)."""
        self._stores.clear()


def _wait(ref: Any, timeout: float) -> Any:
    """The result of a Ray call, waited for as a future: the caller is a thread of its own (an
    async actor's ``ray.get`` would warn that it blocks the event loop, which it does not)."""
    return ref.future().result(timeout=timeout)


class AgentStore(ObjectStore):
    """One node's tier as a store, through its agent."""

    write_bandwidth_hint = 1.0e9
    read_concurrency = 8

    def __init__(self, transport: RayTransport, node: str) -> None:
        self._transport = transport
        self.node = node

    @property
    def url(self) -> str:
        """The node and its directory."""
        return f"ray-tier://{self.node}/{tier_root(self._transport.local_dir, self.node)}"

    def _call(self, method: str, *args: Any) -> Any:
        import ray

        agent = self._transport._agent(self.node)
        try:
            return _wait(getattr(agent, method).remote(*args), CALL_SECONDS)
        except CkptStoreError:
            raise
        except ray.exceptions.RayTaskError as exc:
            cause = exc.cause
            if isinstance(cause, CkptStoreError):
                raise cause from None
            raise ObjectStoreError(f"{self.url}: {method} failed: {cause!r}") from None
        except Exception as exc:  # the actor or its node is gone, or it does not answer
            raise ObjectStoreError(
                f"{self.url}: the node's tier does not answer: {exc!r}"
            ) from None

    def put(self, key: str, data: PutData) -> bool:
        """Create ``key`` on the node's tier."""
        parts = [np.frombuffer(p, dtype=np.uint8) for p in as_parts(data)]
        return bool(self._call("put", key, parts))

    def adopt(self, key: str) -> None:
        """Made durable at the node's next flush."""
        self._call("adopt", key)

    def flush(self) -> None:
        """fsync on the node."""
        self._call("flush")

    def get(self, key: str, byte_range: tuple[int, int] | None = None) -> bytearray:
        """The object's bytes."""
        return bytearray(self._call("get", key, byte_range))

    def get_view(self, key: str) -> memoryview:
        """The object's bytes, as Ray delivered them (read-only, no copy)."""
        return memoryview(self._call("get", key, None))

    def head(self, key: str) -> ObjectInfo:
        """Size and mtime on the node."""
        size, mtime = self._call("head", key)
        return ObjectInfo(key, size, mtime)

    def sizes(self, keys: Sequence[str]) -> dict[str, int | None]:
        """Sizes in one call."""
        return dict(self._call("sizes", list(keys)))

    def delete(self, keys: Iterable[str]) -> None:
        """Delete on the node."""
        self._call("delete", list(keys))

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """The node's objects under ``prefix`` (cleaning only)."""
        for key, size, mtime in self._call("listing", prefix):
            yield ObjectInfo(key, size, mtime)

    def sweep_incomplete(self, older_than: float, *, dry_run: bool = False) -> tuple[int, int]:
        """Unfinished writes on the node."""
        if dry_run:
            return 0, 0
        count, size = self._call("sweep", older_than)
        return int(count), int(size)
