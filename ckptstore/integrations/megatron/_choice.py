"""What rank 0 hands the other ranks of a Megatron load: the checkpoint it chose, as plain JSON.

Only the coordinator asks the manifest (DESIGN.md §12). It sends every other rank the
checkpoint's record (its step and its components' index digests: all a rank needs to find its
shards in the store) and the meta component as rank 0 read and checked it (metadata.json's
config and the layout), so no other rank opens the database or fetches the meta itself; or
the error that stopped it, which every rank then raises. The messages are JSON text: no
ckptstore object crosses between the ranks.
"""

from __future__ import annotations

from typing import Any

from ckptstore import errors
from ckptstore.errors import CkptStoreError
from ckptstore.extending import ObjectStore, checkpoint_info_from_json, checkpoint_info_to_json
from ckptstore.integrations._common.megatron_source import Source

#: What the record's errors call the message it came in.
_WHAT = "Megatron load: the checkpoint rank 0 chose"


def choice_to_json(source: Source) -> dict[str, Any]:
    """The checkpoint rank 0 opened, as the other ranks need it."""
    return {"info": checkpoint_info_to_json(source.info), "meta": source.shared_meta()}


def source_from_json(store: ObjectStore, doc: dict[str, Any]) -> Source:
    """Rank 0's choice, open for reading from ``store`` (the meta is checked again, as any
    rank checks what it reads; nothing else is fetched yet)."""
    return Source(store, checkpoint_info_from_json(doc["info"], what=_WHAT), doc["meta"])


def error_to_json(exc: BaseException) -> dict[str, str]:
    """An error rank 0 met, as the other ranks raise it: its ckptstore type and message."""
    kind = type(exc).__name__ if isinstance(exc, CkptStoreError) else "CkptStoreError"
    return {"type": kind, "message": f"{type(exc).__name__}: {exc}"}


def error_from_json(doc: dict[str, str]) -> CkptStoreError:
    """The error :func:`error_to_json` sent, of the same ckptstore type where there is one."""
    kind = getattr(errors, doc["type"], None)
    if not (isinstance(kind, type) and issubclass(kind, CkptStoreError)):
        kind = CkptStoreError
    return kind(f"on rank 0, which chooses the checkpoint to load: {doc['message']}")
