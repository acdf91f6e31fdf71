"""tpud.metadata against our own metadata server (testkit/metadata_server.py): real sockets and threads.

Run with the plugin that provides the metadata_server fixture: pytest -p testkit.metadata_server.
"""

from __future__ import annotations

import json
import queue
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from structlog.testing import capture_logs

from testkit.helpers import wait_until as wait
from testkit.metadata_server import MetadataServer
from tpud.metadata import OFF_CLOUD_MESSAGE, MetadataWatcher, Notice, resolve_host

PREEMPTED = "instance/preempted"
MAINTENANCE = "instance/maintenance-event"
UPCOMING = "instance/upcoming-maintenance"


class Notices:
    """Collects notices from the watcher's threads."""

    def __init__(self):
        self.queue: queue.Queue[Notice] = queue.Queue()
        self.all: list[Notice] = []

    def __call__(self, notice: Notice) -> None:
        self.all.append(notice)
        self.queue.put(notice)

    def next(self, timeout: float = 3.0) -> Notice:
        return self.queue.get(timeout=timeout)

    def none_within(self, seconds: float) -> bool:
        try:
            extra = self.queue.get(timeout=seconds)
        except queue.Empty:
            return True
        raise AssertionError(f"unexpected notice {extra}")


def wait_until(predicate, timeout: float = 3.0) -> None:
    wait(predicate, timeout=timeout, interval=0.01)


@pytest.fixture
def watch():
    """watch(host, **options) -> (watcher, notices): a started watcher with short test timings."""
    started: list[MetadataWatcher] = []

    def make(host: str, **options):
        notices = Notices()
        settings = dict(timeout_sec=5, upcoming_poll_seconds=0.05, idle_retry_seconds=0.1,
                        backoff_initial_seconds=0.02, backoff_max_seconds=0.1)
        settings.update(options)
        watcher = MetadataWatcher(notices, host=host, **settings)
        watcher.start()
        started.append(watcher)
        return watcher, notices

    yield make
    for watcher in started:
        watcher.stop()


def hanging(server: MetadataServer, key: str) -> list:
    return [r for r in server.requests_for(key) if r.hanging]


def test_preempted_turning_true_gives_one_notice_at_once(metadata_server, watch):
    watcher, notices = watch(metadata_server.host)
    # The watcher is waiting in a hanging GET on the baseline etag.
    wait_until(lambda: hanging(metadata_server, PREEMPTED))
    assert watcher.state == "watching"
    t0 = time.monotonic()
    metadata_server.set(PREEMPTED, "TRUE")
    assert notices.next() == Notice("preempted", "preemption", "TRUE")
    assert time.monotonic() - t0 < 0.5  # wait_for_change answers at once: no polling delay
    notices.none_within(0.2)
    metadata_server.set(PREEMPTED, "FALSE")
    assert notices.next() == Notice("preempted", "clear", "FALSE")


def test_requests_follow_the_protocol(metadata_server, watch):
    watcher, notices = watch(metadata_server.host)
    wait_until(lambda: hanging(metadata_server, PREEMPTED) and hanging(metadata_server, MAINTENANCE))
    first_etag = metadata_server.etag(PREEMPTED)
    metadata_server.set(PREEMPTED, "TRUE")
    notices.next()
    wait_until(lambda: len(hanging(metadata_server, PREEMPTED)) >= 2)
    watcher.stop()

    assert metadata_server.requests, "no request reached the server"
    assert all(r.flavor for r in metadata_server.requests), "a request without Metadata-Flavor: Google"
    assert all(r.status != 403 for r in metadata_server.requests)
    for key in (PREEMPTED, MAINTENANCE):
        requests = metadata_server.requests_for(key)
        # Baseline with a plain read, then hanging GETs that pass the etag last seen.
        assert not requests[0].hanging
        for r in requests[1:]:
            assert r.hanging and r.query["timeout_sec"] == "5" and r.query["last_etag"]
    preempted = hanging(metadata_server, PREEMPTED)
    assert preempted[0].query["last_etag"] == first_etag
    assert preempted[1].query["last_etag"] == metadata_server.etag(PREEMPTED)
    assert all(not r.hanging for r in metadata_server.requests_for(UPCOMING))


