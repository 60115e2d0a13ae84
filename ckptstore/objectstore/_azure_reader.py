"""Reading one Azure blob at any offset (:class:`~.base.RandomAccess`), and the small writer
that lands a download in the caller's buffer.

:class:`AzureObjectReader` is the Azure side of :class:`~._streaming.StreamingReader`: a small
ranged GET of the blob's first bytes (the header, and the blob's size from the answer), kept in
memory, then one download from the first byte read beyond them to the blob's end, whose chunks
(ranged GETs of the client's chunk size, fetched as they are consumed) every later read in
order continues. A read that goes back, or skips ahead, starts a new download at its offset; a
failed one is retried from where it stopped. The SDK hands a download over as chunks of bytes,
not as a stream to read into: each is copied into the caller's view once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, cast

from azure.core.exceptions import HttpResponseError

from ckptstore.objectstore._azure_errors import TruncatedResponseError, error_code
from ckptstore.objectstore._streaming import FIRST_BYTES, StreamingReader

if TYPE_CHECKING:
    from azure.storage.blob import BlobClient


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


class _Chunks:
    """A download read as a body: its chunks (ranged GETs of the client's chunk size, fetched as
    they are consumed), copied into the caller's view as far as each reaches."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self._chunks = chunks
        #: The rest of the current chunk.
        self._left = memoryview(b"")

    def readinto(self, view: memoryview) -> int:
        """Copy the next bytes into ``view``: the rest of this chunk, or of the next; 0 once
        the download has ended."""
        if not self._left.nbytes:
            chunk = next(self._chunks, None)
            if not chunk:
                return 0
            self._left = memoryview(chunk)
        n = min(self._left.nbytes, view.nbytes)
        view[:n] = self._left[:n]
        self._left = self._left[n:]
        return n

    def close(self) -> None:
        """Drop the download: the chunks not fetched yet never are."""
        self._chunks, self._left = iter(()), memoryview(b"")


class AzureObjectReader(StreamingReader):
    """One blob, open for reads at any offset. Close it when done."""

    _truncated = TruncatedResponseError
    _stream_name = "download"

    def __init__(
        self, blob: BlobClient, where: str, call: Callable[[Callable[[], Any]], Any]
    ) -> None:
        """Open ``blob`` (``where`` names it in errors): one GET of its first bytes, through
        ``call`` (the store's retries and error translation), which raises ObjectNotFoundError
        for a missing blob."""
        self._blob = blob
        super().__init__(where, call)

    def _open_first(self) -> tuple[Any, int, int] | None:
        try:
            download = self._blob.download_blob(offset=0, length=FIRST_BYTES, max_concurrency=1)
        except HttpResponseError as exc:
            if not is_invalid_range(exc):
                raise
            return None
        # "bytes 0-4095/1048576"; the SDK's size is the range's, the total is after the '/'.
        content_range = download.properties.content_range
        size = int(content_range.rsplit("/", 1)[1]) if content_range else download.size
        return _Chunks(download.chunks()), min(size, FIRST_BYTES), size

    def _open_at(self, offset: int) -> Any:
        download = self._blob.download_blob(offset=offset, max_concurrency=1)
        return _Chunks(download.chunks())

    def _readinto(self, body: Any, view: memoryview) -> int:
        return cast(int, body.readinto(view))
