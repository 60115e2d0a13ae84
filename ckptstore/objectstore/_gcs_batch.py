"""Deleting GCS objects in batches: one ``multipart/mixed`` request to the JSON API's batch
endpoint carries up to 100 DELETE calls (a GCS limit), and the answer holds one status per call.

A call answered 404 deleted nothing that existed: fine (``delete`` ignores missing keys). Any
other failure of a call raises :class:`~._gcs_errors.GCSAnswerError` with that call's status, so
the store's RemoteCaller retries the whole batch where the status is transient (deleting again
is harmless) and reports it otherwise.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Sequence
from typing import Any
from urllib.parse import quote

from ckptstore.objectstore._gcs_errors import GCSAnswerError, raise_for_answer

_STATUS_RE = re.compile(rb"^HTTP/\d(?:\.\d)? (\d{3})(?: ([^\r\n]*))?", re.MULTILINE)
_BOUNDARY_RE = re.compile(r'boundary="?([^";]+)"?')
_FINE = frozenset({200, 204, 404})


def batch_body(bucket: str, names: Sequence[str], boundary: str) -> bytes:
    """The ``multipart/mixed`` body of one DELETE call per object name."""
    lines: list[str] = []
    for i, name in enumerate(names):
        path = f"/storage/v1/b/{quote(bucket, safe='')}/o/{quote(name, safe='')}"
        lines += [
            f"--{boundary}",
            "Content-Type: application/http",
            "Content-Transfer-Encoding: binary",
            f"Content-ID: <{i + 1}>",
            "",
            f"DELETE {path} HTTP/1.1",
            "Content-Length: 0",
            "",
        ]
    lines += [f"--{boundary}--", ""]
    return "\r\n".join(lines).encode()


def statuses(answer: Any) -> list[tuple[int, str]]:
    """(status, reason) of each call in a batch answer, in order."""
    match = _BOUNDARY_RE.search(answer.headers.get("Content-Type", ""))
    if not match:
        raise GCSAnswerError(answer.status_code, "", "a batch answer without a boundary", "POST")
    delimiter = b"--" + match.group(1).encode()
    out: list[tuple[int, str]] = []
    for part in answer.content.split(delimiter)[1:]:
        if part.startswith(b"--"):
            break
        found = _STATUS_RE.search(part)
        if found:
            out.append((int(found.group(1)), (found.group(2) or b"").decode("latin-1").strip()))
    return out


def delete_batch(
    session: Any, endpoint: str, bucket: str, names: Sequence[str], timeout: tuple[float, float]
) -> None:
    """Delete ``names`` (at most 100) from ``bucket`` in one batch request."""
    boundary = f"ckptstore-{uuid.uuid4().hex}"
    answer = session.post(
        f"{endpoint}/batch/storage/v1",
        data=batch_body(bucket, names, boundary),
        headers={"Content-Type": f"multipart/mixed; boundary={boundary}"},
        timeout=timeout,
    )
    raise_for_answer(answer)
    got = statuses(answer)
    answer.close()
    if len(got) != len(names):
        raise GCSAnswerError(
            503, "", f"a batch answer with {len(got)} statuses for {len(names)} calls", "POST"
        )
    failed = [
        (status, reason, name)
        for (status, reason), name in zip(got, names, strict=True)
        if status not in _FINE
    ]
    if not failed:
        return
    # A permanent failure is reported as such; only transient ones are worth the retry.
    permanent = [f for f in failed if f[0] not in (408, 429) and f[0] < 500]
    status, reason, name = (permanent or failed)[0]
    raise GCSAnswerError(
        status,
        reason,
        f"deleting {len(failed)} of {len(names)} objects failed, e.g. {name}",
        "DELETE",
    )
