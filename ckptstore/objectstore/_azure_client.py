"""AzureStore's configuration: the container-name check, where credentials come from, and the
azure-storage-blob client built from the store's options when the caller hands it none.

Credentials come only from Azure's usual places, in this order, and are never stored or
printed (messages name the account URL, never a key, a connection string or a SAS token):

1. a connection string: the ``connection_string`` option, else ``AZURE_STORAGE_CONNECTION_STRING``
   (what Azurite and ``az storage account show-connection-string`` give); an ``account_url``
   given too sends its credentials to that endpoint instead of the string's;
2. an account name (``account_name`` option, ``AZURE_STORAGE_ACCOUNT_NAME`` or the Azure CLI's
   ``AZURE_STORAGE_ACCOUNT``) with its account key (``AZURE_STORAGE_ACCOUNT_KEY`` or
   ``AZURE_STORAGE_KEY``) or a SAS token (``AZURE_STORAGE_SAS_TOKEN``);
3. an account name alone: ``DefaultAzureCredential`` from azure-identity (environment, workload
   or managed identity, ``az login``).

The client's own retries are turned off: every request goes through one RemoteCaller policy.
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

from ckptstore.errors import ConfigError
from ckptstore.names import printable

if TYPE_CHECKING:
    from azure.storage.blob import BlobServiceClient

_CONTAINER_RE = re.compile(r"[a-z0-9](?:[a-z0-9]|-(?=[a-z0-9])){2,62}", re.ASCII)
_ACCOUNT_RE = re.compile(r"[a-z0-9]{3,24}", re.ASCII)
#: Azure's largest Put Blob (service versions since 2019-12-12).
MAX_PUT_BLOB = 5000 << 20
#: Bytes moved per socket read or write of a request body.
_IO_STEP = 1 << 20
_ACCOUNT_NAME_VARS = ("AZURE_STORAGE_ACCOUNT_NAME", "AZURE_STORAGE_ACCOUNT")
_ACCOUNT_KEY_VARS = ("AZURE_STORAGE_ACCOUNT_KEY", "AZURE_STORAGE_KEY")


def check_container_name(container: str) -> str:
    """``container`` if it follows Azure's naming rules, else a ConfigError that names the rule
    (checked when a store is opened, so a mistyped ``--store`` fails at once)."""
    if _CONTAINER_RE.fullmatch(container):
        return container
    if not container:
        raise ConfigError("AzureStore needs a container name, e.g. az://checkpoints/run-1")
    rule = (
        "must be 3-63 characters long"
        if not 3 <= len(container) <= 63
        else "may hold only lowercase letters, digits and single '-' between them, starting "
        "and ending with a letter or digit"
    )
    raise ConfigError(
        f"invalid Azure container name '{printable(container)}': a container name {rule} "
        "(e.g. az://checkpoints/run-1); check --store / $CKPTSTORE_STORE"
    )


def redact_url(url: str) -> str:
    """``url`` without a query (a SAS token) or a ``user:password@`` part: safe to print."""
    parts = urlsplit(url)
    netloc = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit((parts.scheme, netloc, parts.path.rstrip("/"), "", ""))


def _env(names: tuple[str, ...]) -> tuple[str, str] | None:
    """The first of ``names`` set to a non-empty value, as (name, value)."""
    for name in names:
        value = os.environ.get(name, "").strip()
        if value:
            return name, value
    return None


def make_service_client(
    *,
    account_url: str | None,
    account_name: str | None,
    connection_string: str | None,
    credential: Any,
    connect_timeout: float,
    read_timeout: float,
    max_connections: int,
) -> BlobServiceClient:
    """A BlobServiceClient for AzureStore's options (their meanings are on AzureStore), with
    the credentials found as the module docstring says."""
    from azure.storage.blob import BlobServiceClient

    options: dict[str, Any] = {
        "retry_total": 0,  # RemoteCaller retries, with ckptstore's policy
        "transport": _transport(connect_timeout, read_timeout, max_connections),
        # upload_blob is one Put Blob up to this size; AzureStore sends bigger blobs as blocks
        # itself (the SDK's own block upload would name blocks by offset: see _azure_blocks).
        "max_single_put_size": MAX_PUT_BLOB,
        # Downloads in 8 MiB requests (one for a small blob), several at once for a big one.
        "max_single_get_size": 8 << 20,
        "max_chunk_get_size": 8 << 20,
    }
    if account_url is not None and "@" in urlsplit(account_url).netloc:
        raise ConfigError(
            f"the Azure account URL {redact_url(account_url)} embeds credentials "
            "(user:password@); remove them and give credentials the usual Azure way "
            "(AZURE_STORAGE_CONNECTION_STRING, AZURE_STORAGE_ACCOUNT_KEY, az login)"
        )
    from_env = _env(("AZURE_STORAGE_CONNECTION_STRING",))
    if connection_string is None and from_env is not None:
        connection_string = from_env[1]
    if connection_string is not None and credential is None:
        source = "the connection_string option" if from_env is None else from_env[0]
        try:
            client = BlobServiceClient.from_connection_string(connection_string, **options)
        except ValueError as exc:
            raise ConfigError(
                f"the Azure connection string from {source} is malformed ({exc}); give one "
                "like 'DefaultEndpointsProtocol=https;AccountName=...;AccountKey=...' "
                "(az storage account show-connection-string)"
            ) from None
        if account_url is None or redact_url(account_url) == redact_url(client.url):
            return client
        # Another endpoint of the same account (a proxy, a private endpoint): the connection
        # string's credentials, sent there.
        return BlobServiceClient(account_url, credential=client.credential, **options)
    name = account_name or _account_from_url(account_url)
    if name is None:
        found = _env(_ACCOUNT_NAME_VARS)
        name = found[1] if found else None
    if name is None:
        raise ConfigError(
            "no Azure storage account for the az:// store: set AZURE_STORAGE_CONNECTION_STRING, "
            "or AZURE_STORAGE_ACCOUNT_NAME (with AZURE_STORAGE_ACCOUNT_KEY, or signed in with "
            "az login / a managed identity), or give the store option account_url"
        )
    if not _ACCOUNT_RE.fullmatch(name):
        raise ConfigError(
            f"invalid Azure storage account name '{printable(name)}': 3-24 lowercase letters "
            "and digits; check AZURE_STORAGE_ACCOUNT_NAME or the store option account_name"
        )
    url = account_url or f"https://{name}.blob.core.windows.net"
    return BlobServiceClient(url, credential=credential or _credential(name), **options)


def _transport(connect_timeout: float, read_timeout: float, max_connections: int) -> Any:
    """The SDK's requests transport with a connection pool as large as the threads that share
    it (requests keeps 10; the 11th concurrent request would open and discard a connection),
    moving bodies in 1 MiB steps both ways (urllib3 sends in 16 KiB writes and azure-core reads
    in 4 KiB ones by default: a 64 MiB download took 2.5x the CPU)."""
    import requests
    from azure.core.pipeline.transport import RequestsTransport

    class Adapter(requests.adapters.HTTPAdapter):
        def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
            kwargs["blocksize"] = _IO_STEP
            super().init_poolmanager(*args, **kwargs)

    session = requests.Session()
    adapter = Adapter(pool_connections=4, pool_maxsize=max_connections, max_retries=0)
    session.mount("https://", adapter)
    session.mount("http://", adapter)
    return RequestsTransport(
        session=session,
        session_owner=True,
        connection_timeout=connect_timeout,
        read_timeout=read_timeout,
        connection_data_block_size=_IO_STEP,
    )


def _account_from_url(url: str | None) -> str | None:
    """The account name of ``https://<account>.blob.core.windows.net``, else None."""
    if url is None:
        return None
    host = urlsplit(url).hostname or ""
    return host.split(".", 1)[0] if host.endswith(".core.windows.net") else None


def _credential(account_name: str) -> Any:
    """The account key or SAS token from the environment, else DefaultAzureCredential."""
    key = _env(_ACCOUNT_KEY_VARS)
    if key is not None:
        return {"account_name": account_name, "account_key": key[1]}
    sas = _env(("AZURE_STORAGE_SAS_TOKEN",))
    if sas is not None:
        from azure.core.credentials import AzureSasCredential

        return AzureSasCredential(sas[1].lstrip("?"))
    try:
        from azure.identity import DefaultAzureCredential
    except ImportError:
        raise ConfigError(
            f"no key for Azure storage account {account_name!r} and azure-identity is not "
            "installed: set AZURE_STORAGE_ACCOUNT_KEY or AZURE_STORAGE_CONNECTION_STRING, or "
            "pip install azure-identity to sign in with az login or a managed identity"
        ) from None
    return DefaultAzureCredential()
