"""GCSStore's configuration: the bucket-name check, and the ``google-cloud-storage`` client built
from the store's options, with its credentials and endpoint.

Credentials come only from Google's usual chain, Application Default Credentials: the key file
named by ``GOOGLE_APPLICATION_CREDENTIALS``, ``gcloud auth application-default login``, or the
metadata server of a Google Cloud VM. With ``STORAGE_EMULATOR_HOST`` set (an emulator), requests
go there unsigned, as the client library does. Nothing here stores or prints a credential.
"""

from __future__ import annotations

import os
import re
import warnings
from typing import Any
from urllib.parse import urlsplit

from ckptstore.errors import ConfigError, StorePermissionError
from ckptstore.names import printable

#: The variable the client library (and gcloud, and every GCS emulator) reads for an emulator.
EMULATOR_ENV = "STORAGE_EMULATOR_HOST"
#: Where requests go without an emulator or an explicit endpoint.
DEFAULT_ENDPOINT = "https://storage.googleapis.com"
_BUCKET_RE = re.compile(r"[a-z0-9][a-z0-9._-]*[a-z0-9]", re.ASCII)
_IPV4_RE = re.compile(r"\d+\.\d+\.\d+\.\d+", re.ASCII)
CREDENTIALS_HINT = (
    "check the credentials Application Default Credentials finds "
    "(GOOGLE_APPLICATION_CREDENTIALS, `gcloud auth application-default login`) and that they "
    "may read and write objects in the bucket (e.g. roles/storage.objectAdmin)"
)
NO_CREDENTIALS_HINT = (
    "set GOOGLE_APPLICATION_CREDENTIALS to a service-account key file or run "
    "`gcloud auth application-default login`; for an emulator set STORAGE_EMULATOR_HOST"
)


def check_bucket_name(bucket: str) -> str:
    """``bucket`` if it follows GCS's naming rules, else a ConfigError that names the rule."""
    if not bucket:
        raise ConfigError("GCSStore needs a bucket name, e.g. gs://my-bucket/checkpoints")
    longest = 222 if "." in bucket else 63
    if not 3 <= len(bucket) <= longest:
        rule = f"must be 3-{longest} characters long"
    elif not _BUCKET_RE.fullmatch(bucket):
        rule = (
            "may hold only lowercase letters, digits, '-', '_' and '.', and must start and end "
            "with a letter or digit"
        )
    elif ".." in bucket or any(len(part) > 63 for part in bucket.split(".")):
        rule = "must not contain '..' or a dot-separated part longer than 63 characters"
    elif _IPV4_RE.fullmatch(bucket):
        rule = "must not look like an IP address"
    elif bucket.startswith("goog"):
        rule = "must not start with 'goog'"
    else:
        return bucket
    raise ConfigError(
        f"invalid GCS bucket name '{printable(bucket)}': a bucket name {rule} "
        "(e.g. gs://my-bucket/checkpoints); check --store / $CKPTSTORE_STORE"
    )


def emulator_host() -> str | None:
    """The emulator's URL from ``STORAGE_EMULATOR_HOST`` (a scheme added if it has none)."""
    host = os.environ.get(EMULATOR_ENV, "").strip()
    if not host:
        return None
    return host if "://" in host else f"http://{host}"


def check_endpoint(endpoint: str) -> str:
    """``endpoint`` without a trailing slash; one that embeds credentials is refused."""
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(
            f"invalid GCS endpoint '{printable(endpoint)}': use http(s)://host[:port], "
            f"e.g. http://127.0.0.1:9023 (the store option endpoint_url or {EMULATOR_ENV})"
        )
    if "@" in parts.netloc:
        raise ConfigError(
            "the GCS endpoint URL embeds credentials (user:password@): remove them and give "
            "credentials through Application Default Credentials (GOOGLE_APPLICATION_CREDENTIALS)"
        )
    return endpoint.rstrip("/")


def import_storage() -> Any:
    """``google.cloud.storage``, imported without google-api-core's ImportWarning about a
    missing grpcio-status (GCSStore uses no gRPC)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Please install grpcio-status", ImportWarning)
        from google.cloud import storage  # type: ignore[import-untyped,attr-defined,unused-ignore]
    return storage


def make_client(
    *, endpoint_url: str | None, project: str | None, anonymous: bool | None, pool_size: int
) -> Any:
    """A ``google.cloud.storage.Client`` for GCSStore's options (their meanings are on
    GCSStore); its HTTP session keeps up to ``pool_size`` connections and never retries by
    itself (GCSStore's RemoteCaller does)."""
    import google.auth
    import google.auth.exceptions
    import requests.adapters
    from google.api_core.client_options import ClientOptions
    from google.auth.credentials import AnonymousCredentials

    storage = import_storage()
    emulator = emulator_host()
    endpoint = check_endpoint(endpoint_url or emulator or DEFAULT_ENDPOINT)
    if anonymous is None:
        # Towards the emulator, also when its URL is given explicitly: a store reopened in
        # another process from its URL and endpoint (Megatron's async saves) stays anonymous.
        anonymous = emulator is not None and endpoint == check_endpoint(emulator)
    options = ClientOptions(api_endpoint=endpoint)
    try:
        if anonymous:
            client = storage.Client(
                project=project or "ckptstore",
                credentials=AnonymousCredentials(),  # type: ignore[no-untyped-call]
                client_options=options,
            )
        else:
            credentials, found_project = google.auth.default(
                scopes=["https://www.googleapis.com/auth/devstorage.read_write"]
            )
            client = storage.Client(
                project=project or found_project or "ckptstore",
                credentials=credentials,
                client_options=options,
            )
    except google.auth.exceptions.DefaultCredentialsError as exc:
        raise StorePermissionError(
            f"no usable Google credentials for gs:// stores ({_first_line(exc)}); "
            f"{NO_CREDENTIALS_HINT}"
        ) from None
    adapter = requests.adapters.HTTPAdapter(
        pool_connections=4, pool_maxsize=pool_size, max_retries=0
    )
    client._http.mount("https://", adapter)
    client._http.mount("http://", adapter)
    return client


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