def test_maintenance_migrate_terminate_none(metadata_server, watch):
    watcher, notices = watch(metadata_server.host)
    wait_until(lambda: hanging(metadata_server, MAINTENANCE))
    metadata_server.set(MAINTENANCE, "MIGRATE_ON_HOST_MAINTENANCE")
    assert notices.next() == Notice("maintenance_event", "migrate", "MIGRATE_ON_HOST_MAINTENANCE")
    metadata_server.set(MAINTENANCE, "TERMINATE_ON_HOST_MAINTENANCE")
    assert notices.next() == Notice("maintenance_event", "terminate", "TERMINATE_ON_HOST_MAINTENANCE")
    metadata_server.set(MAINTENANCE, "NONE")
    assert notices.next() == Notice("maintenance_event", "clear", "NONE")
    notices.none_within(0.2)


def test_only_changes_of_meaning_are_notices(metadata_server, watch):
    watcher, notices = watch(metadata_server.host)
    wait_until(lambda: hanging(metadata_server, MAINTENANCE))
    metadata_server.set(MAINTENANCE, "NONE")  # new etag, same value
    metadata_server.set(PREEMPTED, "FALSE")
    wait_until(lambda: len(hanging(metadata_server, MAINTENANCE)) >= 2)
    notices.none_within(0.2)
    metadata_server.set(MAINTENANCE, "MIGRATE_ON_HOST_MAINTENANCE")
    assert notices.next().kind == "migrate"
    metadata_server.set(MAINTENANCE, "MIGRATE_ON_HOST_MAINTENANCE_SOON")  # another MIGRATE value
    notices.none_within(0.2)
    metadata_server.set(MAINTENANCE, "SOMETHING_NEW")  # unknown: logged, meaning kept
    notices.none_within(0.2)
    assert watcher.state == "watching"


def test_notice_given_before_the_watcher_started(watch):
    with MetadataServer({PREEMPTED: "TRUE", MAINTENANCE: "TERMINATE_ON_HOST_MAINTENANCE"}) as server:
        watcher, notices = watch(server.host)
        got = {notices.next(), notices.next()}
        assert got == {Notice("preempted", "preemption", "TRUE"),
                       Notice("maintenance_event", "terminate", "TERMINATE_ON_HOST_MAINTENANCE")}
        notices.none_within(0.2)
        watcher.stop()


def test_timeout_with_the_same_etag_just_waits_again(metadata_server, watch):
    watcher, notices = watch(metadata_server.host, timeout_sec=1)
    wait_until(lambda: len(hanging(metadata_server, PREEMPTED)) >= 2, timeout=4)
    first, second = hanging(metadata_server, PREEMPTED)[:2]
    assert first.query["last_etag"] == second.query["last_etag"] == metadata_server.etag(PREEMPTED)
    assert second.time - first.time >= 0.9  # the server held the first one for timeout_sec
    assert notices.all == []
    assert watcher.state == "watching"


def test_503_is_retried_with_backoff_and_the_notice_still_arrives(metadata_server, watch):
    metadata_server.fail_next(4, key=PREEMPTED)
    states: set[str] = set()
    watcher, notices = watch(metadata_server.host, backoff_initial_seconds=0.1, backoff_max_seconds=0.4)
    sample = threading.Event()

    def sampler():
        while not sample.is_set():
            states.add(watcher.state)
            time.sleep(0.005)

    thread = threading.Thread(target=sampler, daemon=True)
    thread.start()
    wait_until(lambda: hanging(metadata_server, PREEMPTED), timeout=5)
    sample.set()
    thread.join()
    assert "retrying" in states
    assert watcher.state == "watching"  # backoff over after the first success

    requests = metadata_server.requests_for(PREEMPTED)
    assert [r.status for r in requests[:5]] == [503, 503, 503, 503, 200]
    gaps = [b.time - a.time for a, b in zip(requests[:5], requests[1:5])]
    # Jittered exponential steps 0.1, 0.2, 0.4, 0.4 (capped): each wait is half to all of its step.
    for gap, step in zip(gaps, [0.1, 0.2, 0.4, 0.4]):
        assert step / 2 - 0.01 <= gap <= step + 0.1, gaps
    metadata_server.set(PREEMPTED, "TRUE")
    assert notices.next() == Notice("preempted", "preemption", "TRUE")


