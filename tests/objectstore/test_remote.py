"""The remote-call helper: RetryPolicy's backoff, the retry loop, and how RemoteCaller turns a
classifier's verdict into one of ckptstore's errors. Backend-free: a fake classifier stands in
for a client library (test_s3_faults.py runs the same helper under S3Store)."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from ckptstore.errors import (
    ConfigError,
    ObjectNotFoundError,
    ObjectStoreError,
    StoreNotFoundError,
    StorePermissionError,
)
from ckptstore.objectstore._retry import call_with_retries
from ckptstore.objectstore.remote import Failure, Kind, RemoteCaller, RetryPolicy, strip_userinfo

FAST = RetryPolicy(max_attempts=5, base_delay=0.001, max_delay=0.01)
WHERE = "box://shelf/prefix/cas/ab/cd"
SECRET = "ckpt-test-SECRET-never-print-me"


@pytest.mark.parametrize(
    "options",
    [
        {"max_attempts": 0},
        {"base_delay": -1.0},
        {"base_delay": 2.0, "max_delay": 1.0},
    ],
)
def test_retry_policy_validates(options: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match="RetryPolicy"):
        RetryPolicy(**options)


def test_backoff_is_exponential_capped_and_jittered() -> None:
    policy = RetryPolicy(max_attempts=10, base_delay=0.1, max_delay=1.0)
    for attempt, cap in [(1, 0.1), (2, 0.2), (3, 0.4), (4, 0.8), (5, 1.0), (9, 1.0)]:
        delays = [policy.delay(attempt) for _ in range(200)]
        assert all(0.0 <= d <= cap for d in delays), attempt
        assert max(delays) > cap / 2, "full jitter should reach the upper half"
        assert len(set(delays)) > 100, "delays should be jittered"


def test_call_with_retries_stops_at_a_permanent_fault() -> None:
    calls: list[int] = []

    def fn() -> int:
        calls.append(1)
        if len(calls) < 3:
            raise TimeoutError("transient")
        raise KeyError("permanent")

    with pytest.raises(KeyError):
        call_with_retries(
            fn,
            policy=FAST,
            is_transient=lambda e: isinstance(e, TimeoutError),
            describe=lambda: "op",
        )
    assert len(calls) == 3


def test_call_with_retries_returns_the_first_success() -> None:
    results = iter([TimeoutError(), TimeoutError(), 42, 43])

    def fn() -> int:
        item = next(results)
        if isinstance(item, Exception):
            raise item
        return item

    policy = RetryPolicy(max_attempts=3, base_delay=0.0, max_delay=0.0)
    assert call_with_retries(fn, policy=policy, is_transient=lambda e: True, describe=str) == 42


def test_retries_are_logged_at_debug_and_a_recovery_once_at_info(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An unreachable endpoint must not print a warning per retry before its one error."""
    results = iter([TimeoutError("slow"), TimeoutError("slow"), 42])

    def fn() -> int:
        item = next(results)
        if isinstance(item, Exception):
            raise item
        return item

    with caplog.at_level(logging.DEBUG, "ckptstore.objectstore"):
        assert call_with_retries(fn, policy=FAST, is_transient=lambda e: True, describe=str) == 42
    levels = [r.levelno for r in caplog.records if r.name == "ckptstore.objectstore"]
    assert levels == [logging.DEBUG, logging.DEBUG, logging.INFO]
    assert "attempt 3" in caplog.records[-1].getMessage()


# -- RemoteCaller -----------------------------------------------------------------------------


class Busy(Exception):
    """A fake client library's "try again later"."""


class Refused(Exception):
    """A fake client library's permanent error; ``kind`` says which."""

    def __init__(self, kind: Kind) -> None:
        super().__init__(f"refused by http://user:{SECRET}@box.example/ ({kind.value})")
        self.kind = kind


def classify(exc: BaseException) -> Failure | None:
    if isinstance(exc, Busy):
        return Failure(Kind.FAILED, transient=True, detail=f"Busy: {exc}")
    if isinstance(exc, Refused):
        return Failure(exc.kind, detail=str(exc), hint="fix the box")
    if isinstance(exc, TimeoutError):
        return Failure(Kind.NETWORK, transient=True, detail="timed out", hint="is it up?")
    return None


def calls_raising(*faults: BaseException, result: Any = "done") -> tuple[list[int], Any]:
    attempts: list[int] = []

    def fn() -> Any:
        attempts.append(1)
        if len(attempts) <= len(faults):
            raise faults[len(attempts) - 1]
        return result

    return attempts, fn


REMOTE = RemoteCaller(classify=classify, policy=FAST, endpoint="https://box.example")


