"""The parallel, bounded-memory blob pipeline: hash, skip what is stored, encode, upload.

Producers call :meth:`BlobWriter.submit` with zero-copy views of tensor memory. Each blob is one
task on a thread pool: BLAKE3 and zstd release the GIL and uploads wait on I/O, so threads give
real parallelism. ``submit`` blocks while the bytes of unfinished tasks exceed
``max_inflight_bytes``; that is what bounds memory (compressed buffers, byte planes) whatever the
size of the state.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from ckptstore.cas import codec
from ckptstore.cas.blobs import BlobRef, put_blob
from ckptstore.cas.digest import digest_bytes
from ckptstore.cas.header import Kind
from ckptstore.errors import ConfigError
from ckptstore.objectstore.base import ObjectStore

MiB = 1 << 20


@dataclass(frozen=True, kw_only=True, slots=True)
class WriterOptions:
    """How state is cut into blobs and how hard the pipeline works."""

    #: Largest chunk of one tensor's bytes (element-aligned); larger tensors span chunks.
    chunk_bytes: int = 64 * MiB
    #: Tensors and byte strings smaller than this are gathered into packs.
    pack_threshold: int = 1 * MiB
    #: Target size of a pack.
    pack_bytes: int = 16 * MiB
    #: Worker threads for hashing, compression and uploads; 0 picks from the CPU count.
    max_workers: int = 0
    #: Upper bound on bytes of blobs being processed at once (bounds extra memory).
    max_inflight_bytes: int = 512 * MiB
    #: ``auto``, ``always`` or ``never`` (see :class:`ckptstore.cas.codec.Compression`).
    compression: str = "auto"
    #: Take the chunk digests of a tensor whose PyTorch version counter (and storage, place
    #: and layout) is unchanged since this writer's previous save, instead of hashing its
    #: bytes again: an incremental save then hashes only what changed. Off by default, since
    #: some writes go uncounted (``tensor.data``, the fused ``torch.optim`` optimizers, numpy
    #: views): see :mod:`ckptstore.serialize.unchanged` for the limits and the guard. Only a
    #: run's own saves reuse digests (a ``ShardWriter`` does not know which blobs are live).
    reuse_unchanged_digests: bool = False

    def __post_init__(self) -> None:
        if self.chunk_bytes < 1 * MiB:
            raise ConfigError("WriterOptions.chunk_bytes must be at least 1 MiB")
        if not 0 <= self.pack_threshold <= self.pack_bytes:
            raise ConfigError("WriterOptions needs 0 <= pack_threshold <= pack_bytes")
        if self.max_workers < 0:
            raise ConfigError("WriterOptions.max_workers must be >= 0 (0 = automatic)")
        if self.max_inflight_bytes < 1 * MiB:
            raise ConfigError("WriterOptions.max_inflight_bytes must be at least 1 MiB")
        codec.Compression.parse(self.compression)

    def workers(self) -> int:
        """The number of worker threads to run (``max_workers``, or one from the CPU count)."""
        return self.max_workers or min(16, 2 * (os.cpu_count() or 1) + 2)


class _ByteBudget:
    """A counting semaphore in bytes; one oversized request may run alone."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._used = 0
        self._cond = threading.Condition()

    def acquire(self, n: int) -> None:
        with self._cond:
            while self._used and self._used + n > self._limit:
                self._cond.wait()
            self._used += n

    def release(self, n: int) -> None:
        with self._cond:
            self._used -= n
            self._cond.notify_all()


class BlobWriter:
    """Stores blobs into ``store`` in parallel. Thread-safe; close it when done.

    ``known`` may say that a digest is already stored (a manifest's live blobs); such blobs
    are neither probed nor uploaded. Other blobs are probed first (a HEAD request decides),
    except, with ``known``, on a store that does not want new blobs probed
    (:attr:`ObjectStore.probe_new_blobs`): there they are sent straight away.
    """

    def __init__(
        self,
        store: ObjectStore,
        options: WriterOptions | None = None,
        *,
        known: Callable[[str], bool] | None = None,
    ) -> None:
        self.store = store
        self.options = options or WriterOptions()
        self._threshold = codec.min_gain(
            codec.Compression.parse(self.options.compression), store.write_bandwidth_hint
        )
        self._known = known
        self._probe = known is None or store.probe_new_blobs
        self._budget = _ByteBudget(self.options.max_inflight_bytes)
        self._pool = ThreadPoolExecutor(self.options.workers(), thread_name_prefix="ckpt-blob")
        self._lock = threading.Lock()
        self._stored: dict[str, Future[BlobRef]] = {}

    def submit(
        self,
        raw: memoryview,
        kind: Kind,
        *,
        itemsize: int = 1,
        float_like: bool = False,
        keepalive: object = None,
    ) -> Future[BlobRef]:
        """Queue ``raw`` (which must stay unchanged until the future is done) for storing.

        ``keepalive`` is held until the task ends (the tensor that owns ``raw``'s memory).
        """
        n = raw.nbytes
        self._budget.acquire(n)
        try:
            future = self._pool.submit(self._store_one, raw, kind, itemsize, float_like, keepalive)
        except BaseException:
            self._budget.release(n)
            raise
        future.add_done_callback(lambda _f: self._budget.release(n))
        return future

    def is_known(self, digest: str) -> bool:
        """Whether ``known`` says ``digest`` is stored (False for a writer without it)."""
        return self._known is not None and self._known(digest)

    def _store_one(
        self, raw: memoryview, kind: Kind, itemsize: int, float_like: bool, _keepalive: object
    ) -> BlobRef:
        digest = digest_bytes(raw)
        # The first task with a digest stores it; identical blobs (in flight at the same time
        # or later in this save) wait for that one and report "not uploaded".
        with self._lock:
            first = self._stored.get(digest)
            if first is None:
                mine: Future[BlobRef] = Future()
                self._stored[digest] = mine
        if first is not None:
            seen = first.result()
            return BlobRef(digest, kind, seen.codec, raw.nbytes, seen.stored_bytes, uploaded=False)
        try:
            if self._known is not None and self._known(digest):
                ref = BlobRef(digest, kind, None, raw.nbytes, 0, uploaded=False)
            else:
                ref = put_blob(
                    self.store,
                    raw,
                    kind,
                    itemsize=itemsize,
                    float_like=float_like,
                    threshold=self._threshold,
                    digest=digest,
                    skip_existing=self._probe,
                )
        except BaseException as exc:
            with self._lock:
                self._stored.pop(digest, None)  # let a later attempt try again
            mine.set_exception(exc)
            raise
        mine.set_result(ref)
        return ref

    def forget(self) -> None:
        """Drop the memory of what this writer stored, so the next blobs are checked afresh.

        Called at the start of every save: between saves, garbage collection may have removed
        a blob that no committed checkpoint kept.
        """
        with self._lock:
            self._stored.clear()

    def close(self) -> None:
        """Wait for queued blobs to be stored, then stop the worker threads."""
        self._pool.shutdown(wait=True)

    def __enter__(self) -> BlobWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
