"""What GCSStore's failures mean: the HTTP answers of the GCS JSON API, and the exceptions of
google-auth, requests and urllib3 below it, sorted into
:class:`~ckptstore.objectstore.remote.Failure` kinds for the
:class:`~ckptstore.objectstore.remote.RemoteCaller` that retries and reports them.

Requests are sent over the client library's authorized session, so an error answer arrives as a
``requests.Response``; :func:`raise_for_answer` turns it into :class:`GCSAnswerError`, which
keeps the status and GCS's own reason and message for the classifier and the user.
"""

from __future__ import annotations

from typing import Any

from ckptstore.errors import ObjectStoreError
from ckptstore.objectstore._gcs_client import CREDENTIALS_HINT, NO_CREDENTIALS_HINT
from ckptstore.objectstore.remote import Failure, Kind

#: Statuses worth retrying (GCS's retry strategy: 408, 429 and 5xx).
_TRANSIENT_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
#: Bytes of an error answer kept for its message.
_ERROR_BODY_LIMIT = 4096


class GCSAnswerError(Exception):
    """GCS answered a request with an error status. Not a ckptstore error: the store's
    RemoteCaller classifies it and raises the ckptstore error for its kind, chained to it."""

    def __init__(self, status: int, reason: str, message: str, method: str) -> None:
        self.status, self.reason, self.message, self.method = status, reason, message, method
        super().__init__(f"HTTP {status} {reason}: {message}".rstrip(": "))


class TruncatedResponseError(ObjectStoreError):
    """A response body ended before its declared length (retried as transient)."""


def raise_for_answer(response: Any, *, ok: tuple[int, ...] = (200,)) -> None:
    """Raise :class:`GCSAnswerError` unless ``response``'s status is one of ``ok``; the body of
    an error answer is read (GCS's error JSON, a few hundred bytes) and the response closed."""
    if response.status_code in ok:
        return
    try:
        body = bytes(response.content or b"")[:_ERROR_BODY_LIMIT]  # GCS's error JSON is small
    except Exception:  # the answer's status is what matters; a broken body adds nothing
        body = b""
    finally:
        response.close()
    reason, message = _reason_and_message(body)
    raise GCSAnswerError(
        response.status_code,
        reason or str(response.reason or ""),
        message,
        response.request.method if response.request is not None else "",
    )


def _reason_and_message(body: bytes) -> tuple[str, str]:
    """GCS's JSON error ``{"error": {"message", "errors": [{"reason"}]}}``, or the text."""
    import json

    text = body.decode("utf-8", "replace").strip()
    try:
        error = json.loads(text)["error"]
        reason = str((error.get("errors") or [{}])[0].get("reason", ""))
        return reason, str(error.get("message", ""))
    except (ValueError, KeyError, TypeError, AttributeError, IndexError):
        return "", " ".join(text.split())[:300]


def classify(exc: BaseException, *, bucket: str, endpoint: str) -> Failure | None:
    """What an exception of a request to a store on ``bucket`` at ``endpoint`` means."""
    import google.auth.exceptions as gexc
    import requests
    from urllib3.exceptions import HTTPError as Urllib3HTTPError

    if isinstance(exc, GCSAnswerError):
        return _classify_answer(exc, bucket, endpoint)
    if isinstance(exc, TruncatedResponseError):
        return Failure(Kind.NETWORK, transient=True, detail=str(exc))
    if isinstance(exc, gexc.DefaultCredentialsError):
        return Failure(Kind.PERMISSION, detail=str(exc), hint=NO_CREDENTIALS_HINT)
    if isinstance(exc, gexc.RefreshError):
        # A token refresh the server refused (a revoked key, a deleted service account).
        return Failure(
            Kind.PERMISSION,
            transient=bool(getattr(exc, "retryable", False)),
            detail=f"the credentials could not be refreshed ({exc})",
            hint=CREDENTIALS_HINT,
        )
    if isinstance(exc, gexc.TransportError):
        return Failure(Kind.NETWORK, transient=True, detail=f"{type(exc).__name__}: {exc}")
    transient = (
        requests.ConnectionError,
        requests.Timeout,
        requests.exceptions.ChunkedEncodingError,
        requests.exceptions.ContentDecodingError,
        Urllib3HTTPError,
        ConnectionError,
        TimeoutError,
    )
    if isinstance(exc, requests.RequestException | Urllib3HTTPError | OSError):
        return Failure(
            Kind.NETWORK,
            transient=isinstance(exc, transient),
            detail=f"{type(exc).__name__}: {exc}",
            hint="check that the endpoint is reachable",
        )
    return None


def _classify_answer(exc: GCSAnswerError, bucket: str, endpoint: str) -> Failure:
    status = exc.status
    transient = status in _TRANSIENT_STATUSES
    detail = str(exc)
    if status == 404:
        if "bucket" in exc.message.lower():
            return Failure(
                Kind.STORE_NOT_FOUND,
                detail=f"bucket {bucket!r} does not exist at {endpoint}",
                hint=f"create it (gcloud storage buckets create gs://{bucket}) or fix the "
                "store URL (--store / $CKPTSTORE_STORE)",
            )
        return Failure(Kind.NOT_FOUND)
    if status == 429 or exc.reason in ("rateLimitExceeded", "userRateLimitExceeded"):
        return Failure(Kind.FAILED, transient=True, detail=f"throttled: {detail}")
    if status in (401, 403):
        return Failure(
            Kind.PERMISSION,
            detail=f"access denied ({detail}) by {endpoint}",
            hint=CREDENTIALS_HINT,
        )
    return Failure(Kind.FAILED, transient=transient, detail=detail)
