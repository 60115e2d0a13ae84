"""Encoding one blob into a stored object, and reading one back with verification."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import cast

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
from ckptstore.errors import ConfigError, IntegrityError, ObjectNotFoundError, UnreadableError
from ckptstore.objectstore.base import BytesLike, Copies, ObjectStore, RandomAccess

#: :func:`read_into` reads and hashes a raw blob in pieces of this size, so each piece is
#: hashed while the read has just left it in the CPU cache.
READ_PIECE = 1 << 20
#: Where damaged blobs are moved: ``quarantine/<hex>-<unix time>``.
QUARANTINE = "quarantine/"


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
    if raw.nbytes > MAX_RAW_LEN:
        # The format's limit: every reader refuses a header that declares more.
        raise ConfigError(
            f"a blob of {raw.nbytes} bytes is more than a blob may hold ({MAX_RAW_LEN}); "
            "lower WriterOptions.chunk_bytes"
        )
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
    data: memoryview,
    digest: str,
    where: str,
    *,
    max_raw_len: int = MAX_RAW_LEN,
    limit: int | None = None,
) -> tuple[Header, memoryview]:
    """Verify a whole stored object against ``digest``; return its header and raw bytes.

    ``max_raw_len`` is what the caller knows the blob holds at most (from the verified index
    or the manifest): a header declaring more is refused as damaged before anything is
    allocated for it. ``limit`` is this reader's own cap, no evidence about the blob: a
    header declaring more is :class:`UnreadableError`.
    """
    header = decode_header(data, where)
    _check_header(header, digest, where, max_raw_len, limit)
    raw = _decode_payload(header, data[header.size :], where)
    actual = digest_bytes(raw)
    if actual != digest:
        raise IntegrityError(f"{where}: content hashes to {actual} (corrupt)")
    return header, raw


def _decode_payload(header: Header, payload: memoryview, where: str) -> memoryview:
    """The codec's decoding of ``payload``. Only the codec's own verdict that the payload is
    malformed (``IntegrityError``) is damage; a codec that fails for any other reason (its
    native library missing, too little memory) says nothing about the stored bytes."""
    try:
        return header.codec.decode(
            payload, header.raw_len, itemsize=header.itemsize, params=header.params, where=where
        )
    except (IntegrityError, UnreadableError):
        raise
    except MemoryError as exc:
        raise UnreadableError(
            f"{where}: too little memory to decode its {header.raw_len} bytes "
            f"({header.codec.name}); free memory, or load fewer components at once"
        ) from exc
    except Exception as exc:
        raise UnreadableError(
            f"{where}: the {header.codec.name!r} codec cannot decode it in this process "
            f"({type(exc).__name__}: {exc})"
        ) from exc


def _check_header(
    header: Header, digest: str, where: str, max_raw_len: int, limit: int | None
) -> None:
    if from_raw(header.digest) != digest:
        raise IntegrityError(f"{where}: header names digest {from_raw(header.digest)}")
    if header.raw_len > max_raw_len:
        raise IntegrityError(
            f"{where}: header declares {header.raw_len} bytes, more than the {max_raw_len} "
            "this blob can hold (damaged or crafted)"
        )
    if limit is not None and header.raw_len > limit:
        raise UnreadableError(
            f"{where}: blob holds {header.raw_len} bytes, more than this reader reads in one "
            f"piece ({limit})"
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
    store.put(f"{QUARANTINE}{digest[3:]}-{stamp}", damaged)
    store.flush()  # the copy is durable before the original goes
    store.delete([key])
    return True


def good_quarantined_copy(
    store: ObjectStore, digest: str, *, max_raw_len: int = MAX_RAW_LEN
) -> tuple[str, bytearray] | None:
    """The newest quarantined copy of ``digest`` that verifies in full, as (its key, its
    bytes): a blob that was quarantined although it is good. None if no copy verifies (those
    stay for inspection); :class:`UnreadableError` if a copy cannot be read here."""
    for key in _quarantined_copies(store, digest):
        try:
            data = store.get(key)
            decode_object(
                memoryview(data), digest, f"quarantined {store.url}/{key}", max_raw_len=max_raw_len
            )
        except (ObjectNotFoundError, IntegrityError):
            continue  # gone meanwhile, or really damaged
        return key, data
    return None


def put_back(store: ObjectStore, digest: str, copy: tuple[str, bytearray]) -> bool:
    """Store a good quarantined ``copy`` (from :func:`good_quarantined_copy`) under its blob's
    key again and remove the copy; False (the copy kept) if the key holds an object already."""
    key, data = copy
    if not store.put(blob_key(digest), data):
        return False
    store.flush()  # the blob is durable under its key before the copy goes
    store.delete([key])
    return True


def _quarantined_copies(store: ObjectStore, digest: str) -> list[str]:
    """Keys of ``digest``'s quarantined copies, newest first (by their time stamp)."""
    prefix = f"{QUARANTINE}{digest[3:]}-"
    stamped = []
    for info in store.list(prefix):
        stamp = info.key[len(prefix) :]
        if stamp.isdigit():
            stamped.append((int(stamp), info.key))
    return [key for _, key in sorted(stamped, reverse=True)]


