"""boto3's own retry settings (``AWS_MAX_ATTEMPTS``, ``AWS_RETRY_MODE``) are honoured, not
silently replaced: the attempts bound ckptstore's retry loop (botocore's stay at one, so they
never multiply), the mode is the client's, and a DEBUG line says which setting won."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from ckptstore.errors import ConfigError, ObjectStoreError
from ckptstore.objectstore import RetryPolicy, S3Store

UNREACHABLE = "http://127.0.0.1:9"
DEFAULT_ATTEMPTS = RetryPolicy().max_attempts


def open_unreachable(**options: Any) -> S3Store:
    return S3Store("some-bucket", endpoint_url=UNREACHABLE, connect_timeout=1.0, **options)


def test_without_settings_ckptstore_defaults_apply(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AWS_MAX_ATTEMPTS", raising=False)
    monkeypatch.delenv("AWS_RETRY_MODE", raising=False)
    with open_unreachable() as store:
        assert isinstance(store, S3Store)
        assert store.retry == RetryPolicy()
        assert store.client.meta.config.retries == {"total_max_attempts": 1, "mode": "standard"}


def test_aws_max_attempts_bounds_the_attempts_and_is_logged(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "3")
    caplog.set_level(logging.DEBUG, logger="ckptstore.objectstore")
    with open_unreachable() as store:
        assert isinstance(store, S3Store)
        assert store.retry.max_attempts == 3
        # botocore still tries once per ckptstore attempt: 3 requests in all, not 3 x 3.
        assert store.client.meta.config.retries["total_max_attempts"] == 1
        sent: list[str] = []
        store.client.meta.events.register(
            "before-send.s3.HeadObject", lambda **kw: sent.append("x")
        )
        with pytest.raises(ObjectStoreError, match=UNREACHABLE):
            store.head("k")
    assert len(sent) == 3
    notes = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert any(
        f"max_attempts=3 from AWS_MAX_ATTEMPTS replaces ckptstore's default of "
        f"{DEFAULT_ATTEMPTS} attempts" in note
        for note in notes
    ), notes


def test_aws_retry_mode_is_the_clients_and_is_logged(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("AWS_RETRY_MODE", "adaptive")
    monkeypatch.delenv("AWS_MAX_ATTEMPTS", raising=False)
    caplog.set_level(logging.DEBUG, logger="ckptstore.objectstore")
    with open_unreachable() as store:
        assert isinstance(store, S3Store)
        assert store.client.meta.config.retries == {"total_max_attempts": 1, "mode": "adaptive"}
        assert store.retry == RetryPolicy()
    assert any("retry_mode=adaptive" in r.getMessage() for r in caplog.records)


def test_the_store_option_wins_over_the_environment(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "3")
    caplog.set_level(logging.DEBUG, logger="ckptstore.objectstore")
    given = RetryPolicy(max_attempts=5, base_delay=0.01, max_delay=0.01)
    with open_unreachable(retry=given) as store:
        assert isinstance(store, S3Store)
        assert store.retry is given
    assert any(
        "max_attempts=3 from AWS_MAX_ATTEMPTS is not used" in r.getMessage() for r in caplog.records
    )


@pytest.mark.parametrize(
    ("name", "value", "match"),
    [
        ("AWS_MAX_ATTEMPTS", "many", "from AWS_MAX_ATTEMPTS is not a whole number"),
        ("AWS_MAX_ATTEMPTS", "0", "max_attempts=0 from AWS_MAX_ATTEMPTS must be >= 1"),
        ("AWS_RETRY_MODE", "eager", "retry_mode='eager' from AWS_RETRY_MODE is not one of"),
    ],
)
def test_bad_settings_are_refused_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str, match: str
) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=match):
        open_unreachable()
