"""Read-ahead for a load: the store reads the next blobs while the workers verify theirs.

A load worker reads a blob piece by piece and hashes each piece as it arrives (one pass over
the memory). Left alone, the disk is asked for a blob only when a worker opens it: while the
workers hash what they hold, or move from one blob to the next, it waits (issue 26 measured a
load thread in disk wait 18-27 % of the time, on a load bounded by neither). On a store that
can start reading an object in the background (:class:`Prefetching`: a local directory, whose
kernel reads a file into its page cache when told), one thread of each load asks for the blobs
the workers take next, in the order they take them, staying at most ``window`` bytes ahead of
the blobs they have taken: the disk streams while the CPUs copy and hash, and the page cache
holds little more of the load than the blobs being verified and the window. A blob read
ahead is still read, and verified, whole by its worker; read-ahead only decides when the disk
fetches it.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from types import TracebackType
from typing import Protocol, runtime_checkable

#: How far ahead of the workers the store reads, in bytes: enough to keep a disk streaming
#: through a blob boundary or two (a blob holds at most 64 MiB by default), little enough that
#: the page cache holds only a small part of a large load ahead of its use.
WINDOW = 128 << 20


@runtime_checkable
class Prefetching(Protocol):
    """A store that can start reading an object in the background (``LocalStore``)."""

    def prefetch(self, key: str) -> int:
        """Start reading ``key`` ahead; its size in bytes (0 if it cannot: advice only)."""
        ...


class ReadAhead:
    """Reads ``keys`` ahead, in order, on a thread of its own, at most ``window`` bytes ahead
    of the keys the workers have :meth:`taken`. Use it as a context manager around them.

    Reading ahead is advice: a store that fails to take it costs the load nothing but the
    overlap, and the workers' own reads report every error.
    """

    def __init__(self, store: Prefetching, keys: Sequence[str], *, window: int = WINDOW) -> None:
        self._store, self._keys, self._window = store, list(keys), window
        self._cond = threading.Condition()
        #: Bytes read ahead that no worker has taken yet.
        self._ahead = 0
        #: Size of each key read ahead and not taken yet.
        self._sizes: dict[str, int] = {}
        #: Keys taken before the read-ahead reached them: still asked for (the rest of the
        #: blob streams ahead of its worker), but not counted as ahead of the workers.
        self._taken: set[str] = set()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="ckpt-readahead", daemon=True)

    def __enter__(self) -> ReadAhead:
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def taken(self, key: str) -> None:
        """A worker starts reading ``key``: its bytes are no longer ahead of the workers."""
        with self._cond:
            size = self._sizes.pop(key, None)
            if size is None:
                self._taken.add(key)
            else:
                self._ahead -= size
                self._cond.notify()

    def close(self) -> None:
        """Stop reading ahead (what was asked for may still arrive) and wait for the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        for key in self._keys:
            with self._cond:
                while not self._closed and self._ahead > self._window:
                    self._cond.wait()
                if self._closed:
                    return
            size = self._store.prefetch(key)
            with self._cond:
                if key in self._taken:  # taken while it was being asked for
                    continue
                self._sizes[key] = size
                self._ahead += size