def test_upcoming_maintenance_through_the_poller(metadata_server, watch):
    watcher, notices = watch(metadata_server.host)
    wait_until(lambda: metadata_server.count(UPCOMING) >= 2)  # 404s: nothing scheduled, no notice
    assert all(r.status == 404 for r in metadata_server.requests_for(UPCOMING))
    notices.none_within(0.1)
    assert watcher.state == "watching"

    window = {"type": "SCHEDULED", "maintenanceStatus": "PENDING", "canReschedule": True,
              "windowStartTime": "2030-01-01T00:00:00Z", "latestWindowStartTime": "2030-01-02T00:00:00Z"}
    metadata_server.set(UPCOMING, json.dumps(window))
    notice = notices.next()
    assert (notice.source, notice.kind) == ("upcoming_maintenance", "upcoming")
    assert json.loads(notice.value) == window
    metadata_server.set(UPCOMING, json.dumps(window, indent=2))  # same content, other formatting
    notices.none_within(0.2)
    metadata_server.set(UPCOMING, json.dumps({**window, "maintenanceStatus": "ONGOING"}))
    assert notices.next().kind == "upcoming"
    metadata_server.delete(UPCOMING)
    assert notices.next() == Notice("upcoming_maintenance", "clear", "")


def test_off_cloud_closed_port_is_idle(watch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: connections are refused
    with capture_logs() as logs:
        watcher, notices = watch(f"127.0.0.1:{port}")
        time.sleep(0.5)  # several idle retries
        assert watcher.state == "idle"
        watcher.stop()
    assert notices.all == []
    assert [e["log_level"] for e in logs if e["event"] == OFF_CLOUD_MESSAGE] == ["info"]
    assert not [e for e in logs if e["log_level"] in ("warning", "error", "critical")]


class PlainHandler(BaseHTTPRequestHandler):
    """An HTTP server that is not a metadata server: 200 for everything, no Metadata-Flavor."""

    def do_GET(self):
        data = b"TRUE"  # would read as a preemption if the header were not checked
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("ETag", "x")
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_off_cloud_server_without_metadata_flavor_is_idle(watch):
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), PlainHandler)
    httpd.daemon_threads = True
    requests = []
    httpd.RequestHandlerClass = type("Counting", (PlainHandler,), {
        "do_GET": lambda self: (requests.append(self.path), PlainHandler.do_GET(self))})
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        with capture_logs() as logs:
            watcher, notices = watch(f"127.0.0.1:{httpd.server_address[1]}")
            wait_until(lambda: len(requests) >= 6)  # it keeps retrying, quietly
            assert watcher.state == "idle"
            watcher.stop()
        assert notices.all == []
        assert all("wait_for_change" not in p for p in requests)  # never trusted it enough to hang
        assert [e["event"] for e in logs if e["event"] == OFF_CLOUD_MESSAGE] == [OFF_CLOUD_MESSAGE]
        assert not [e for e in logs if e["log_level"] in ("warning", "error", "critical")]
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_server_lost_after_it_was_seen_is_retrying_not_idle(watch):
    server = MetadataServer()
    try:
        watcher, notices = watch(server.host)
        wait_until(lambda: watcher.state == "watching" and hanging(server, PREEMPTED))
    finally:
        server.close()
    # The hanging read is cut (or the next connect is refused): an outage on cloud, not "off cloud".
    wait_until(lambda: watcher.state == "retrying")
    time.sleep(0.2)
    assert watcher.state == "retrying"
    assert notices.all == []


