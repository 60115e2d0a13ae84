"""What S3Store's failures mean: botocore's (and urllib3's, and the socket's) exceptions sorted
into :class:`~ckptstore.objectstore.remote.Failure` kinds for the
:class:`~ckptstore.objectstore.remote.RemoteCaller` that retries and reports them, plus the
small readers of an error answer that :mod:`._s3` and :mod:`._s3_multipart` share.
"""

from __future__ import annotations

import botocore.exceptions as bexc
from urllib3.exceptions import HTTPError as Urllib3HTTPError

from ckptstore.errors import ObjectStoreError
from ckptstore.objectstore.remote import Failure, Kind

_TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "TooManyRequests",
        "RequestLimitExceeded",
        "RequestTimeout",
        "InternalError",
        "ServiceUnavailable",
        "ConditionalRequestConflict",
        "OperationAborted",
    }
)
_NOT_FOUND_CODES = frozenset({"NoSuchKey", "404", "NotFound"})
_DENIED_CODES = frozenset(
    {"AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken"}
)


class TruncatedResponseError(ObjectStoreError):
    """A response body ended before its declared length (retried as transient)."""


def _code(exc: bexc.ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def _status(exc: bexc.ClientError) -> int:
    return int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))


_CREDENTIALS_HINT = (
    "check the credentials boto3 finds (AWS_PROFILE, AWS_ACCESS_KEY_ID, ...) "
    "and the bucket's policy (one that demands signed request bodies needs the store option "
    "sign_payload=True)"
)
_NO_CREDENTIALS_HINT = (
    "configure them the usual boto3 way (AWS_PROFILE, AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, ...)"
)
#: Faults below the S3 protocol that a retry may heal. HTTPClientError covers
#: ConnectionClosedError (a reset before the answer), read timeouts and a body cut short
#: (ResponseStreamingError).
_TRANSIENT_ERRORS = (
    bexc.ConnectionError,
    bexc.IncompleteReadError,
    bexc.HTTPClientError,
    TruncatedResponseError,
    Urllib3HTTPError,
    ConnectionError,
    TimeoutError,
)


def classify(exc: BaseException, *, bucket: str, endpoint: str) -> Failure | None:
    """What a botocore (or urllib3, or socket) exception means for a store on ``bucket``."""
    if isinstance(exc, bexc.ClientError):
        return _classify_answer(exc, bucket, endpoint)
    if isinstance(exc, bexc.NoCredentialsError):
        return Failure(
            Kind.PERMISSION, detail="no AWS credentials found", hint=_NO_CREDENTIALS_HINT
        )
    if isinstance(exc, bexc.BotoCoreError | Urllib3HTTPError | OSError):
        return Failure(
            Kind.NETWORK,
            transient=isinstance(exc, _TRANSIENT_ERRORS),
            detail=f"{type(exc).__name__}: {exc}",
            hint="check that the endpoint is reachable",
        )
    return None


def _classify_answer(exc: bexc.ClientError, bucket: str, endpoint: str) -> Failure:
    """What an error answer from the server means."""
    code, status = _code(exc), _status(exc)
    # 501 Not Implemented is a capability answer, never worth retrying.
    transient = code in _TRANSIENT_CODES or status == 429 or (status >= 500 and status != 501)
    if code == "NoSuchBucket":
        return Failure(
            Kind.STORE_NOT_FOUND,
            transient=transient,
            detail=f"bucket {bucket!r} does not exist at {endpoint}",
            hint="create it or fix the store URL",
        )
    if code in _NOT_FOUND_CODES:
        return Failure(Kind.NOT_FOUND, transient=transient)
    if code in _DENIED_CODES:
        return Failure(
            Kind.PERMISSION,
            transient=transient,
            detail=f"access denied ({code})",
            hint=_CREDENTIALS_HINT,
        )
    message = exc.response.get("Error", {}).get("Message", "")
    return Failure(Kind.FAILED, transient=transient, detail=f"{code}: {message}")


def _rejects_conditional(exc: bexc.ClientError) -> bool:
    """Whether a failed conditional PUT means the server does not support If-None-Match."""
    code = _code(exc)
    return _status(exc) == 501 or code in {"NotImplemented", "InvalidArgument"}
