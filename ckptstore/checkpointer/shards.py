"""Worker-side saving: processes that hold shards store them and hand back a receipt.

A :class:`ShardWriter` needs only the object store, never database write access, so it works
inside a Ray actor, a torch rank or a multiprocessing child. The controller commits the
receipts of one step in a single transaction (``Run.save(..., receipts=[...])``), where every
blob a receipt names is checked again against the store.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ckptstore.cas.writer import BlobWriter, WriterOptions
from ckptstore.names import check_component_name, check_kind
from ckptstore.objectstore import ObjectStore, open_store
from ckptstore.serialize.save import ComponentResult, write_component


@dataclass(frozen=True, slots=True)
class ShardReceipt:
    """What a worker stored for one component: small and picklable."""

    component: str
    result: ComponentResult
    kind: str = "state"

    @property
    def uploaded_bytes(self) -> int:
        """Bytes this worker uploaded (not already stored)."""
        return self.result.uploaded_bytes


class ShardWriter:
    """Stores components from a worker process. Use one per process; close it when done."""

    def __init__(self, store: str | ObjectStore, *, options: WriterOptions | None = None) -> None:
        self._owns_store = not isinstance(store, ObjectStore)
        self.store = open_store(store) if not isinstance(store, ObjectStore) else store
        self._writer = BlobWriter(self.store, options)

    def write(self, component: str, state: Any, *, kind: str = "state") -> ShardReceipt:
        """Store ``state`` (do not mutate it until this returns) and return the receipt."""
        check_component_name(component)
        check_kind(kind)
        self._writer.forget()
        return ShardReceipt(component, write_component(self._writer, state), kind)

    def close(self) -> None:
        """Release the writer threads (and the store, if this writer opened it)."""
        self._writer.close()
        if self._owns_store:
            self.store.close()

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
