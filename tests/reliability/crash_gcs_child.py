"""The saving process of the GCS crash tests (test_crash_points_gcs.py): crash_child.py
unchanged, with job stores of kind ``gcs`` opened on the job's emulator bucket and the kill
points of a GCS upload.

- ``put.partial.*``: half of an upload request's body is on the wire when the process dies (a
  one-request media upload, or a chunk of a resumable one): the hook is on the body that hands
  the caller's buffers to the socket, which yields the first half and then kills.
- ``put.partN``: killed while chunk N of a resumable upload is being sent (jobs marked
  ``multipart`` upload objects of 5 MiB and more resumably, 5 MiB a chunk).

google-cloud-storage and its HTTP stack are imported here, before the zygote forks, so a job
pays no import; importing them starts no thread.

Run as crash_child.py is: ``python crash_gcs_child.py serve`` or ``run JOB_JSON``.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import crash_child as base
import google.auth.credentials
import requests
from google.api_core.client_options import ClientOptions

from ckptstore.objectstore import ObjectStore
from ckptstore.objectstore import _gcs_upload as upload_module
from ckptstore.objectstore._gcs import GCSStore
from ckptstore.objectstore._gcs_client import import_storage
from ckptstore.objectstore._s3_body import _slice_parts

# Warm imports for the zygote (see the module docstring).
_PRELOADED = (import_storage(), google.auth.credentials, requests, ClientOptions)

_open_job_store = base.open_job_store


def open_job_store(spec: dict[str, Any]) -> ObjectStore:
    if spec["kind"] != "gcs":
        return _open_job_store(spec)
    options: dict[str, Any] = {}
    if spec.get("multipart"):
        options.update(resumable_threshold=base.MULTIPART_BYTES, chunk_size=base.MULTIPART_BYTES)
    return GCSStore(
        spec["bucket"],
        spec["prefix"],
        endpoint_url=spec["endpoint_url"],
        anonymous=True,
        retry=base.FAST_RETRY,
        **options,
    )


def install_gcs(switch: base.Switch) -> None:
    """``put.partial`` on every upload request's body; ``put.partN`` at resumable chunk N."""
    body_iter = upload_module.BufferBody.__iter__

    def _iter(self: upload_module.BufferBody) -> Iterator[memoryview]:
        kind = switch.kind
        names = ("put.partial", f"put.partial.{kind}")
        size = len(self)
        if not (switch.matches(*names) and size):
            yield from body_iter(self)
            return
        half = max(1, size // 2)
        parts = list(body_iter(self))
        # The first half goes to the socket (each item is sent before the next is asked for).
        yield from _slice_parts(parts, 0, half)
        switch.hit(*names)  # the nth hit kills here, the body half sent
        yield from _slice_parts(parts, half, size)

    send_chunk = upload_module.ResumableUpload._send_chunk

    def _send_chunk(self: upload_module.ResumableUpload) -> None:
        number = self.offset // self._chunk + 1
        switch.hit(f"put.part{number}")
        send_chunk(self)

    upload_module.BufferBody.__iter__ = _iter  # type: ignore[method-assign]
    upload_module.ResumableUpload._send_chunk = _send_chunk  # type: ignore[method-assign]


base.open_job_store = open_job_store
#: crash_child installs "the S3 hooks" for every store that is not local: here, the GCS ones.
base._install_s3 = install_gcs

if __name__ == "__main__":
    sys.exit(base.main(sys.argv[1:]))
