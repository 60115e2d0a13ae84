"""Running a remote backend's requests: retry transient faults, then translate the final one.

A backend over a network service (S3 today; GCS, Azure or an HTTP store tomorrow) supplies one
:data:`Classifier`, a function that says what an exception of its client library means, and sends
every request through :meth:`RemoteCaller.call`::

    def classify(exc: BaseException) -> Failure | None:
        if isinstance(exc, MyClientError):
            if exc.status == 404:
                return Failure(Kind.NOT_FOUND)
            return Failure(Kind.FAILED, transient=exc.status >= 500, detail=exc.reason)
        return None  # not a store fault (a bug, say): the caller sees it unchanged

    remote = RemoteCaller(classify=classify, policy=RetryPolicy(), endpoint=endpoint)
    data = remote.call("reading", f"{store.url}/{key}", lambda: client.get(key))

The caller gets either the result or one of ckptstore's errors (:class:`ObjectNotFoundError`,
:class:`StoreNotFoundError`, :class:`StorePermissionError`, :class:`ObjectStoreError`) whose
message names the action, the store URL and key, and what to do. Retries are logged at DEBUG
only; a fault that outlasts them is reported once, by that error.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeAlias, TypeVar

from ckptstore.errors import (
    CkptStoreError,
    ObjectNotFoundError,
    ObjectStoreError,
    StoreNotFoundError,
    StorePermissionError,
)
from ckptstore.objectstore._retry import RetryPolicy, call_with_retries

__all__ = ["Classifier", "Failure", "Kind", "RemoteCaller", "RetryPolicy", "strip_userinfo"]

T = TypeVar("T")
_USERINFO_RE = re.compile(r"(?<=://)[^/@\s\"']+@")


class Kind(enum.Enum):
    """What a failed request means for the caller; each kind becomes one ckptstore error."""

    #: The object does not exist: :class:`ObjectNotFoundError`.
    NOT_FOUND = "not found"
    #: The store itself (a bucket, a container) does not exist: :class:`StoreNotFoundError`.
    STORE_NOT_FOUND = "store not found"
    #: Credentials missing or refused: :class:`StorePermissionError`.
    PERMISSION = "permission"
    #: No usable answer (connection refused or reset, a timeout): an :class:`ObjectStoreError`
    #: naming the endpoint.
    NETWORK = "network"
    #: The service answered with any other error: :class:`ObjectStoreError`.
    FAILED = "failed"


_ERRORS: dict[Kind, type[ObjectStoreError]] = {
    Kind.NOT_FOUND: ObjectNotFoundError,
    Kind.STORE_NOT_FOUND: StoreNotFoundError,
    Kind.PERMISSION: StorePermissionError,
    Kind.NETWORK: ObjectStoreError,
    Kind.FAILED: ObjectStoreError,
}


@dataclass(frozen=True, slots=True)
class Failure:
    """A classifier's verdict on one exception."""

    kind: Kind
    #: Worth retrying (throttling, 5xx, a dropped connection); decided apart from ``kind``,
    #: which only shapes the error raised once the retries run out.
    transient: bool = field(default=False, kw_only=True)
    #: What went wrong, for the message: ``"SlowDown: Please reduce your request rate."``.
    #: Credentials embedded in URLs are removed from it before it is shown.
    detail: str = field(default="", kw_only=True)
    #: What the user should do: ``"create it or fix the store URL"``.
    hint: str = field(default="", kw_only=True)


#: A backend's knowledge of its client library: what an exception means, or None when it is no
#: store fault at all (it then reaches the caller unchanged and is never retried). Errors of
#: ckptstore's own that a request raises (a response body cut short, say) are asked only whether
#: they are transient; they reach the caller as they are.
Classifier: TypeAlias = Callable[[BaseException], Failure | None]


def strip_userinfo(text: str) -> str:
    """``text`` with the ``user:password@`` part of every URL in it removed."""
    return _USERINFO_RE.sub("", text)


@dataclass(frozen=True, kw_only=True, slots=True)
class RemoteCaller:
    """Runs one backend's requests under its retry policy and classifier."""

    #: What each exception means; see :data:`Classifier`.
    classify: Classifier
    #: How often and how patiently transient faults are retried.
    policy: RetryPolicy = field(default_factory=RetryPolicy)
    #: The service's address, safe to print; network errors name it.
    endpoint: str | None = None
    #: Cleans text from the client library before it is logged or shown.
    redact: Callable[[str], str] = strip_userinfo

    def call(self, action: str, where: str, fn: Callable[[], T]) -> T:
        """``fn()`` with retries; a final failure raised as ckptstore's error for its kind.

        ``action`` and ``where`` start every message and log line: ``"reading"`` and
        ``"s3://bucket/prefix/cas/ab/cd"`` give "reading s3://bucket/prefix/cas/ab/cd failed: ...".
        """
        try:
            return call_with_retries(
                fn,
                policy=self.policy,
                is_transient=self._is_transient,
                describe=lambda: f"{action} {where}",
                redact=self.redact,
            )
        except CkptStoreError:
            raise
        except Exception as exc:
            failure = self.classify(exc)
            if failure is None:
                raise
            raise self.error(failure, action, where) from exc

    def error(self, failure: Failure, action: str, where: str) -> ObjectStoreError:
        """The ckptstore error that reports ``failure`` of ``action`` on ``where``."""
        detail = self.redact(failure.detail)
        if failure.kind is Kind.NOT_FOUND:
            message = f"object {where} does not exist"
        elif failure.kind is Kind.NETWORK:
            at = f" (endpoint {self.endpoint})" if self.endpoint else ""
            message = f"{action} {where}{at} failed: {detail}"
        elif failure.kind is Kind.FAILED:
            message = f"{action} {where} failed: {detail}"
        else:
            message = f"{action} {where}: {detail}"
        if failure.hint:
            message = f"{message}; {self.redact(failure.hint)}"
        return _ERRORS[failure.kind](message)

    def _is_transient(self, exc: BaseException) -> bool:
        failure = self.classify(exc)
        return failure is not None and failure.transient
