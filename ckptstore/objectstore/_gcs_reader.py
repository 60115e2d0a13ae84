"""Reading GCS objects: whole or ranged GETs straight into the caller's buffer, and one object
open for reads at any offset (:class:`~.base.RandomAccess`).

A GET streams the body into a buffer allocated once from the answer's ``Content-Length``, a
step at a time: no intermediate copy of the object. :class:`GCSObjectReader` reads the way
:class:`~._s3_reader.S3ObjectReader` does: one small GET of the first bytes (the blob header,
and the object's size from ``Content-Range``), then one streamed ranged GET that reads in order
continue; a read elsewhere starts a new GET there, and a stream cut short resumes where it stopped.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import quote

from ckptstore.errors import ObjectStoreError
from ckptstore.objectstore._gcs_errors import TruncatedResponseError, raise_for_answer

B = TypeVar("B", bytearray, memoryview)
#: Bytes asked of a response body per read (as for S3: cache-sized steps, no big temporaries).
READ_STEP = 1 << 20
#: Bytes the first GET of an open reader asks for: more than any blob header.
FIRST_BYTES = 4 << 10


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


class GCSObjectReader:
    """One GCS object, open for reads at any offset. Close it when done."""

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
        self._session, self._url, self._where, self._timeout = session, url, where, timeout
        self._call = call
        self._body: Any = None
        self._position = 0
        self._head = b""
        self.size = 0
        call(self._first_get)

    def _first_get(self) -> None:
        response = open_get(self._session, self._url, (0, FIRST_BYTES), self._timeout)
        if response is None:  # an empty object: no range of it can be satisfied
            self.size, self._head = 0, b""
            return
        length = int(response.headers.get("Content-Length", "0"))
        content_range = response.headers.get("Content-Range")
        # "bytes 0-4095/1048576"; a server that ignores the range sends the whole object.
        self.size = int(content_range.rsplit("/", 1)[1]) if content_range else length
        head = bytearray(min(length, FIRST_BYTES))
        got = 0
        while got < len(head):
            n = response.raw.readinto(memoryview(head)[got:])
            if not n:
                break
            got += n
        if got != len(head):
            response.close()
            raise TruncatedResponseError(f"reading {self._where}: got {got} of {len(head)} bytes")
        self._head = bytes(head)
        self._drop()
        if length > len(head):  # the whole object came: keep streaming it
            self._body, self._position = response, len(head)
        else:
            response.close()

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
        done = 0

        def attempt() -> None:
            nonlocal done
            at = offset + done
            if self._body is None or self._position != at:
                self._drop()
                response = open_get(self._session, self._url, (at, self.size), self._timeout)
                if response is None:
                    raise TruncatedResponseError(f"reading {self._where}: no bytes from {at}")
                self._body, self._position = response, at
            try:
                while done < view.nbytes:
                    n = self._body.raw.readinto(view[done : done + READ_STEP])
                    if not n:
                        raise TruncatedResponseError(
                            f"reading {self._where}: the response ended at byte "
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
