"""A Google Cloud Storage emulator on 127.0.0.1 for tests: gcp-storage-emulator (PyPI), run as a
real subprocess of this file, in memory, on a port the kernel picks (it prints ``READY <port>``).

gcp-storage-emulator ignores GCS preconditions: an upload with ``ifGenerationMatch=0`` overwrites
an existing object (real GCS answers 412 Precondition Failed). With ``--preconditions=honour``
(the default of :func:`gcs_emulator`) this launcher adds them the way GCS has them: an upload
whose ``ifGenerationMatch`` does not equal the object's generation (0: no object) gets 412 and a
GCS error body (reason ``conditionNotMet``) and writes nothing; a resumable upload is checked when
its session is opened and at each of its chunks (GCS: when opened and when it completes). The
emulator serves one request at a time, so the check and the write cannot interleave.
``--preconditions=ignore`` runs the emulator as published, to check how the store copes with it.

    python tests/gcsserver.py [--preconditions honour|ignore]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_PRECONDITION_FAILED = {
    "error": {
        "code": 412,
        "message": "At least one of the pre-conditions you specified did not hold.",
        "errors": [
            {
                "domain": "global",
                "reason": "conditionNotMet",
                "message": "At least one of the pre-conditions you specified did not hold.",
                "locationType": "header",
                "location": "If-Match",
            }
        ],
    }
}


@dataclass
class GCSEmulator:
    """One running emulator process."""

    process: subprocess.Popen[bytes]
    port: int
    log_path: Path
    honours_preconditions: bool

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def create_bucket(self, name: str) -> None:
        """Create bucket ``name`` with a plain JSON API request (no ckptstore code)."""
        request = urllib.request.Request(
            f"{self.endpoint_url}/storage/v1/b?project=test",
            data=json.dumps({"name": name}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=10) as answer:
            assert answer.status == 200, answer.status

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@contextmanager
def gcs_emulator(root: Path, *, honour_preconditions: bool = True) -> Iterator[GCSEmulator]:
    """Start the emulator (its log under ``root``); stop it on exit. A start that fails raises
    RuntimeError with the log's tail: the tests that need it cannot run without it."""
    root.mkdir(parents=True, exist_ok=True)
    log_path = root / "gcs-emulator.log"
    mode = "honour" if honour_preconditions else "ignore"
    env = {k: v for k, v in os.environ.items() if k != "STORAGE_EMULATOR_HOST"}
    with open(log_path, "ab") as log:
        process = subprocess.Popen(
            [sys.executable, __file__, f"--preconditions={mode}"],
            cwd=root,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=log,
        )
    try:
        port = _wait_ready(process, log_path, timeout=30.0)
        emulator = GCSEmulator(process, port, log_path, honour_preconditions)
        yield emulator
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if process.stdout is not None:
            process.stdout.close()


def _wait_ready(process: subprocess.Popen[bytes], log_path: Path, timeout: float) -> int:
    assert process.stdout is not None
    deadline = time.monotonic() + timeout
    line = process.stdout.readline()  # the child prints READY <port> once it listens
    if not line.startswith(b"READY "):
        process.kill()
        process.wait()
        tail = log_path.read_text(errors="replace")[-3000:]
        raise RuntimeError(
            f"the GCS emulator (gcp-storage-emulator) did not start: {line!r}; install the dev "
            f"extras (pip install -e '.[dev]'); its log ({log_path}):\n{tail}"
        )
    port = int(line.split()[1])
    while True:  # it listens already; one health check proves it answers
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2) as answer:
                if answer.status == 200:
                    return port
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the GCS emulator on port {port} does not answer") from None
            time.sleep(0.05)


# -- the child process -------------------------------------------------------------------------


def _add_preconditions() -> None:
    """Make the emulator's upload handlers honour ``ifGenerationMatch`` as GCS does."""
    from http import HTTPStatus

    from gcp_storage_emulator import server
    from gcp_storage_emulator.exceptions import NotFound
    from gcp_storage_emulator.handlers import objects

    def generation(storage: Any, bucket: str, name: str) -> int:
        try:
            return int(storage.get_file_obj(bucket, name)["generation"])
        except NotFound:
            return 0

    def target(request: Any, storage: Any) -> tuple[str, str] | None:
        upload_id = request.query.get("upload_id")
        if upload_id:
            try:
                obj = storage.get_resumable_file_obj(upload_id[0])
            except NotFound:
                return None
            return obj["bucket"], obj["name"]
        name = request.query.get("name", [None])[0]
        if name is None and isinstance(request.data, dict):
            meta = request.data.get("meta", request.data)
            name = meta.get("name") if isinstance(meta, dict) else None
        bucket = (request.params or {}).get("bucket_name")
        return (bucket, name) if bucket and name else None

    def guard(handler: Callable[..., Any]) -> Callable[..., Any]:
        def guarded(request: Any, response: Any, storage: Any, *args: Any, **kwargs: Any) -> Any:
            wanted = request.query.get("ifGenerationMatch")
            where = target(request, storage) if wanted else None
            if where is not None and generation(storage, *where) != int(wanted[0]):
                response.status = HTTPStatus.PRECONDITION_FAILED
                response.json(_PRECONDITION_FAILED)
                return None
            return handler(request, response, storage, *args, **kwargs)

        return guarded

    uploads = {objects.insert, objects.upload_partial}
    server.HANDLERS = tuple(  # type: ignore[assignment]
        (regex, {m: guard(h) if h in uploads else h for m, h in handlers.items()})
        for regex, handlers in server.HANDLERS
    )
    objects.insert = guard(objects.insert)  # the router's fallback for uploads without /upload


def _refuse_cut_short_bodies() -> None:
    """Drop a request whose body ends before its ``Content-Length`` (its client died sending
    it), as GCS does: the emulator as published stores the bytes that arrived, a torn object."""
    from gcp_storage_emulator import server

    read = server._read_raw_data

    def read_whole(request_handler: Any) -> Any:
        data = read(request_handler)
        length = request_handler.headers.get("Content-Length")
        if length and len(data or b"") < int(length):
            raise ConnectionAbortedError(f"request body cut short: {len(data or b'')} of {length}")
        return data

    server._read_raw_data = read_whole


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preconditions", choices=["honour", "ignore"], default="honour")
    args = parser.parse_args()
    if args.preconditions == "honour":
        _add_preconditions()
        _refuse_cut_short_bodies()
    from gcp_storage_emulator.server import create_server

    emulator = create_server("127.0.0.1", 0, in_memory=True)
    emulator.start()
    port = emulator._api._httpd.server_address[1]
    sys.stdout.write(f"READY {port}\n")
    sys.stdout.flush()
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        emulator.stop()


if __name__ == "__main__":
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    main()