def _where(store: ObjectStore, digest: str, context: str) -> str:
    return f"blob {store.url}/{blob_key(digest)}" + (f" ({context})" if context else "")


@contextmanager
def _blob_errors(digest: str, where: str) -> Iterator[None]:
    """A missing object as :class:`MissingBlobError`, too little memory as
    :class:`UnreadableError`; errors tagged with the digest (what repair and the fallback past
    a corrupt checkpoint act on)."""
    try:
        yield
    except ObjectNotFoundError as exc:
        missing = MissingBlobError(f"{where} is missing from the store")
        missing.digest = digest
        raise missing from exc
    except MemoryError as exc:
        unreadable = UnreadableError(f"{where}: too little memory to read it; free memory")
        unreadable.digest = digest
        raise unreadable from exc
    except (IntegrityError, UnreadableError) as exc:
        exc.digest = digest
        raise


def get_blob(
    store: ObjectStore,
    digest: str,
    *,
    context: str = "",
    max_raw_len: int = MAX_RAW_LEN,
    limit: int | None = None,
) -> tuple[Header, memoryview]:
    """Fetch, decode and verify one blob. Errors name the key, the store and ``context``.

    ``max_raw_len`` and ``limit`` bound the raw length the blob's header may declare (see
    ``decode_object``).
    """
    where = _where(store, digest, context)
    while True:
        try:
            with _blob_errors(digest, where):
                return decode_object(
                    store.get_view(blob_key(digest)),
                    digest,
                    where,
                    max_raw_len=max_raw_len,
                    limit=limit,
                )
        except IntegrityError as exc:
            if not next_copy(store, digest, exc):
                raise


def decode_held(
    store: ObjectStore,
    digest: str,
    data: memoryview,
    *,
    context: str = "",
    max_raw_len: int = MAX_RAW_LEN,
) -> tuple[Header, memoryview]:
    """Decode and verify the stored object of ``digest`` in ``store`` from ``data``, bytes of
    it already in hand (another rank read and sent them), with the errors :func:`get_blob`
    raises for it."""
    where = _where(store, digest, f"{context}, sent by another rank" if context else "")
    with _blob_errors(digest, where):
        return decode_object(data, digest, where, max_raw_len=max_raw_len)


def next_copy(store: ObjectStore, digest: str, error: IntegrityError) -> bool:
    """Whether ``store`` has another copy of ``digest`` to read after the one that just failed
    with ``error`` (a store of several copies, :class:`Copies`, skips the bad one)."""
    return isinstance(store, Copies) and store.failed(blob_key(digest), error)


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
    stored raw, or the targets overlap other than exactly or reach past the blob's end: the
    caller then uses :func:`get_blob` (which verifies the blob whole first, so that a bad range
    is blamed on the index that holds it, not on a blob that verifies). If this raises, the
    destinations hold unverified bytes: discard them.
    """
    if not isinstance(store, RandomAccess):
        return None
    while True:
        try:
            return _read_into(store, digest, targets, destination, context, max_raw_len)
        except IntegrityError as exc:
            if not next_copy(store, digest, exc):
                raise


def _read_into(
    store: ObjectStore,
    digest: str,
    targets: Sequence[tuple[int, int]],
    destination: Callable[[int], memoryview],
    context: str,
    max_raw_len: int,
) -> Header | None:
    """One read of :func:`read_into` from the copy ``store`` reads now."""
    where = _where(store, digest, context)
    readable = cast(RandomAccess, store)
    with _blob_errors(digest, where), readable.open_reader(blob_key(digest)) as reader:
        prefix = memoryview(bytearray(min(reader.size, MAX_HEADER)))
        reader.read_into(0, prefix)
        header = decode_header(prefix, where, object_size=reader.size)
        _check_header(header, digest, where, max_raw_len, None)
        if header.codec is not codec.RAW:
            return None
        if header.stored_len != header.raw_len:
            raise IntegrityError(
                f"{where}: raw payload is {header.stored_len} bytes, not {header.raw_len}"
            )
        plan = _read_plan(targets, header.raw_len)
        if plan is None:
            return None
        fills, copies = plan
        views = {i: destination(i) for i, (_, length) in enumerate(targets) if length}
        hasher = StreamingDigest()
        # Only bytes no target wants pass through the scratch piece: most blobs have none.
        unwanted = max((length for _, length, target in fills if target is None), default=0)
        scratch = memoryview(bytearray(min(READ_PIECE, unwanted)))
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
    targets: Sequence[tuple[int, int]], raw_len: int
) -> tuple[list[_Fill], list[_Copy]] | None:
    """The reads that cover ``[0, raw_len)`` in order, each into a target or (bytes no target
    wants) the scratch buffer, and the copies that fill targets repeating bytes an earlier
    target holds (equal tensors stored once). None if targets partly overlap or reach past
    the blob's end."""
    fills: list[_Fill] = []
    copies: list[_Copy] = []
    cursor = 0
    for i in sorted(range(len(targets)), key=lambda i: (targets[i][0], -targets[i][1])):
        offset, length = targets[i]
        end = offset + length
        if offset < 0 or length < 0 or end > raw_len:
            return None
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
