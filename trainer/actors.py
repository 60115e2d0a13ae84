"""Running the workers: Ray actors, or the same objects in this process (``backend=local``).

Either way a handle is called as ``await handle.method.remote(*args)``: the controller's code does
not know which backend it runs on.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any


class LocalActor:
    """An object whose method calls run one at a time on a worker thread, like an actor's."""

    def __init__(self, obj: Any) -> None:
        self._obj = obj
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> _LocalMethod:
        return _LocalMethod(getattr(self._obj, name), self._lock)


class _LocalMethod:
    def __init__(self, method: Callable[..., Any], lock: threading.Lock) -> None:
        self._method = method
        self._lock = lock

    def remote(self, *args: Any, **kwargs: Any) -> asyncio.Future[Any]:
        def call() -> Any:
            with self._lock:
                return self._method(*args, **kwargs)

        return asyncio.get_running_loop().run_in_executor(None, call)


def spawn(cls: type, backend: str, *args: Any, **kwargs: Any) -> Any:
    """An actor running ``cls(*args, **kwargs)``."""
    if backend == "local":
        return LocalActor(cls(*args, **kwargs))
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    # num_cpus=0: the actors share the machine's cores instead of each reserving one. They
    # stay beside the caller (the controller), so losing another node never takes them; only
    # the sharded policy's ranks (trainer.sharded) are spread by their own resources. A hard
    # affinity: with a soft one Ray 2.60 places zero-CPU actors on any node (it spreads them
    # while the caller's node starts workers), and the caller's node can always hold them.
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    return ray.remote(num_cpus=0)(cls).options(scheduling_strategy=here).remote(*args, **kwargs)
