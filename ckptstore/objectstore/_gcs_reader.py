"""Reading GCS objects: whole or ranged GETs straight into the caller's buffer, and one object
open for reads at any offset (:class:`~.base.RandomAccess`).

A GET streams the body into a buffer allocated once from the answer's ``Content-Length``, a
step at a time: no intermediate copy of the object. :class:`GCSObjectReader` is the GCS side
of :class:`~._streaming.StreamingReader`: one small GET of the first bytes (the blob header, and
the object's size from ``Content-Range``), then one streamed ranged GET that reads in order
continue; a read elsewhere starts a new GET there, and a stream cut short resumes where it stopped.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast
from urllib.parse import quote

from ckptstore.errors import ObjectStoreError
from ckptstore.objectstore._gcs_errors import TruncatedResponseError, raise_for_answer
from ckptstore.objectstore._streaming import FIRST_BYTES, StreamingReader

B = TypeVar("B", bytearray, memoryview)
#: Bytes asked of a response body per read (as for S3: cache-sized steps, no big temporaries).
READ_STEP = 1 << 20


def media_url(endpoint: str, bucket: str, name: str) -> str:
    """The JSON API's download URL of object ``name`` (add ``alt=media`` for its bytes)."""
    return f"{endpoint}/download/storage/v1/b/{quote(bucket, safe='')}/o/{quote(name, safe='')}"


def open_get(
    session: Any,
    url: str,
    byte_range: tuple[int, int] | None,
    timeout: tuple[float, float],
) -> Any | None:
    """A streamed GET of ``url`` (bytes ``[start, stop)`` when given); None when the range
    starts at or past the object's end (416). Error answers raise GCSAnswerError."""
    headers = {"Accept-Encoding": "identity"}
    if byte_range is not None:
        headers["Range"] = f"bytes={byte_range[0]}-{byte_range[1] - 1}"
    response = session.get(
        url, params={"alt": "media"}, headers=headers, stream=True, timeout=timeout
    )
    if response.status_code == 416:
        response.close()
        return None
    raise_for_answer(response, ok=(200, 206))
    return response


def read_body(response: Any, view: memoryview, where: str) -> None:
    """Fill ``view`` from the body of ``response``; TruncatedResponseError if it ends early."""
    got = 0
    try:
        while got < view.nbytes:
            n = response.raw.readinto(view[got : got + READ_STEP])
            if not n:
                break
            got += n
    finally:
        response.close()
    if got != view.nbytes:
        raise TruncatedResponseError(f"reading {where}: got {got} of {view.nbytes} bytes")


def fetch(
    session: Any,
    url: str,
    byte_range: tuple[int, int] | None,
    allocate: Callable[[int], B],
    where: str,
    timeout: tuple[float, float],
) -> B:
    """The object's bytes (or ``byte_range`` of them) in a buffer from ``allocate(length)``."""
    response = open_get(session, url, byte_range, timeout)
    if response is None:
        return allocate(0)
    length = int(response.headers.get("Content-Length", "-1"))
    if length < 0:
        response.close()
        raise ObjectStoreError(f"reading {where}: the answer has no Content-Length")
    buf = allocate(length)
    read_body(response, memoryview(buf), where)
    return buf


class GCSObjectReader(StreamingReader):
    """One GCS object, open for reads at any offset. Close it when done."""

    _truncated = TruncatedResponseError

    def __init__(
        self,
        session: Any,
        url: str,
        where: str,
        call: Callable[[Callable[[], Any]], Any],
        timeout: tuple[float, float],
    ) -> None:
        """Open the object at ``url`` (``where`` names it in errors) with one GET of its first
        bytes, through ``call`` (retries, error translation: ObjectNotFoundError if missing)."""
        self._session, self._url, self._timeout = session, url, timeout
        super().__init__(where, call)

    def _open_first(self) -> tuple[Any, int, int] | None:
        response = open_get(self._session, self._url, (0, FIRST_BYTES), self._timeout)
        if response is None:
            return None
        length = int(response.headers.get("Content-Length", "0"))
        content_range = response.headers.get("Content-Range")
        # "bytes 0-4095/1048576"; a server that ignores the range sends the whole object.
        size = int(content_range.rsplit("/", 1)[1]) if content_range else length
        return response, length, size

    def _open_at(self, offset: int) -> Any:
        response = open_get(self._session, self._url, (offset, self.size), self._timeout)
        if response is None:
            raise TruncatedResponseError(f"reading {self._where}: no bytes from {offset}")
        return response

    def _readinto(self, body: Any, view: memoryview) -> int:
        return cast(int, body.raw.readinto(view[:READ_STEP]))
