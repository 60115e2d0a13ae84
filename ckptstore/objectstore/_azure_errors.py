"""What AzureStore's failures mean: the Azure SDK's (azure-core's, and the socket's) exceptions
sorted into :class:`~ckptstore.objectstore.remote.Failure` kinds for the
:class:`~ckptstore.objectstore.remote.RemoteCaller` that retries and reports them, plus the
readers of an error answer that :mod:`._azure` and :mod:`._azure_reader` share.
"""

from __future__ import annotations

from azure.core.exceptions import (
    AzureError,
    ClientAuthenticationError,
    HttpResponseError,
    IncompleteReadError,
    ServiceRequestError,
    ServiceResponseError,
)

from ckptstore.errors import ObjectStoreError
from ckptstore.objectstore.remote import Failure, Kind

#: Error codes worth retrying whatever their status (Azure answers most with 500 or 503).
_TRANSIENT_CODES = frozenset({"ServerBusy", "InternalError", "OperationTimedOut"})
#: Codes of refused credentials or permissions (403; 401 for a bearer token).
_DENIED_CODES = frozenset(
    {
        "AuthenticationFailed",
        "AuthorizationFailure",
        "AuthorizationPermissionMismatch",
        "AuthorizationSourceIPMismatch",
        "AuthorizationProtocolMismatch",
        "AuthorizationResourceTypeMismatch",
        "AuthorizationServiceMismatch",
        "InsufficientAccountPermissions",
        "InvalidAuthenticationInfo",
        "NoAuthenticationInformation",
    }
)
#: Codes of a store that is not there: no container, or the account itself is disabled.
_STORE_MISSING_CODES = frozenset(
    {"ContainerNotFound", "ContainerBeingDeleted", "AccountIsDisabled"}
)
#: The answers to a create-if-absent write (``If-None-Match: *``) of a blob that exists: 409 as
#: Azure documents it, 412 as some gateways and older service versions send it.
EXISTS_CODES = frozenset({"BlobAlreadyExists", "ConditionNotMet"})

CREDENTIALS_HINT = (
    "check the credentials the store found (AZURE_STORAGE_CONNECTION_STRING, "
    "AZURE_STORAGE_ACCOUNT_KEY, or DefaultAzureCredential's chain: az login, a managed "
    "identity, AZURE_CLIENT_ID/AZURE_TENANT_ID/AZURE_CLIENT_SECRET) and the role "
    "assignment on the container (Storage Blob Data Contributor to write)"
)


class TruncatedResponseError(ObjectStoreError):
    """A response body ended before its declared length (retried as transient)."""


def error_code(exc: HttpResponseError) -> str:
    """The Azure error code of an error answer (``BlobNotFound``), or ``""``."""
    code = getattr(exc, "error_code", None)
    if code:
        return str(getattr(code, "value", code))  # the SDK's StorageErrorCode is an enum
    headers = getattr(exc.response, "headers", None) or {}
    header = headers.get("x-ms-error-code")
    return str(header or "")


def status_code(exc: HttpResponseError) -> int:
    """The HTTP status of an error answer, or 0 when there was none."""
    return int(exc.status_code or 0)


def is_exists_answer(exc: BaseException) -> bool:
    """Whether ``exc`` (a write's error, or the cause of our error) says the blob exists."""
    cause = exc if isinstance(exc, HttpResponseError) else exc.__cause__
    if not isinstance(cause, HttpResponseError):
        return False
    code = error_code(cause)
    return code in EXISTS_CODES or (not code and status_code(cause) in (409, 412))


def classify(exc: BaseException, *, container: str, endpoint: str) -> Failure | None:
    """What an Azure SDK (or socket) exception means for a store on ``container``."""
    if isinstance(exc, IncompleteReadError):
        # A body cut short: its answer's status was a success; the retry reads it again.
        return Failure(
            Kind.NETWORK,
            transient=True,
            detail=f"{type(exc).__name__}: {_first_line(exc)}",
            hint="check that the endpoint is reachable",
        )
    if isinstance(exc, HttpResponseError) and exc.status_code:
        return _classify_answer(exc, container, endpoint)
    if isinstance(exc, ClientAuthenticationError):
        # No status: no answer from the service; azure-identity found no usable credential.
        return Failure(
            Kind.PERMISSION,
            detail=f"no usable Azure credential ({_first_line(exc)})",
            hint=CREDENTIALS_HINT,
        )
    if isinstance(exc, ServiceRequestError | ServiceResponseError | AzureError | OSError):
        transient = isinstance(
            exc,
            ServiceRequestError
            | ServiceResponseError
            | TruncatedResponseError
            | ConnectionError
            | TimeoutError,
        )
        return Failure(
            Kind.NETWORK,
            transient=transient,
            detail=f"{type(exc).__name__}: {_first_line(exc)}",
            hint="check that the endpoint is reachable",
        )
    return None


def _classify_answer(exc: HttpResponseError, container: str, endpoint: str) -> Failure:
    """What an error answer from the service means."""
    code, status = error_code(exc), status_code(exc)
    transient = code in _TRANSIENT_CODES or status in (408, 429) or status >= 500
    if code in _STORE_MISSING_CODES:
        return Failure(
            Kind.STORE_NOT_FOUND,
            detail=f"container {container!r} does not exist at {endpoint} ({code})",
            hint=f"create it (az storage container create --name {container}) or fix the store URL",
        )
    if status == 404:
        return Failure(Kind.NOT_FOUND, transient=transient)
    if code in _DENIED_CODES or status in (401, 403):
        return Failure(
            Kind.PERMISSION,
            detail=f"access denied ({code or status})",
            hint=CREDENTIALS_HINT,
        )
    return Failure(Kind.FAILED, transient=transient, detail=f"{code or status}: {_first_line(exc)}")


def _first_line(exc: BaseException) -> str:
    """The first line of an exception's text: the SDK's messages go on with request ids, times
    and the whole XML answer."""
    text = str(getattr(exc, "message", None) or exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
