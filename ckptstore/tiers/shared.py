"""Every node sees the same object store, or the job refuses to start (DESIGN.md §13).

A local directory given as the store on a cluster is each machine's own disk: every node would
write its shards where no other node (and no later resume) finds them. So the coordinator puts
a nonce object in the store at start (:func:`put_nonce`) and every worker node reads it back
(:func:`check_nonce`) before anything is saved; a node that does not find it fails at once
with one line naming the fix. Nothing is assumed from the URL's form: an S3 store behind a
per-node endpoint, or a directory that is a shared mount, is judged by what each node sees.
"""

from __future__ import annotations

import secrets

from ckptstore.errors import ConfigError, ObjectNotFoundError
from ckptstore.objectstore import ObjectStore, open_store

#: Where nonces are written (outside ``cas/``: no blob, never garbage-collected as one).
NONCE_PREFIX = "nonces/"


def put_nonce(store: ObjectStore) -> tuple[str, str]:
    """Write a fresh nonce object, durable; its (key, value)."""
    value = secrets.token_hex(16)
    key = f"{NONCE_PREFIX}{value[:8]}"
    store.put(key, value.encode())
    store.flush()
    return key, value


def check_nonce(store: ObjectStore | str, key: str, value: str, *, node: str = "") -> None:
    """``ConfigError`` naming the fix unless ``store`` (an open store or its URL, as this node
    opens it) holds ``key`` with ``value``."""
    opened = store if isinstance(store, ObjectStore) else open_store(store, create=False)
    where = f"node {node!r}" if node else "this node"
    try:
        found = bytes(opened.get(key))
    except (ObjectNotFoundError, ConfigError):
        found = None
    finally:
        if opened is not store:
            opened.close()
    if found != value.encode():
        raise ConfigError(
            f"{where} does not see the object store {opened.url} that the controller wrote its "
            f"check object {key} to: each node has a store of its own there (a local directory "
            "is one machine's disk). Use a store every node shares: S3 (--store "
            "s3://bucket/prefix, checkpointing.store) or a shared file system mounted at the "
            "same path on every node"
        )


def remove_nonce(store: ObjectStore, key: str) -> None:
    """Delete the nonce once every node has checked it."""
    store.delete([key])
