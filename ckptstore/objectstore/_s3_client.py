"""S3Store's configuration: the bucket-name check, the endpoint's redaction, and the boto3
client built from the store's options when the caller hands it none.

The client's own retries are turned off (every request goes through one RemoteCaller policy),
and its credentials come only from boto3's chain: an endpoint URL that embeds some is refused.
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING, Any, cast
from urllib.parse import urlsplit, urlunsplit

import boto3
from botocore.config import Config

from ckptstore.errors import ConfigError
from ckptstore.names import printable

if TYPE_CHECKING:
    from mypy_boto3_s3.client import S3Client

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
) -> S3Client:
    """A boto3 S3 client for S3Store's options (their meanings are on S3Store)."""
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
        retries={"total_max_attempts": 1, "mode": "standard"},
        connect_timeout=connect_timeout,
        read_timeout=read_timeout,
        max_pool_connections=max_pool_connections,
        s3=cast(Any, {"addressing_style": style, "payload_signing_enabled": sign_payload}),
        # Every blob carries a BLAKE3 digest that is verified on read; botocore's CRCs
        # would hash every byte a second time for nothing.
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    session = boto3.session.Session(profile_name=profile_name, region_name=region_name)
    return session.client("s3", endpoint_url=endpoint_url, config=config)


def _redact(url: str) -> str:
    """The endpoint URL without any user:password part."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]))
