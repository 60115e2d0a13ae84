"""Encoding one blob into a stored object, and reading one back with verification."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from ckptstore.cas import codec
from ckptstore.cas.digest import (
    StreamingDigest,
    blob_key,
    digest_bytes,
    from_raw,
    raw_digest,
)
from ckptstore.cas.header import (
    MAX_HEADER,
    MAX_PARAMS,
    MAX_RAW_LEN,
    Header,
    Kind,
    decode_header,
)
from ckptstore.errors import ConfigError, IntegrityError, ObjectNotFoundError
from ckptstore.objectstore.base import BytesLike, ObjectStore, RandomAccess

#: :func:`read_into` reads and hashes a raw blob in pieces of this size, so each piece is
#: hashed while the read has just left it in the CPU cache.
READ_PIECE = 1 << 20


class MissingBlobError(IntegrityError, FileNotFoundError):
    """A blob that a checkpoint references is not in the store."""


@dataclass(frozen=True, slots=True)
class BlobRef:
    """What writing a blob produced; small and picklable (part of a worker's receipt)."""

    digest: str
    kind: Kind
    #: The name of the codec this write encoded it with (what the manifest records); None if
    #: the blob was already stored (not re-read).
    codec: str | None
    logical_bytes: int
    stored_bytes: int
    #: True if this write uploaded the object; False if it was already in the store.
    uploaded: bool


def encode_object(
    raw: memoryview, digest: str, kind: Kind, *, itemsize: int, float_like: bool, threshold: float
) -> tuple[Header, list[memoryview]]:
    """Header and payload parts of the stored object for ``raw`` (payload may alias ``raw``)."""
    enc = codec.encode(raw, itemsize=itemsize, float_like=float_like, threshold=threshold)
    if len(enc.params) > MAX_PARAMS or not 1 <= enc.itemsize <= 255:
        raise ConfigError(
            f"codec {enc.codec.name!r} set itemsize {enc.itemsize} and {len(enc.params)} bytes "
            f"of params; a header holds an itemsize of 1-255 and at most {MAX_PARAMS} bytes"
        )
    header = Header(
        kind=kind,
        codec=enc.codec,
        itemsize=enc.itemsize,
        raw_len=raw.nbytes,
        stored_len=enc.stored_len,
        digest=raw_digest(digest),
        params=enc.params,
    )
    return header, enc.payload


def put_blob(
    store: ObjectStore,
    raw: BytesLike,
    kind: Kind,
    *,
    itemsize: int = 1,
    float_like: bool = False,
    threshold: float = codec.MIN_GAIN,
    digest: str | None = None,
    skip_existing: bool = True,
) -> BlobRef:
    """Hash, encode and store ``raw`` unless the store already has it.

    ``skip_existing``: ask the store first, and neither encode nor send a blob it has. Without
    it the blob is encoded and put; a store that already had it keeps its own object (``put``
    never overwrites), reported as not uploaded. Its size is then the one this write would
    have stored: a commit checks every blob that is not live in the store anyway, and records
    the size it finds there (and refuses the commit if the object has gone since)."""
    view = memoryview(raw).cast("B")
    digest = digest or digest_bytes(view)
    key = blob_key(digest)
    if skip_existing:
        try:
            info = store.head(key)
        except ObjectNotFoundError:
            pass
        else:
            store.adopt(key)  # maybe another process's, not yet durable: this save flushes it
            return BlobRef(digest, kind, None, view.nbytes, info.size, uploaded=False)
    header, payload = encode_object(
        view, digest, kind, itemsize=itemsize, float_like=float_like, threshold=threshold
    )
    created = store.put(key, [header.encode(), *payload])
    if not created:
        store.adopt(key)  # another writer's object, kept: this save flushes it too
    return BlobRef(
        digest,
        kind,
        header.codec.name if created else None,
        view.nbytes,
        header.size + header.stored_len,
        uploaded=created,
    )


def decode_object(
    data: memoryview, digest: str, where: str, *, max_raw_len: int = MAX_RAW_LEN
) -> tuple[Header, memoryview]:
    """Verify a whole stored object against ``digest``; return its header and raw bytes.

    ``max_raw_len`` is what the caller knows the blob can hold at most (from the verified index
    or the manifest): a header declaring more is refused before anything is allocated for it.
    """
    header = decode_header(data, where)
    _check_header(header, digest, where, max_raw_len)
    payload = data[header.size :]
    try:
        raw = header.codec.decode(
            payload, header.raw_len, itemsize=header.itemsize, params=header.params, where=where
        )
    except (MemoryError, ValueError) as exc:
        raise IntegrityError(f"{where}: payload does not decode ({exc})") from exc
    actual = digest_bytes(raw)
    if actual != digest:
        raise IntegrityError(f"{where}: content hashes to {actual} (corrupt)")
    return header, raw


def _check_header(header: Header, digest: str, where: str, max_raw_len: int) -> None:
    if from_raw(header.digest) != digest:
        raise IntegrityError(f"{where}: header names digest {from_raw(header.digest)}")
    if header.raw_len > max_raw_len:
        raise IntegrityError(
            f"{where}: header declares {header.raw_len} bytes, more than the {max_raw_len} "
            "this blob can hold (damaged or crafted)"
        )


def keep_ref(refs: dict[str, BlobRef], ref: BlobRef) -> None:
    """Record ``ref`` under its digest; a ref that uploaded the object wins over one that
    found it stored, so a save counts the bytes it wrote exactly once, as uploaded."""
    known = refs.get(ref.digest)
    if known is None or (ref.uploaded and not known.uploaded):
        refs[ref.digest] = ref


def quarantine_blob(store: ObjectStore, digest: str, *, now: float | None = None) -> bool:
    """Move a damaged blob to ``quarantine/`` so a later save can store good bytes under its key
    (keys are never overwritten); the damaged copy stays for inspection. False if absent."""
    key = blob_key(digest)
    try:
        damaged = store.get(key)
    except ObjectNotFoundError:
        return False
    stamp = int(now if now is not None else time.time())
    store.put(f"quarantine/{digest[3:]}-{stamp}", damaged)
    store.flush()  # the copy is durable before the original goes
    store.delete([key])
    return True


def _where(store: ObjectStore, digest: str, context: str) -> str:
    return f"blob {store.url}/{blob_key(digest)}" + (f" ({context})" if context else "")


@contextmanager
def _blob_errors(digest: str, where: str) -> Iterator[None]:
    """A missing object as :class:`MissingBlobError`; integrity errors tagged with the digest
    (what repair and the fallback past a corrupt checkpoint act on)."""
    try:
        yield
    except ObjectNotFoundError as exc:
        missing = MissingBlobError(f"{where} is missing from the store")
        missing.digest = digest
        raise missing from exc
    except IntegrityError as exc:
        exc.digest = digest
        raise


def get_blob(
    store: ObjectStore, digest: str, *, context: str = "", max_raw_len: int = MAX_RAW_LEN
) -> tuple[Header, memoryview]:
    """Fetch, decode and verify one blob. Errors name the key, the store and ``context``.

    ``max_raw_len`` bounds the raw length the blob's header may declare (see ``decode_object``).
    """
    where = _where(store, digest, context)
    with _blob_errors(digest, where):
        return decode_object(
            store.get_view(blob_key(digest)), digest, where, max_raw_len=max_raw_len
        )


def read_into(
    store: ObjectStore,
    digest: str,
    targets: Sequence[tuple[int, int]],
    destination: Callable[[int], memoryview],
    *,
    context: str = "",
    max_raw_len: int = MAX_RAW_LEN,
) -> Header | None:
    """Read a raw-coded blob straight into its destinations, verifying its digest over every
    byte as the pieces arrive: one pass over the memory, no intermediate buffer.

    ``targets`` are (offset, length) ranges of the blob; ``destination(i)`` is the buffer of
    ``targets[i]``'s length its bytes go to, asked for only once every range is known to lie
    inside the blob (so a crafted index allocates nothing). Bytes no target wants are read into
    a small scratch buffer (they are hashed too). Returns the header; None, having read at most
    the header, if the store does not read in pieces (:class:`RandomAccess`), the blob is not
    stored raw, or the targets overlap other than exactly: the caller then uses
    :func:`get_blob`. If this raises, the destinations hold unverified bytes: discard them.
    """
    if not isinstance(store, RandomAccess):
        return None
    where = _where(store, digest, context)
    with _blob_errors(digest, where), store.open_reader(blob_key(digest)) as reader:
        prefix = memoryview(bytearray(min(reader.size, MAX_HEADER)))
        reader.read_into(0, prefix)
        header = decode_header(prefix, where, object_size=reader.size)
        _check_header(header, digest, where, max_raw_len)
        if header.codec is not codec.RAW:
            return None
        if header.stored_len != header.raw_len:
            raise IntegrityError(
                f"{where}: raw payload is {header.stored_len} bytes, not {header.raw_len}"
            )
        plan = _read_plan(targets, header.raw_len, where)
        if plan is None:
            return None
        fills, copies = plan
        views = {i: destination(i) for i, (_, length) in enumerate(targets) if length}
        hasher = StreamingDigest()
        scratch = memoryview(bytearray(min(READ_PIECE, header.raw_len)))
        for offset, length, target in fills:
            for start in range(0, length, READ_PIECE):
                n = min(READ_PIECE, length - start)
                piece = scratch[:n] if target is None else views[target][start : start + n]
                reader.read_into(header.size + offset + start, piece)
                hasher.update(piece)
        actual = hasher.result()
        if actual != digest:
            raise IntegrityError(f"{where}: content hashes to {actual} (corrupt)")
        for target, holder, at in copies:
            views[target][:] = views[holder][at : at + targets[target][1]]
        return header


#: One read of :func:`read_into`: (offset in the blob, length, the target it fills or None
#: for the scratch buffer).
_Fill = tuple[int, int, int | None]
#: A target filled from another's bytes once verified: (target, holder, offset in the holder).
_Copy = tuple[int, int, int]


def _read_plan(
    targets: Sequence[tuple[int, int]], raw_len: int, where: str
) -> tuple[list[_Fill], list[_Copy]] | None:
    """The reads that cover ``[0, raw_len)`` in order, each into a target or (bytes no target
    wants) the scratch buffer, and the copies that fill targets repeating bytes an earlier
    target holds (equal tensors stored once). None if targets partly overlap."""
    fills: list[_Fill] = []
    copies: list[_Copy] = []
    cursor = 0
    for i in sorted(range(len(targets)), key=lambda i: (targets[i][0], -targets[i][1])):
        offset, length = targets[i]
        end = offset + length
        if offset < 0 or length < 0 or end > raw_len:
            raise IntegrityError(f"{where}: an entry points past the end of the blob")
        if not length:
            continue
        if offset < cursor:
            # The last target read at or before ``offset`` is the only one that can hold it.
            held = next(
                ((o, n, t) for o, n, t in reversed(fills) if t is not None and o <= offset), None
            )
            if held is None or end > held[0] + held[1]:
                return None
            copies.append((i, held[2], offset - held[0]))
            continue
        if offset > cursor:
            fills.append((cursor, offset - cursor, None))
        fills.append((offset, length, i))
        cursor = end
    if cursor < raw_len:
        fills.append((cursor, raw_len - cursor, None))
    return fills, copies
