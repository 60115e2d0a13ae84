"""The one exception hierarchy of ckptstore.

Every error derives from :class:`CkptStoreError`. Where a built-in exception has the same
meaning, the subclass inherits it too (``ObjectNotFoundError`` is a ``FileNotFoundError``), so
callers can catch either. Messages say what failed, where (store URL, key, path) and what to do.
"""

from __future__ import annotations


class CkptStoreError(Exception):
    """Root of every error raised by ckptstore."""


class ConfigError(CkptStoreError, ValueError):
    """An option or URL is invalid; the message names the option and the fix."""


class ObjectStoreError(CkptStoreError, OSError):
    """An object-store operation failed permanently (after retries where they apply)."""


class ObjectNotFoundError(ObjectStoreError, FileNotFoundError):
    """The object does not exist."""


class StoreNotFoundError(ObjectStoreError):
    """The store itself (a bucket) does not exist, or holds none of what the manifest records:
    the store URL is probably wrong. Never a reason to mark a checkpoint corrupt."""


class StorePermissionError(ObjectStoreError, PermissionError):
    """The store refused the credentials or the operation."""


class IntegrityError(CkptStoreError):
    """Stored bytes do not match their recorded digest, length or format.

    ``digest`` names the damaged or missing blob when one is known.
    """

    digest: str | None = None


class UnreadableError(CkptStoreError):
    """Stored bytes that may well be healthy cannot be read by this process: an unknown codec
    id, blob kind or format version (a newer ckptstore wrote them), a codec whose
    implementation is missing or fails here, or a local limit (memory, a size this reader
    caps). Only proven damage condemns (DESIGN.md §12): this is never a reason to mark a
    checkpoint corrupt or to move a blob, and it is deliberately not an
    :class:`IntegrityError`, so that no handler of damage catches it. The message names the
    cause and the fix.

    ``digest`` names the blob when one is known.
    """

    digest: str | None = None


class SerializationError(CkptStoreError, TypeError):
    """A value cannot be saved or an index cannot be read back; the message names its path."""


class MalformedMetadataError(IntegrityError, SerializationError):
    """A checkpoint's metadata document (DCP's, Megatron's) is malformed although its blob
    verifies: written wrong, so the checkpoint is treated as corrupt (the load falls back past
    it) while no blob is condemned (``digest`` stays None)."""


class DatabaseError(CkptStoreError):
    """The manifest database failed or cannot be reached."""


class SchemaError(DatabaseError):
    """The manifest database's schema is missing, out of date, or newer than this ckptstore."""


class ForeignDatabaseError(SchemaError, ConfigError):
    """The database has tables but is not a ckptstore manifest: the --db path is wrong."""


class FencedError(CkptStoreError):
    """A newer writer opened the run; this (stale) writer may not commit."""


class CheckpointNotFoundError(CkptStoreError, LookupError):
    """No committed checkpoint matches the request."""


class RunStateError(CkptStoreError):
    """The operation does not fit the run's or checkpoint's state (a closed or read-only run,
    a checkpoint that is no longer pending); not a configuration error."""


class ComponentNotFoundError(CkptStoreError, KeyError):
    """A checkpoint has no component (or entry) of the requested name; the message lists the
    names it has."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class GcBusyError(CkptStoreError):
    """Another garbage collection holds the lease."""


class SaveError(CkptStoreError):
    """A checkpoint save failed; nothing from it became visible."""
