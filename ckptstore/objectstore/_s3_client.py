"""S3Store's configuration: the bucket-name check, the endpoint's redaction, and the boto3
client built from the store's options when the caller hands it none.

The client's own retries are turned off (every request goes through one RemoteCaller policy),
and its credentials come only from boto3's chain: an endpoint URL that embeds some is refused.
boto3's retry settings are honoured all the same (:func:`aws_retry_settings`): a
``max_attempts`` (``AWS_MAX_ATTEMPTS``) sets that policy's attempts, and a ``retry_mode``
(``AWS_RETRY_MODE``) is the client's mode (``adaptive`` keeps its client-side rate limiting).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast
from urllib.parse import urlsplit, urlunsplit

import boto3
import botocore.session
from botocore.config import Config

from ckptstore.errors import ConfigError
from ckptstore.names import printable
from ckptstore.objectstore._retry import RetryPolicy

if TYPE_CHECKING:
    from mypy_boto3_s3.client import S3Client

log = logging.getLogger("ckptstore.objectstore")
_BUCKET_RE = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]", re.ASCII)
_IPV4_RE = re.compile(r"\d+\.\d+\.\d+\.\d+", re.ASCII)


def check_bucket_name(bucket: str) -> str:
    """``bucket`` if it follows S3's naming rules, else a ConfigError that names the rule.

    Checked when a store is opened, so a mistyped ``--store`` fails at once as a configuration
    error rather than at the first request as a store error.
    """
    if not bucket:
        raise ConfigError("S3Store needs a bucket name, e.g. s3://my-bucket/checkpoints")
    if not _BUCKET_RE.fullmatch(bucket):
        rule = (
            "must be 3-63 characters long"
            if not 3 <= len(bucket) <= 63
            else "may hold only lowercase letters, digits, '.' and '-', and must start and end "
            "with a letter or digit"
        )
    elif ".." in bucket:
        rule = "must not contain '..'"
    elif _IPV4_RE.fullmatch(bucket):
        rule = "must not look like an IP address"
    else:
        return bucket
    raise ConfigError(
        f"invalid S3 bucket name '{printable(bucket)}': a bucket name {rule} "
        "(e.g. s3://my-bucket/checkpoints); check --store / $CKPTSTORE_STORE"
    )


_RETRY_MODES = ("legacy", "standard", "adaptive")


@dataclass(frozen=True, slots=True)
class AwsRetrySettings:
    """The retry settings boto3's configuration holds: ``AWS_MAX_ATTEMPTS`` and
    ``AWS_RETRY_MODE``, or ``max_attempts`` and ``retry_mode`` in the profile; None if unset."""

    max_attempts: int | None
    mode: str | None
    #: Where each came from, for the log: ``"AWS_MAX_ATTEMPTS"``, ``"profile 'ci'"``.
    max_attempts_source: str = ""
    mode_source: str = ""


def aws_retry_settings(profile_name: str | None) -> AwsRetrySettings:
    """boto3's retry settings (its own chain: the environment, then the profile), checked; a
    value boto3 would refuse is a ConfigError naming the variable."""
    core = botocore.session.Session(profile=profile_name)
    profile = f"the AWS config file's profile {profile_name or 'default'!r}"
    attempts_from = "AWS_MAX_ATTEMPTS" if "AWS_MAX_ATTEMPTS" in os.environ else profile
    mode_from = "AWS_RETRY_MODE" if "AWS_RETRY_MODE" in os.environ else profile
    try:
        attempts = core.get_config_variable("max_attempts")
    except ValueError as exc:
        raise ConfigError(
            f"max_attempts from {attempts_from} is not a whole number ({exc}); "
            "set it to the total attempts per request, e.g. AWS_MAX_ATTEMPTS=5"
        ) from exc
    if attempts is not None and attempts < 1:
        raise ConfigError(
            f"max_attempts={attempts} from {attempts_from} must be >= 1 (the first attempt "
            "counts), e.g. AWS_MAX_ATTEMPTS=5"
        )
    mode = core.get_config_variable("retry_mode")
    if mode is not None and mode not in _RETRY_MODES:
        raise ConfigError(
            f"retry_mode={mode!r} from {mode_from} is not one of {list(_RETRY_MODES)}; "
            "fix or unset it (e.g. AWS_RETRY_MODE=standard)"
        )
    return AwsRetrySettings(attempts, mode, attempts_from, mode_from)


def retry_policy(given: RetryPolicy | None, settings: AwsRetrySettings, store: str) -> RetryPolicy:
    """The policy for a store's requests: ``given`` (the store's ``retry`` option) if any, else
    ckptstore's default with boto3's ``max_attempts`` when that is set. Says which at DEBUG."""
    if given is not None:
        if settings.max_attempts is not None:
            log.debug(
                "%s: max_attempts=%d from %s is not used: the store's retry option is given (%d "
                "attempts)",
                store,
                settings.max_attempts,
                settings.max_attempts_source,
                given.max_attempts,
            )
        return given
    default = RetryPolicy()
    if settings.max_attempts is None:
        return default
    log.debug(
        "%s: max_attempts=%d from %s replaces ckptstore's default of %d attempts per request "
        "(ckptstore runs the retries, with its backoff; botocore's own stay off)",
        store,
        settings.max_attempts,
        settings.max_attempts_source,
        default.max_attempts,
    )
    return dataclasses.replace(default, max_attempts=settings.max_attempts)


def make_client(
    *,
    endpoint_url: str | None,
    profile_name: str | None,
    region_name: str | None,
    addressing_style: str | None,
    connect_timeout: float,
    read_timeout: float,
    max_pool_connections: int,
    sign_payload: bool,
    retry_mode: str | None = None,
) -> S3Client:
    """A boto3 S3 client for S3Store's options (their meanings are on S3Store). ``retry_mode``
    (boto3's configured one, if any) sets the client's mode; its attempts stay at one."""
    endpoint = (
        endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    )
    if endpoint and "@" in urlsplit(endpoint).netloc:
        raise ConfigError(
            f"the S3 endpoint URL {_redact(endpoint)} embeds credentials "
            "(user:password@): boto3 never uses them and they would end up in logs. "
            "Remove them and give credentials through boto3's chain "
            "(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, AWS_PROFILE, ...)"
        )
    style = addressing_style or ("path" if endpoint else "auto")
    config = Config(
        retries={"total_max_attempts": 1, "mode": cast(Any, retry_mode or "standard")},
        connect_timeout=connect_timeout,
        read_timeout=read_timeout,
        max_pool_connections=max_pool_connections,
        s3=cast(Any, {"addressing_style": style, "payload_signing_enabled": sign_payload}),
        # Every blob carries a BLAKE3 digest that is verified on read; botocore's CRCs
        # would hash every byte a second time for nothing.
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    if retry_mode is not None:
        log.debug(
            "S3 client for %s: retry_mode=%s from boto3's configuration is used (adaptive: "
            "botocore's client-side rate limiting); ckptstore still counts the attempts",
            endpoint or "AWS",
            retry_mode,
        )
    session = boto3.session.Session(profile_name=profile_name, region_name=region_name)
    return session.client("s3", endpoint_url=endpoint_url, config=config)


def _redact(url: str) -> str:
    """The endpoint URL without any user:password part."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]))
