"""concurrency_child.py with its gated store on Azure: the ``fenced-writer`` mode of that child
(commit step 1, hold step 2's first upload until the parent says ``go``, report what the stale
writer's saves do) writing to an ``az://`` store, for test_fencing_azure.py.

The store URL comes in the job as ever; the credentials in ``AZURE_STORAGE_CONNECTION_STRING``,
as a user's job would have them. Run as concurrency_child.py is.
"""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Callable

import concurrency_child as base

from ckptstore.objectstore._azure import AzureStore
from ckptstore.objectstore.base import PutData


class GatedAzureStore(AzureStore):
    """An Azure store whose uploads, once ``armed``, wait as concurrency_child's GatedStore's
    do: the first calls ``hold(key)``, the others wait for it to return."""

    armed = False

    def __init__(self, url: str, hold: Callable[[str], None]) -> None:
        container, _, prefix = url.removeprefix("az://").partition("/")
        super().__init__(container, prefix)
        self._hold = hold
        self._gate = threading.Lock()
        self._open = threading.Event()

    def put(self, key: str, data: PutData) -> bool:
        if self.armed:
            with self._gate:
                if not self._open.is_set():
                    self._hold(key)
                    self._open.set()
        return super().put(key, data)


base.GatedStore = GatedAzureStore  # type: ignore[misc,assignment]

if __name__ == "__main__":
    base.MODES[sys.argv[1]](json.loads(sys.argv[2]))
