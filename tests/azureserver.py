"""Azurite, Microsoft's Azure Blob emulator, on 127.0.0.1 for tests, and store factories over it.

Azurite comes from the npm registry; ``make test`` installs the pinned version into
``.cache/azurite`` (the Makefile's ``azurite`` target). The server runs as a real subprocess
(``azurite-blob``: the Blob service only) on a free port, keeping blobs in memory, for a whole
test session; tests isolate themselves under random prefixes or in fresh containers.

Flags: ``--skipApiVersionCheck`` because azure-storage-blob sends a newer service version than
Azurite knows (the requests are the same); ``--disableTelemetry`` since nothing may leave the
machine; no ``--loose``: an unsupported header must fail a test, not be ignored.
"""

from __future__ import annotations

import random
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from azure.storage.blob import BlobServiceClient, ContainerClient

from ckptstore.objectstore._azure import AzureStore
from ckptstore.testing.factories import FAST_RETRY, StoreFactory

REPO = Path(__file__).resolve().parent.parent
AZURITE_DIR = REPO / ".cache" / "azurite"
AZURITE_BIN = AZURITE_DIR / "node_modules" / ".bin" / "azurite-blob"
#: The emulator's well-known development account (public, the same in every Azurite).
ACCOUNT = "devstoreaccount1"
ACCOUNT_KEY = (
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)
_PORT_LOW, _PORT_HIGH = 23_000, 26_999


def _free_port() -> int:
    rng = random.Random()
    for _ in range(1000):
        port = rng.randint(_PORT_LOW, _PORT_HIGH)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port for Azurite on 127.0.0.1")


def random_container(tag: str = "ckpt") -> str:
    """A fresh container name that follows Azure's rules."""
    return f"{tag}-{uuid.uuid4().hex[:20]}"


@dataclass
class Azurite:
    """One ``azurite-blob`` process."""

    root: Path
    port: int = 0
    process: subprocess.Popen[bytes] | None = None

    @property
    def account_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/{ACCOUNT}"

    @property
    def connection_string(self) -> str:
        return (
            f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={ACCOUNT_KEY};"
            f"BlobEndpoint={self.account_url};"
        )

    @property
    def log_path(self) -> Path:
        return self.root / "azurite.log"

    def start(self, timeout: float = 30.0, tries: int = 3) -> None:
        """Start on a free port and wait until it answers; retried if the port was taken."""
        if not AZURITE_BIN.exists():
            raise RuntimeError(
                f"Azurite is not installed ({AZURITE_BIN} is missing): run `make test`, or "
                "`make azurite` to install it alone (from npm; needs node 20)"
            )
        for attempt in range(1, tries + 1):
            self.port = _free_port()
            with open(self.log_path, "ab") as log:
                self.process = subprocess.Popen(
                    [
                        str(AZURITE_BIN),
                        "--blobHost=127.0.0.1",
                        f"--blobPort={self.port}",
                        "--inMemoryPersistence",
                        "--extentMemoryLimit=4096",
                        "--skipApiVersionCheck",
                        "--disableTelemetry",
                        "--silent",
                    ],
                    cwd=self.root,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            try:
                self._wait_ready(timeout)
                return
            except Exception:
                self.stop()
                if attempt == tries:
                    raise

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"azurite-blob exited with {self.process.returncode}: {self.log_tail()}"
                )
            try:
                urllib.request.urlopen(f"{self.account_url}?comp=list", timeout=2).close()
            except urllib.error.HTTPError:
                return  # it answers (403 to an unsigned request): ready
            except OSError:
                time.sleep(0.1)
                continue
            return
        raise RuntimeError(
            f"Azurite at {self.account_url} not ready after {timeout}s: {self.log_tail()}"
        )

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    def stop(self, timeout: float = 10.0) -> None:
        proc = self.process
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)


@contextmanager
def azurite(root: Path) -> Iterator[Azurite]:
    """Run Azurite for the duration of the block."""
    server = Azurite(root=root)
    server.start()
    try:
        yield server
    finally:
        server.stop()


class AzureEndpoint:
    """One Azurite for a whole session: a plain SDK client for checking what is stored."""

    def __init__(self, server: Azurite) -> None:
        self.server = server
        self.connection_string = server.connection_string
        self.account_url = server.account_url
        #: A plain client with the SDK's defaults, independent of the stores.
        self.raw = BlobServiceClient.from_connection_string(self.connection_string)


class AzureStoreFactory(StoreFactory[AzureStore]):
    """Stores over ``az://container/prefix`` on one Azurite; the container must exist."""

    backend = "azure"

    def __init__(self, endpoint: AzureEndpoint, *, container: str) -> None:
        super().__init__()
        self.endpoint = endpoint
        self.container = container
        #: This test's own corner of the container (containers are shared between tests).
        self.root = f"t-{uuid.uuid4().hex[:16]}"
        self.prefix = f"{self.root}/ckpt/run-1"
        self.created_containers: list[str] = []

    def _open(self, **options: Any) -> AzureStore:
        container = options.pop("container", self.container)
        options.setdefault("prefix", self.prefix)
        options.setdefault("retry", FAST_RETRY)
        # The suite's S3 multipart options, in Azure's words.
        if "multipart_threshold" in options:
            options["block_threshold"] = options.pop("multipart_threshold")
        if "part_size" in options:
            options["block_size"] = options.pop("part_size")
        if not {"account_url", "credential", "service_client"} & options.keys():
            options.setdefault("connection_string", self.endpoint.connection_string)
        return AzureStore(container, **options)

    def raw_container(self, container: str | None = None) -> ContainerClient:
        return self.endpoint.raw.get_container_client(container or self.container)

    def fresh_container(self) -> str:
        """Create an empty container of this test's own (for stores without a prefix)."""
        name = random_container()
        self.raw_container(name).create_container()
        self.created_containers.append(name)
        return name

    def full_name(self, key: str, prefix: str | None = None) -> str:
        prefix = self.prefix if prefix is None else prefix
        return f"{prefix}/{key}" if prefix else key

    def container_names(self, container: str | None = None, prefix: str = "") -> list[str]:
        """Every committed blob name in the container that starts with ``prefix``."""
        return [b.name for b in self.raw_container(container).list_blobs(name_starts_with=prefix)]

    def close_all(self) -> None:
        super().close_all()
        for name in self.created_containers:
            self.raw_container(name).delete_container()
        self.created_containers.clear()