def test_transient_faults_are_retried_until_success(caplog: pytest.LogCaptureFixture) -> None:
    attempts, fn = calls_raising(Busy("slow down"), TimeoutError(), result=42)
    with caplog.at_level(logging.DEBUG, "ckptstore.objectstore"):
        assert REMOTE.call("reading", WHERE, fn) == 42
    assert len(attempts) == 3
    logged = [r for r in caplog.records if r.name == "ckptstore.objectstore"]
    assert [r.levelno for r in logged] == [logging.DEBUG, logging.DEBUG, logging.INFO]
    assert all(f"reading {WHERE}" in r.getMessage() for r in logged)


@pytest.mark.parametrize(
    ("kind", "error", "message"),
    [
        (Kind.NOT_FOUND, ObjectNotFoundError, f"object {WHERE} does not exist; fix the box"),
        (Kind.STORE_NOT_FOUND, StoreNotFoundError, f"reading {WHERE}: refused by http://"),
        (Kind.PERMISSION, StorePermissionError, f"reading {WHERE}: refused by http://"),
        (Kind.FAILED, ObjectStoreError, f"reading {WHERE} failed: refused by http://"),
        (
            Kind.NETWORK,
            ObjectStoreError,
            f"reading {WHERE} (endpoint https://box.example) failed: refused by http://",
        ),
    ],
)
def test_each_kind_becomes_its_error_naming_action_url_and_hint(
    kind: Kind, error: type[ObjectStoreError], message: str
) -> None:
    fault = Refused(kind)
    attempts, fn = calls_raising(fault)
    with pytest.raises(error) as info:
        REMOTE.call("reading", WHERE, fn)
    assert type(info.value) is error
    assert str(info.value).startswith(message)
    assert str(info.value).endswith("; fix the box")
    assert SECRET not in str(info.value)
    assert info.value.__cause__ is fault
    assert len(attempts) == 1, "a permanent fault is not retried"


def test_kinds_map_to_the_matching_builtin_errors() -> None:
    for kind, builtin in [
        (Kind.NOT_FOUND, FileNotFoundError),
        (Kind.PERMISSION, PermissionError),
        (Kind.STORE_NOT_FOUND, OSError),
    ]:
        assert isinstance(REMOTE.error(Failure(kind), "reading", WHERE), builtin)
    # A missing store is never mistaken for a missing object (a checkpoint would look corrupt).
    assert not isinstance(
        REMOTE.error(Failure(Kind.STORE_NOT_FOUND), "x", WHERE), FileNotFoundError
    )


def test_a_transient_fault_that_outlasts_the_retries_is_reported_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    attempts, fn = calls_raising(*[TimeoutError()] * FAST.max_attempts)
    with (
        caplog.at_level(logging.DEBUG, "ckptstore.objectstore"),
        pytest.raises(ObjectStoreError, match="timed out; is it up") as info,
    ):
        REMOTE.call("writing", WHERE, fn)
    assert len(attempts) == FAST.max_attempts
    assert "(endpoint https://box.example)" in str(info.value)
    levels = {r.levelno for r in caplog.records if r.name == "ckptstore.objectstore"}
    assert levels == {logging.DEBUG}


def test_an_exception_the_classifier_does_not_know_passes_through_unretried() -> None:
    fault = KeyError("a bug")
    attempts, fn = calls_raising(fault)
    with pytest.raises(KeyError) as info:
        REMOTE.call("reading", WHERE, fn)
    assert info.value is fault
    assert len(attempts) == 1


def test_an_error_of_ours_is_retried_if_transient_and_then_raised_as_it_is() -> None:
    ours = ObjectStoreError(f"reading {WHERE}: body cut short")
    remote = RemoteCaller(classify=lambda e: Failure(Kind.FAILED, transient=e is ours), policy=FAST)
    attempts, fn = calls_raising(*[ours] * FAST.max_attempts)
    with pytest.raises(ObjectStoreError) as info:
        remote.call("reading", WHERE, fn)
    assert info.value is ours
    assert len(attempts) == FAST.max_attempts
    config = ConfigError("bad option")
    attempts, fn = calls_raising(config)
    with pytest.raises(ConfigError) as config_info:
        remote.call("reading", WHERE, fn)
    assert config_info.value is config
    assert len(attempts) == 1


def test_credentials_in_urls_are_neither_logged_nor_shown(
    caplog: pytest.LogCaptureFixture,
) -> None:
    remote = RemoteCaller(
        classify=lambda e: Failure(Kind.FAILED, transient=True, detail=str(e)), policy=FAST
    )
    fault = OSError(f"cannot reach https://key:{SECRET}@box.example/x")
    _, fn = calls_raising(*[fault] * FAST.max_attempts)
    with caplog.at_level(logging.DEBUG, "ckptstore"), pytest.raises(ObjectStoreError) as info:
        remote.call("reading", WHERE, fn)
    assert "https://box.example/x" in str(info.value)
    assert SECRET not in str(info.value)
    assert caplog.records
    assert SECRET not in caplog.text


def test_strip_userinfo() -> None:
    assert strip_userinfo("a http://u:p@h:9/x and s3://k@b/y") == "a http://h:9/x and s3://b/y"
    assert strip_userinfo("no url: user@example.com") == "no url: user@example.com"
