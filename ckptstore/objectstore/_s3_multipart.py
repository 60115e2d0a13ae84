"""S3Store's multipart half: an object of at least ``multipart_threshold`` bytes goes up in
parts, several at once, and is completed with ``If-None-Match: *`` where the server supports it;
a failed upload is aborted, and :meth:`~MultipartUploads.sweep_incomplete` aborts the uploads
that a dead writer left open.

:class:`MultipartUploads` is a base of :class:`~ckptstore.objectstore._s3.S3Store`, which
sets the attributes declared here and runs every request through ``_call``.
"""

from __future__ import annotations

import abc
import contextlib
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar, cast

import botocore.exceptions as bexc

from ckptstore.errors import ObjectStoreError
from ckptstore.objectstore._s3_body import _PartsReader, _slice_parts
from ckptstore.objectstore._s3_errors import _status
from ckptstore.objectstore.base import ObjectStore

if TYPE_CHECKING:
    from mypy_boto3_s3.client import S3Client

T = TypeVar("T")


class MultipartUploads(ObjectStore):
    """Multipart uploads and their sweep, for an S3 store that sets the attributes below."""

    bucket: str
    prefix: str
    part_size: int
    client: S3Client
    #: The ``conditional_writes`` option; a None (probe) turns False once a server refuses it.
    _conditional: bool | None
    #: Threads that upload the parts of one object at once.
    _parts_pool: ThreadPoolExecutor

    @abc.abstractmethod
    def _call(self, action: str, key: str, fn: Callable[[], T]) -> T:
        """Run one request with retries; a final failure becomes one of our errors."""

    def _put_multipart(self, key: str, full: str, parts: list[memoryview], size: int) -> bool:
        # A HEAD first: for large objects it is far cheaper than uploading and being refused.
        if self.exists(key):
            return False
        upload_id = self._call(
            "starting multipart upload of",
            key,
            lambda: self.client.create_multipart_upload(Bucket=self.bucket, Key=full)["UploadId"],
        )
        try:
            ranges = [(o, min(o + self.part_size, size)) for o in range(0, size, self.part_size)]
            futures = [
                self._parts_pool.submit(self._upload_part, key, full, upload_id, n, parts, r)
                for n, r in enumerate(ranges, start=1)
            ]
            etags = [f.result() for f in futures]
            complete: dict[str, Any] = {
                "Bucket": self.bucket,
                "Key": full,
                "UploadId": upload_id,
                "MultipartUpload": {
                    "Parts": [{"ETag": e, "PartNumber": n} for n, e in enumerate(etags, 1)]
                },
            }
            if self._conditional is not False:
                complete["IfNoneMatch"] = "*"
            try:
                self._call(
                    "completing multipart upload of",
                    key,
                    lambda: self.client.complete_multipart_upload(**complete),
                )
            except ObjectStoreError as exc:
                cause = exc.__cause__
                if isinstance(cause, bexc.ClientError) and _status(cause) == 412:
                    self._abort(full, upload_id)
                    return False
                raise
        except BaseException:
            self._abort(full, upload_id)
            raise
        return True

    def _upload_part(
        self,
        key: str,
        full: str,
        upload_id: str,
        number: int,
        parts: Sequence[memoryview],
        byte_range: tuple[int, int],
    ) -> str:
        pieces = _slice_parts(parts, *byte_range)
        length = byte_range[1] - byte_range[0]

        def send() -> str:
            response = self.client.upload_part(
                Bucket=self.bucket,
                Key=full,
                UploadId=upload_id,
                PartNumber=number,
                Body=cast(Any, _PartsReader(pieces)),
                ContentLength=length,
            )
            return response["ETag"]

        return self._call(f"uploading part {number} of", key, send)

    def _abort(self, full: str, upload_id: str) -> None:
        # Best effort: an upload left open is invisible and expires by bucket lifecycle.
        with contextlib.suppress(bexc.BotoCoreError, bexc.ClientError):
            self.client.abort_multipart_upload(Bucket=self.bucket, Key=full, UploadId=upload_id)

    def sweep_incomplete(self, older_than: float, *, dry_run: bool = False) -> tuple[int, int]:
        """Abort multipart uploads under this store's prefix started more than ``older_than``
        seconds ago (their writer died; the parts cost storage until aborted)."""
        cutoff = time.time() - older_than
        prefix = f"{self.prefix}/" if self.prefix else ""
        stale: list[tuple[str, str]] = []
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": prefix}
        while True:
            page = self._call(
                "listing multipart uploads under",
                prefix,
                lambda kw=dict(kwargs): self.client.list_multipart_uploads(**kw),  # type: ignore[misc]
            )
            for upload in page.get("Uploads", []):
                if upload["Initiated"].timestamp() < cutoff:
                    stale.append((upload["Key"], upload["UploadId"]))
            if not page.get("IsTruncated"):
                break
            kwargs["KeyMarker"] = page.get("NextKeyMarker", "")
            kwargs["UploadIdMarker"] = page.get("NextUploadIdMarker", "")
        size = 0
        for full, upload_id in stale:
            parts = self._call(
                "listing the parts of",
                full,
                lambda f=full, u=upload_id: self.client.list_parts(  # type: ignore[misc]
                    Bucket=self.bucket, Key=f, UploadId=u
                ),
            )
            size += sum(int(p.get("Size", 0)) for p in parts.get("Parts", []))
            if not dry_run:
                self._call(
                    "aborting the multipart upload of",
                    full,
                    lambda f=full, u=upload_id: self.client.abort_multipart_upload(  # type: ignore[misc]
                        Bucket=self.bucket, Key=f, UploadId=u
                    ),
                )
        return len(stale), size
