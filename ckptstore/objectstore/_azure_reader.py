"""Reading one Azure blob at any offset (:class:`~.base.RandomAccess`), and the small writer
that lands a download in the caller's buffer.

The blob reader reads a blob's header, then its payload in order, piece by piece, straight into
the tensors it fills. Here that is a small ranged GET of the blob's first bytes (the header,
and the blob's size from the answer), kept in memory, then one download from the first byte
read beyond them to the blob's end, whose chunks (ranged GETs of the client's chunk size,
fetched as they are consumed) every later read in order continues. A read that goes back, or
skips ahead, starts a new download at its offset; a failed one is retried from where it stopped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from azure.core.exceptions import HttpResponseError

from ckptstore.errors import ObjectStoreError
from ckptstore.objectstore._azure_errors import TruncatedResponseError, error_code

if TYPE_CHECKING:
    from azure.storage.blob import BlobClient

#: Bytes the first GET asks for: more than any blob header (576 bytes at most), and little
#: enough to cost about what a HEAD would when the blob turns out to be compressed.
FIRST_BYTES = 4 << 10


class ViewWriter:
    """A seekable file over a writable buffer: the SDK's downloader writes each chunk (several
    at once, at their offsets) straight into the caller's memory."""

    def __init__(self, view: memoryview) -> None:
        self._view = view
        self._pos = 0
        #: The highest offset written: a download that ends early is caught by its length.
        self.end = 0

    def writable(self) -> bool:
        """Always: it is written into."""
        return True

    def seekable(self) -> bool:
        """Always: parallel chunks are written at their offsets."""
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        """Move to ``offset`` (from the start, or with ``whence=1`` from here)."""
        self._pos = offset if whence == 0 else self._pos + offset
        return self._pos

    def tell(self) -> int:
        """The offset the next write lands at."""
        return self._pos

    def write(self, data: Any) -> int:
        """Copy ``data`` into the buffer at the current offset; TruncatedResponseError (a
        retried fault) if it would run past the end."""
        n = len(data)
        if self._pos + n > self._view.nbytes:
            raise TruncatedResponseError(
                f"the service sent {self._pos + n} bytes where {self._view.nbytes} were expected"
            )
        self._view[self._pos : self._pos + n] = data
        self._pos += n
        self.end = max(self.end, self._pos)
        return n


def is_invalid_range(exc: BaseException) -> bool:
    """Whether ``exc`` is a 416 answer: a range that starts at or past a blob's end."""
    return isinstance(exc, HttpResponseError) and (
        exc.status_code == 416 or error_code(exc) == "InvalidRange"
    )


class AzureObjectReader:
    """One blob, open for reads at any offset. Close it when done."""

    def __init__(
        self, blob: BlobClient, where: str, call: Callable[[Callable[[], Any]], Any]
    ) -> None:
        """Open ``blob`` (``where`` names it in errors): one GET of its first bytes, through
        ``call`` (the store's retries and error translation), which raises ObjectNotFoundError
        for a missing blob."""
        self._blob, self._where, self._call = blob, where, call
        #: The download in progress: its chunks, the rest of the current one, and the blob
        #: offset of the next byte it gives.
        self._chunks: Iterator[bytes] | None = None
        self._left = memoryview(b"")
        self._position = 0
        self._head = b""
        self.size = 0
        call(self._first_get)

    def _first_get(self) -> None:
        try:
            download = self._blob.download_blob(offset=0, length=FIRST_BYTES, max_concurrency=1)
        except HttpResponseError as exc:
            if not is_invalid_range(exc):
                raise
            self.size, self._head = 0, b""  # an empty blob: no byte range can be satisfied
            return
        # "bytes 0-4095/1048576"; the SDK's size is the range's, the total is after the '/'.
        content_range = download.properties.content_range
        self.size = int(content_range.rsplit("/", 1)[1]) if content_range else download.size
        head = download.readall()
        if len(head) != min(self.size, FIRST_BYTES):
            raise TruncatedResponseError(
                f"reading {self._where}: got {len(head)} of the first "
                f"{min(self.size, FIRST_BYTES)} bytes"
            )
        self._head = bytes(head)

    def read_into(self, offset: int, view: memoryview) -> None:
        """Fill ``view`` with the blob's bytes from ``offset``."""
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
        """Fill ``view`` from ``offset`` with the download, started there if the one in
        progress is elsewhere; a failed attempt is resumed where it stopped."""
        done = 0

        def attempt() -> None:
            nonlocal done
            at = offset + done
            if self._chunks is None or self._position != at:
                self._open(at)
            try:
                while done < view.nbytes:
                    if not self._left.nbytes:
                        assert self._chunks is not None
                        chunk = next(self._chunks, None)
                        if not chunk:
                            raise TruncatedResponseError(
                                f"reading {self._where}: the download ended at byte "
                                f"{self._position} of {self.size}"
                            )
                        self._left = memoryview(chunk)
                    n = min(self._left.nbytes, view.nbytes - done)
                    view[done : done + n] = self._left[:n]
                    self._left = self._left[n:]
                    done += n
                    self._position += n
            except BaseException:
                self.close()  # the retry starts a new download where this one stopped
                raise

        self._call(attempt)

    def _open(self, offset: int) -> None:
        self.close()
        download = self._blob.download_blob(offset=offset, max_concurrency=1)
        self._chunks, self._position = download.chunks(), offset

    def close(self) -> None:
        """Drop the download in progress, if any."""
        self._chunks, self._left = None, memoryview(b"")
