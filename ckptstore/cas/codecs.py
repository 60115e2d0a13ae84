"""Codecs as objects: the contract a blob codec fulfils, and the registry keyed by header id.

A codec turns a blob's raw bytes into the payload that is stored, and back. Its ``id`` is the
byte the blob header records and its ``name`` is what the manifest's ``blobs.codec`` column
records; both are fixed forever once blobs exist that use them. Adding a codec is one object
and one :func:`register` call: from then on the header accepts its id, reads dispatch to its
``decode``, and :func:`ckptstore.cas.codec.encode` offers it blobs (after the codecs registered
before it have declined them).

The built-in codecs (``raw`` 0, ``zstd`` 1, ``bgzstd`` 2, ``fphuff`` 3) are registered by
:mod:`ckptstore.cas.codec`, which importing :mod:`ckptstore.cas` imports, so they are known
before any blob is touched.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from ckptstore.errors import ConfigError, UnreadableError

#: The manifest stores a codec's name in a String(8) column.
MAX_NAME_LEN = 8
#: The header stores a codec's id in one byte.
MAX_ID = 255


@dataclass(frozen=True, slots=True)
class Encoded:
    """A blob as one codec stores it: the payload parts and the header fields the codec sets."""

    codec: Codec
    #: The stored payload, in parts written back to back (a part may alias the raw bytes).
    payload: list[memoryview]
    #: The header's element size: what the codec grouped bytes by (1 if it does not).
    itemsize: int = 1
    #: Codec parameters the header carries (at most ``header.MAX_PARAMS`` bytes).
    params: bytes = b""

    @property
    def stored_len(self) -> int:
        """Bytes of payload the stored object holds after its header."""
        return sum(p.nbytes for p in self.payload)


@runtime_checkable
class Codec(Protocol):
    """One way of storing a blob's bytes. Both methods are called from many threads at once."""

    #: The header's codec byte (0-255). Never change or reuse it: stored blobs decode by it.
    id: int
    #: What the manifest records for blobs stored with this codec: at most 8 characters.
    name: str

    def encode(
        self, raw: memoryview, *, itemsize: int, float_like: bool, threshold: float
    ) -> Encoded | None:
        """``raw`` encoded by this codec, or None to decline: the codec does not suit the data
        (``itemsize`` and ``float_like`` describe its elements), or saves less than the
        fraction ``threshold`` of its bytes."""
        ...

    def decode(
        self, payload: memoryview, raw_len: int, *, itemsize: int, params: bytes, where: str
    ) -> memoryview:
        """The ``raw_len`` raw bytes of ``payload`` (``raw_len`` is at most the header's limit).

        ``itemsize`` and ``params`` are the header's. A payload or parameters this codec's
        format does not allow raise :class:`~ckptstore.errors.IntegrityError` naming
        ``where``: that alone counts as damage, and condemns the blob. Any other exception (a
        missing native library, a newer payload format: raise
        :class:`~ckptstore.errors.UnreadableError` for those) says this process cannot
        decode it, and changes nothing. The result is checked against the blob's digest by
        the caller.
        """
        ...


_lock = threading.Lock()
_by_id: dict[int, Codec] = {}
_by_name: dict[str, Codec] = {}
# Registration order, replaced whole on change so encoders iterate a stable snapshot.
_order: tuple[Codec, ...] = ()


def register(codec: Codec) -> Codec:
    """Make ``codec`` readable and a candidate for writing; refuses a taken id or name."""
    if not isinstance(codec, Codec):
        raise ConfigError(f"{codec!r} is not a codec: it needs id, name, encode and decode")
    if isinstance(codec.id, bool) or not isinstance(codec.id, int) or not 0 <= codec.id <= MAX_ID:
        raise ConfigError(f"codec {codec.name!r}: id {codec.id!r} is not a byte (0-{MAX_ID})")
    if not isinstance(codec.name, str) or not 0 < len(codec.name) <= MAX_NAME_LEN:
        raise ConfigError(
            f"codec name {codec.name!r} must be 1 to {MAX_NAME_LEN} characters (the manifest "
            "stores it in a column of that width)"
        )
    global _order
    with _lock:
        for taken, what in ((_by_id.get(codec.id), "id"), (_by_name.get(codec.name), "name")):
            if taken is not None:
                raise ConfigError(
                    f"cannot register codec {codec.name!r} (id {codec.id}): its {what} is "
                    f"taken by codec {taken.name!r} (id {taken.id}); choose another"
                )
        _by_id[codec.id] = codec
        _by_name[codec.name] = codec
        _order = (*_order, codec)
    return codec


def unregister(codec: Codec) -> None:
    """Forget ``codec`` (for tests): its blobs become unreadable. Unknown codecs are ignored."""
    global _order
    with _lock:
        if _by_id.get(codec.id) is codec:
            del _by_id[codec.id]
            del _by_name[codec.name]
            _order = tuple(c for c in _order if c is not codec)


def by_id(codec_id: int, where: str = "") -> Codec:
    """The codec a blob header names; ``UnreadableError`` (naming ``where``) if none has it:
    the header's CRC has already held, so the blob was written with a codec this ckptstore
    does not know, which is no sign of damage."""
    codec = _by_id.get(codec_id)
    if codec is None:
        prefix = f"{where}: " if where else ""
        raise UnreadableError(
            f"{prefix}unknown blob codec id {codec_id}: this ckptstore does not know it (a "
            "newer ckptstore or an unregistered codec wrote the blob); upgrade ckptstore or "
            "register the codec to read it"
        )
    return codec


def by_name(name: str) -> Codec:
    """The codec the manifest names ``name``; ``KeyError`` listing the known ones if none."""
    try:
        return _by_name[name]
    except KeyError:
        raise KeyError(
            f"no codec named {name!r}; this ckptstore knows {sorted(_by_name)}"
        ) from None


def registered() -> tuple[Codec, ...]:
    """Every registered codec, in registration order (the order encoders try them)."""
    return _order
