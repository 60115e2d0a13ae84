"""Encoding one blob into a stored object, and reading one back with verification."""

from __future__ import annotations

import time
from dataclasses import dataclass

from ckptstore.cas import codec
from ckptstore.cas.digest import blob_key, digest_bytes, from_raw, raw_digest
from ckptstore.cas.header import MAX_PARAMS, MAX_RAW_LEN, Header, Kind, decode_header
from ckptstore.errors import ConfigError, IntegrityError, ObjectNotFoundError
from ckptstore.objectstore.base import BytesLike, ObjectStore


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
    """Hash, encode and store ``raw`` unless the store already has it."""
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
    return BlobRef(
        digest,
        kind,
        header.codec.name,
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
    if from_raw(header.digest) != digest:
        raise IntegrityError(f"{where}: header names digest {from_raw(header.digest)}")
    if header.raw_len > max_raw_len:
        raise IntegrityError(
            f"{where}: header declares {header.raw_len} bytes, more than the {max_raw_len} "
            "this blob can hold (damaged or crafted)"
        )
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


def get_blob(
    store: ObjectStore, digest: str, *, context: str = "", max_raw_len: int = MAX_RAW_LEN
) -> tuple[Header, memoryview]:
    """Fetch, decode and verify one blob. Errors name the key, the store and ``context``.

    ``max_raw_len`` bounds the raw length the blob's header may declare (see ``decode_object``).
    """
    key = blob_key(digest)
    where = f"blob {store.url}/{key}" + (f" ({context})" if context else "")
    try:
        return decode_object(store.get_view(key), digest, where, max_raw_len=max_raw_len)
    except ObjectNotFoundError as exc:
        missing = MissingBlobError(f"{where} is missing from the store")
        missing.digest = digest
        raise missing from exc
    except IntegrityError as exc:
        exc.digest = digest
        raise
