"""Reading one remote object at any offset over streamed ranged GETs (:class:`~.base.RandomAccess`).

The blob reader reads a blob's header, then its payload in order, piece by piece, straight into
the tensors it fills. Done naively that is one GET per piece; here it is two requests, whatever
the number of pieces: a small GET of the object's first bytes (the header, and the object's size
from the answer), kept in memory, and one streamed GET from the first byte read beyond them to
the object's end, which every later read in order continues. A read that goes back, or skips
ahead, starts a new streamed GET at its offset. A stream cut short is retried like any request:
the next GET starts where the cut one stopped.

:class:`StreamingReader` holds that logic once; a backend (:mod:`._s3_reader`,
:mod:`._gcs_reader`, :mod:`._azure_reader`) says only how a ranged GET is opened and how its body
is read into a view, in steps of its own size, with no copy in between.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any, ClassVar

from ckptstore.errors import ObjectStoreError

#: Bytes the first GET asks for: more than any blob header (576 bytes at most), and little
#: enough to cost about what a HEAD would when the blob turns out to be compressed (the blob
#: reader then fetches it whole with ``get_view``).
FIRST_BYTES = 4 << 10


class StreamingReader(abc.ABC):
    """One remote object, open for reads at any offset. Close it when done.

    A body, as the hooks hand it over, is whatever the backend reads from; the base only
    passes it back to :meth:`_readinto` and calls its ``close()``."""

    #: The backend's error for a body that ends early: its store retries it as transient.
    _truncated: ClassVar[type[ObjectStoreError]]
    #: What a streamed GET is called in the error of one cut short.
    _stream_name: ClassVar[str] = "response"

    def __init__(self, where: str, call: Callable[[Callable[[], Any]], Any]) -> None:
        """Open the object (``where`` names it in errors): one GET of its first bytes, through
        ``call`` (the store's retries and error translation), which raises ObjectNotFoundError
        for a missing object. A subclass sets what its hooks use before calling this."""
        self._where, self._call = where, call
        #: The streamed GET in progress, and the object offset of its next byte.
        self._body: Any = None
        self._position = 0
        self._head = b""
        self.size = 0
        call(self._first_get)

    @abc.abstractmethod
    def _open_first(self) -> tuple[Any, int, int] | None:
        """A GET of the object's first :data:`FIRST_BYTES`: its body, the answer's length and
        the object's size (from ``Content-Range``: a server that ignores the range sends the
        whole object); None for an empty object, of which no byte range can be satisfied."""

    @abc.abstractmethod
    def _open_at(self, offset: int) -> Any:
        """A streamed GET of the object from ``offset`` (less than :attr:`size`) to its end."""

    @abc.abstractmethod
    def _readinto(self, body: Any, view: memoryview) -> int:
        """Read the next bytes of ``body`` into the start of ``view`` (at most the backend's
        step); the number read, 0 once the body has ended."""

    def _first_get(self) -> None:
        first = self._open_first()
        if first is None:
            self.size, self._head = 0, b""
            return
        body, length, self.size = first
        head = bytearray(min(length, FIRST_BYTES))
        got = 0
        while got < len(head):
            n = self._readinto(body, memoryview(head)[got:])
            if not n:
                break
            got += n
        if got != len(head):
            body.close()
            raise self._truncated(
                f"reading {self._where}: got {got} of the first {len(head)} bytes"
            )
        self._head = bytes(head)
        self._drop()
        if length > len(head):  # the whole object came: keep streaming it
            self._body, self._position = body, len(head)
        else:
            body.close()

    def read_into(self, offset: int, view: memoryview) -> None:
        """Fill ``view`` with the object's bytes from ``offset``."""
        end = offset + view.nbytes
        if offset < 0 or end > self.size:
            raise ObjectStoreError(
                f"reading {self._where}: bytes [{offset}, {end}) lie outside the object "
                f"({self.size} bytes)"
            )
        cached = max(0, min(end, len(self._head)) - offset)
        if cached:
            view[:cached] = self._head[offset : offset + cached]
        if cached < view.nbytes:
            self._stream_into(offset + cached, view[cached:])

    def _stream_into(self, offset: int, view: memoryview) -> None:
        """Fill ``view`` from ``offset`` with the streamed GET, started there if the stream in
        progress is elsewhere; a failed attempt is resumed where it stopped."""
        done = 0

        def attempt() -> None:
            nonlocal done
            at = offset + done
            if self._body is None or self._position != at:
                self._drop()
                self._body, self._position = self._open_at(at), at
            try:
                while done < view.nbytes:
                    n = self._readinto(self._body, view[done:])
                    if not n:
                        raise self._truncated(
                            f"reading {self._where}: the {self._stream_name} ended at byte "
                            f"{self._position} of {self.size}"
                        )
                    done += n
                    self._position += n
            except BaseException:
                self._drop()  # the retry starts a new GET where this one stopped
                raise

        self._call(attempt)

    def _drop(self) -> None:
        body, self._body = self._body, None
        if body is not None:
            body.close()

    def close(self) -> None:
        """Close the streamed GET in progress, if any."""
        self._drop()
