"""Reading one S3 object at any offset with ranged GETs (:class:`~.base.RandomAccess`): the
S3 side of :class:`~._streaming.StreamingReader` (how a ranged GET is asked for, how its body is
read), which holds the head cache and the resumed streamed GET."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import botocore.exceptions as bexc

from ckptstore.objectstore._s3_errors import TruncatedResponseError, _code
from ckptstore.objectstore._streaming import FIRST_BYTES, StreamingReader

if TYPE_CHECKING:
    from mypy_boto3_s3.client import S3Client

#: Bytes asked of a streamed body per read (see ``_s3._READ_STEP``).
_READ_STEP = 1 << 20


class S3ObjectReader(StreamingReader):
    """One object of an S3 bucket, open for reads at any offset. Close it when done."""

    _truncated = TruncatedResponseError

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
        self._client, self._bucket, self._full = client, bucket, full_key
        super().__init__(where, call)

    def _open_first(self) -> tuple[Any, int, int] | None:
        try:
            response = self._client.get_object(
                Bucket=self._bucket, Key=self._full, Range=f"bytes=0-{FIRST_BYTES - 1}"
            )
        except bexc.ClientError as exc:
            if _code(exc) != "InvalidRange":
                raise
            return None
        length = response["ContentLength"]
        content_range = response.get("ContentRange")
        # "bytes 0-4095/1048576"; a server that ignores the range sends the whole object.
        size = int(content_range.rsplit("/", 1)[1]) if content_range else length
        return response["Body"], length, size

    def _open_at(self, offset: int) -> Any:
        response = self._client.get_object(
            Bucket=self._bucket, Key=self._full, Range=f"bytes={offset}-{self.size - 1}"
        )
        return response["Body"]

    def _readinto(self, body: Any, view: memoryview) -> int:
        return cast(int, body.readinto(view[:_READ_STEP]))