def test_stop_is_prompt_during_a_hanging_read(metadata_server, watch):
    watcher, notices = watch(metadata_server.host, timeout_sec=300)
    wait_until(lambda: hanging(metadata_server, PREEMPTED) and hanging(metadata_server, MAINTENANCE))
    t0 = time.monotonic()
    watcher.stop()
    assert time.monotonic() - t0 < 1.5
    wait_until(lambda: not any(t.is_alive() for t in watcher._threads), timeout=2)
    metadata_server.set(PREEMPTED, "TRUE")
    time.sleep(0.1)
    assert notices.all == []  # nothing after stop()


def test_a_failing_handler_does_not_stop_the_watcher(metadata_server):
    seen: list[Notice] = []

    def handler(notice: Notice) -> None:
        seen.append(notice)
        raise RuntimeError("boom")

    watcher = MetadataWatcher(handler, host=metadata_server.host, timeout_sec=5, upcoming_poll_seconds=0.05)
    watcher.start()
    try:
        wait_until(lambda: hanging(metadata_server, PREEMPTED))
        metadata_server.set(PREEMPTED, "TRUE")
        wait_until(lambda: len(seen) == 1)
        metadata_server.set(PREEMPTED, "FALSE")
        wait_until(lambda: len(seen) == 2)
        assert [n.kind for n in seen] == ["preemption", "clear"]
    finally:
        watcher.stop()


def test_our_server_rejects_requests_without_the_header(metadata_server):
    import http.client

    conn = http.client.HTTPConnection(metadata_server.host, timeout=5)
    conn.request("GET", "/computeMetadata/v1/instance/preempted")
    response = conn.getresponse()
    response.read()
    assert response.status == 403 and response.getheader("Metadata-Flavor") == "Google"
    conn.request("GET", "/computeMetadata/v1/instance/preempted", headers={"Metadata-Flavor": "Google"})
    response = conn.getresponse()
    assert response.read() == b"FALSE" and response.getheader("ETag") == metadata_server.etag(PREEMPTED)
    conn.close()
    assert [r.flavor for r in metadata_server.requests] == [False, True]


def test_resolve_host_precedence(monkeypatch):
    monkeypatch.delenv("GCE_METADATA_HOST", raising=False)
    monkeypatch.delenv("GCE_METADATA_ROOT", raising=False)
    assert resolve_host(None) == "metadata.google.internal"
    assert resolve_host("") == "metadata.google.internal"
    assert resolve_host("10.0.0.5:8080") == "10.0.0.5:8080"
    monkeypatch.setenv("GCE_METADATA_ROOT", "legacy:81")  # google-auth's old name still counts
    assert resolve_host("10.0.0.5:8080") == "legacy:81"
    monkeypatch.setenv("GCE_METADATA_HOST", "127.0.0.1:9999")  # the new name wins over the old
    assert resolve_host("10.0.0.5:8080") == "127.0.0.1:9999"
    assert resolve_host(None) == "127.0.0.1:9999"
    monkeypatch.setenv("GCE_METADATA_HOST", "")  # empty is unset, as in google-auth
    assert resolve_host(None) == "legacy:81"


def test_watcher_without_host_uses_gce_metadata_host(metadata_server, monkeypatch):
    monkeypatch.setenv("GCE_METADATA_HOST", metadata_server.host)
    notices = Notices()
    watcher = MetadataWatcher(notices, timeout_sec=5)
    assert watcher.host == metadata_server.host
    watcher.start()
    try:
        wait_until(lambda: hanging(metadata_server, PREEMPTED))
        metadata_server.set(PREEMPTED, "TRUE")
        assert notices.next().kind == "preemption"
    finally:
        watcher.stop()
