"""A GCE metadata server of our own for tests (the real one has no emulator).

It speaks the parts of the protocol tpud uses: GET /computeMetadata/v1/<key> with the
Metadata-Flavor: Google request header (403 without it), Metadata-Flavor and ETag response
headers, 404 for absent keys, and hanging GETs (wait_for_change=true, last_etag, timeout_sec)
that return as soon as the value's etag differs from last_etag, or after timeout_sec with the
current value. Tests change values with set()/delete(), which wake every waiting request, make
requests fail with fail_next(), and check what clients sent through the recorded requests.

Clients find it through GCE_METADATA_HOST=<server.host>, as google-auth does.
Run alone: python -m testkit.metadata_server (prints its host; Ctrl-C stops it).
"""

from __future__ import annotations

import hashlib
import itertools
import threading
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

PREFIX = "/computeMetadata/v1/"
DEFAULTS = {"instance/preempted": "FALSE", "instance/maintenance-event": "NONE"}


@dataclass
class Request:
    """One request, recorded when it arrives (so tests see hanging requests while they wait)."""

    key: str  # path below /computeMetadata/v1/, e.g. "instance/preempted"
    query: dict[str, str]
    flavor: bool  # carried Metadata-Flavor: Google
    time: float  # time.monotonic() when it arrived
    status: int | None = None  # what the server answered; None while it waits

    @property
    def hanging(self) -> bool:
        return self.query.get("wait_for_change") == "true"


class MetadataServer:
    def __init__(self, values: dict[str, str] | None = None):
        self._cond = threading.Condition()
        self._values: dict[str, str] = {}
        self._etags: dict[str, str] = {}
        self._generation = itertools.count()
        self._fail: dict[str | None, int] = {}  # key (None: any key) -> requests left to fail
        self._closing = False
        self.requests: list[Request] = []
        for key, value in {**DEFAULTS, **(values or {})}.items():
            self.set(key, value)
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="metadata-server", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return self._httpd.server_address[1]

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    # -- what tests change ------------------------------------------------------------------

    def set(self, key: str, value: str) -> None:
        """Set a value; its etag changes (even for the same value) and waiting requests return."""
        with self._cond:
            self._values[key] = value
            self._etags[key] = hashlib.sha256(f"{key}\0{next(self._generation)}\0{value}".encode()).hexdigest()[:16]
            self._cond.notify_all()

    def delete(self, key: str) -> None:
        """Remove a key (404 from now on); waiting requests on it return the 404."""
        with self._cond:
            self._values.pop(key, None)
            self._etags[key] = f"gone-{next(self._generation)}"
            self._cond.notify_all()

    def get(self, key: str) -> str | None:
        with self._cond:
            return self._values.get(key)

    def etag(self, key: str) -> str | None:
        with self._cond:
            return self._etags.get(key) if key in self._values else None

    def fail_next(self, n: int, key: str | None = None) -> None:
        """Answer the next n requests (for key, or for any key) with 503, as an overloaded server does."""
        with self._cond:
            self._fail[key] = self._fail.get(key, 0) + n

    # -- what tests check -------------------------------------------------------------------

    def requests_for(self, key: str) -> list[Request]:
        with self._cond:
            return [r for r in self.requests if r.key == key]

    def count(self, key: str) -> int:
        return len(self.requests_for(key))

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> MetadataServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- serving ----------------------------------------------------------------------------

    def _answer(self, request: Request) -> tuple[int, str, str | None]:
        """(status, body, etag) for one request; hanging requests wait here."""
        status, body, etag = self._decide(request.key, request.query, request.flavor)
        with self._cond:
            request.status = status
        return status, body, etag

    def _decide(self, key: str, query: dict[str, str], flavor: bool) -> tuple[int, str, str | None]:
        with self._cond:
            if not flavor:
                # The real server's answer to a request without the header.
                return 403, "Missing required header \"Metadata-Flavor\": \"Google\"\n", None
            for which in (key, None):
                if self._fail.get(which, 0) > 0:
                    self._fail[which] -= 1
                    return 503, "Service Unavailable\n", None
            if query.get("wait_for_change", "").lower() == "true":
                # Without last_etag: wait for a change from the value current at arrival.
                last = query.get("last_etag", self._etags.get(key))
                try:
                    timeout = float(query.get("timeout_sec", "300"))
                except ValueError:
                    return 400, "bad timeout_sec\n", None
                deadline = time.monotonic() + timeout
                while self._etags.get(key) == last and not self._closing:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
            if key not in self._values:
                return 404, "Not Found\n", None
            return 200, self._values[key], self._etags[key]

    def _record(self, request: Request) -> None:
        with self._cond:
            self.requests.append(request)


def _handler_for(server: MetadataServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            arrived = time.monotonic()
            url = urllib.parse.urlsplit(self.path)
            flavor = self.headers.get("Metadata-Flavor") == "Google"
            query = dict(urllib.parse.parse_qsl(url.query))
            key = url.path[len(PREFIX):] if url.path.startswith(PREFIX) else url.path
            request = Request(key, query, flavor, arrived)
            server._record(request)
            if url.path.startswith(PREFIX):
                status, body, etag = server._answer(request)
            else:
                status, body, etag = 404, "Not Found\n", None
                request.status = status
            data = body.encode()
            try:
                self.send_response(status)
                self.send_header("Metadata-Flavor", "Google")
                self.send_header("Content-Type", "application/text")
                self.send_header("Content-Length", str(len(data)))
                if etag is not None:
                    self.send_header("ETag", etag)
                self.end_headers()
                self.wfile.write(data)
            except OSError:
                pass  # the client went away while we waited (a watcher stopping): fine

        def log_message(self, format: str, *args) -> None:
            pass  # keep test output clean

    return Handler


@pytest.fixture
def metadata_server() -> Iterator[MetadataServer]:
    server = MetadataServer()
    try:
        yield server
    finally:
        server.close()


if __name__ == "__main__":
    srv = MetadataServer()
    print(srv.host, flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        srv.close()
