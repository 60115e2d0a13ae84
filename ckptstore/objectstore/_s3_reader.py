"""Reading one S3 object at any offset with ranged GETs (:class:`~.base.RandomAccess`).

The blob reader reads a blob's header, then its payload in order, piece by piece, straight into
the tensors it fills. Done naively that is one GET per piece; here it is two requests, whatever
the number of pieces: a small GET of the object's first bytes (the header, and the object's
size from the answer's ``Content-Range``), kept in memory, and one streamed GET from the first
byte read beyond them to the object's end, which every later read in order continues. A read
that goes back, or skips ahead, starts a new streamed GET at its offset. A stream cut short is
retried like any request: the next GET starts where the cut one stopped.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar, cast

import botocore.exceptions as bexc

from ckptstore.errors import ObjectStoreError
from ckptstore.objectstore._s3_errors import TruncatedResponseError, _code

if TYPE_CHECKING:
    from mypy_boto3_s3.client import S3Client

T = TypeVar("T")
#: Bytes the first GET asks for: more than any blob header (576 bytes at most), and little
#: enough to cost about what a HEAD would when the blob turns out to be compressed (the blob
#: reader then fetches it whole with ``get_view``).
FIRST_BYTES = 4 << 10
#: Bytes asked of a streamed body per read (see ``_s3._READ_STEP``).
_READ_STEP = 1 << 20


class S3ObjectReader:
    """One object of an S3 bucket, open for reads at any offset. Close it when done."""

    def __init__(
        self,
        client: S3Client,
        bucket: str,
        full_key: str,
        where: str,
        call: Callable[[Callable[[], Any]], Any],
    ) -> None:
        """Open ``full_key`` of ``bucket`` (``where`` names it in errors): one GET of its first
        bytes, through ``call`` (the store's retries and error translation), which raises
        ObjectNotFoundError for a missing object."""
        self._client, self._bucket, self._full, self._where = client, bucket, full_key, where
        self._call = call
        #: The streamed GET in progress, and the object offset of its next byte.
        self._body: Any = None
        self._position = 0
        self._head = b""
        self.size = 0
        call(self._first_get)

    def _first_get(self) -> None:
        try:
            response = self._client.get_object(
                Bucket=self._bucket, Key=self._full, Range=f"bytes=0-{FIRST_BYTES - 1}"
            )
        except bexc.ClientError as exc:
            if _code(exc) != "InvalidRange":
                raise
            self.size, self._head = 0, b""  # an empty object: no byte range can be satisfied
            return
        length = response["ContentLength"]
        content_range = response.get("ContentRange")
        # "bytes 0-65535/1048576"; a server that ignores the range sends the whole object.
        self.size = int(content_range.rsplit("/", 1)[1]) if content_range else length
        body = response["Body"]
        head = bytearray(min(length, FIRST_BYTES))
        got = _read_fully(body, memoryview(head))
        if got != len(head):
            body.close()
            raise TruncatedResponseError(
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
                self._open_stream(at)
            try:
                while done < view.nbytes:
                    n = self._body.readinto(cast(Any, view[done : done + _READ_STEP]))
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

    def _open_stream(self, offset: int) -> None:
        self._drop()
        response = self._client.get_object(
            Bucket=self._bucket, Key=self._full, Range=f"bytes={offset}-{self.size - 1}"
        )
        self._body, self._position = response["Body"], offset

    def _drop(self) -> None:
        body, self._body = self._body, None
        if body is not None:
            body.close()

    def close(self) -> None:
        """Close the streamed GET in progress, if any."""
        self._drop()


def _read_fully(body: Any, view: memoryview) -> int:
    """Read ``body`` into ``view`` until it is full or the body ends; the bytes read."""
    got = 0
    while got < view.nbytes:
        n = body.readinto(view[got : got + _READ_STEP])
        if not n:
            break
        got += n
    return got
