"""Preemption and maintenance notices from the GCE metadata server.

A Cloud TPU VM learns that it is about to go away from its metadata server, usually before the
SIGTERM arrives: `instance/preempted` turns TRUE (spot/preemptible VMs, about 30 s ahead) and
`instance/maintenance-event` names a live migration or a termination (60 s ahead). Both are
watched with the server's hanging GET (`wait_for_change=true&last_etag=...`), which answers as
soon as the value moves, so a notice costs no polling delay. TPU VMs also publish
`instance/upcoming-maintenance` (a JSON description of scheduled maintenance, 404 when none),
which is read periodically.

Off cloud (a laptop, CI) there is no metadata server: the watcher says so once and keeps
retrying quietly, and SIGTERM stays the only preemption signal.

Protocol: https://cloud.google.com/compute/docs/metadata/querying-metadata#waitforchange and
https://cloud.google.com/compute/docs/metadata/getting-live-migration-notice .
Standard library only: this runs in the daemon, which must start quickly and never import torch.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from engine.backoff import Backoff

log = structlog.get_logger()

DEFAULT_HOST = "metadata.google.internal"
FLAVOR_HEADER = "Metadata-Flavor"
FLAVOR = "Google"

# How long to wait for a TCP connection and for a plain (non-hanging) answer. The metadata
# server is link-local and answers in milliseconds; google-auth uses 3 s for its GCE check.
CONNECT_TIMEOUT = 3.0
READ_TIMEOUT = 10.0
# A hanging GET is answered by the server after timeout_sec at the latest; the socket waits a
# little longer so that a silent server is noticed without cutting off a good answer.
HANGING_READ_MARGIN = 5.0

OFF_CLOUD_MESSAGE = "no GCE metadata server; preemption notices come only from SIGTERM"


@dataclass(frozen=True)
class Notice:
    source: str  # "preempted" | "maintenance_event" | "upcoming_maintenance" (tpud_preemption_notices_total{source})
    kind: str  # "preemption" | "terminate" | "migrate" | "upcoming" | "clear"
    value: str  # raw value from the server (for logs)


def resolve_host(configured: str | None) -> str:
    """The metadata server's host[:port]: GCE_METADATA_HOST, then the legacy GCE_METADATA_ROOT
    (both as google-auth reads them, so the daemon and the GCS client agree), then the daemon's
    settings, then metadata.google.internal. Empty values count as unset."""
    for candidate in (os.environ.get("GCE_METADATA_HOST"), os.environ.get("GCE_METADATA_ROOT"), configured):
        if candidate and candidate.strip():
            return candidate.strip()
    return DEFAULT_HOST


def preempted_kind(value: str) -> str | None:
    """Meaning of instance/preempted; None for a value we do not know."""
    v = value.strip().upper()
    return {"TRUE": "preemption", "FALSE": "clear"}.get(v)


def maintenance_kind(value: str) -> str | None:
    """Meaning of instance/maintenance-event: the documented values are NONE,
    MIGRATE_ON_HOST_MAINTENANCE and TERMINATE_ON_HOST_MAINTENANCE; match on the words so that
    variants (new suffixes) are still understood. TERMINATE wins: it is the one that loses state."""
    v = value.strip().upper()
    if "TERMINATE" in v:
        return "terminate"
    if "MIGRATE" in v:
        return "migrate"
    if v in ("NONE", ""):
        return "clear"
    return None


class _OffCloud(Exception):
    """Nothing that speaks the metadata protocol answers at this host."""


class _Transient(Exception):
    """The metadata server is there but this request failed; retry with backoff."""


@dataclass(frozen=True)
class _Response:
    status: int  # 200 or 404; anything else raises _Transient
    body: str
    etag: str | None


class _Backoff:
    """The failures of one polling loop: exponential backoff with jitter (half to full of the step), capped."""

    def __init__(self, initial: float, cap: float):
        self.policy = Backoff(initial, cap, jitter=0.5)
        self.failures = 0

    def next_delay(self) -> float:
        self.failures += 1
        return self.policy.delay(self.failures)

    def should_log(self) -> bool:
        # Warn on failures 1, 2, 4, 8, ...: at most once per backoff step, and a long outage
        # at the cap does not fill the journal.
        return self.failures & (self.failures - 1) == 0

    def reset(self) -> None:
        self.failures = 0


class MetadataWatcher:
    """Watches the metadata server from daemon threads and calls on_notice on changes of meaning.

    on_notice runs on a watcher thread (one call at a time); the daemon posts it to its loop.
    """

    def __init__(self, on_notice: Callable[[Notice], None], *, host: str | None = None,
                 timeout_sec: int = 300, upcoming_poll_seconds: float = 60.0,
                 idle_retry_seconds: float = 60.0, backoff_initial_seconds: float = 1.0,
                 backoff_max_seconds: float = 30.0):
        self.on_notice = on_notice
        self.host = host or resolve_host(None)
        self.timeout_sec = max(1, int(timeout_sec))
        self.upcoming_poll_seconds = upcoming_poll_seconds
        self.idle_retry_seconds = idle_retry_seconds
        self.backoff_initial_seconds = backoff_initial_seconds
        self.backoff_max_seconds = backoff_max_seconds
        self._stop = threading.Event()
        # Set by the first genuine answer (one carrying Metadata-Flavor: Google). Before it, an
        # unreachable host means "not on GCE" (idle, quiet); after it, the same error is an outage
        # on cloud (backoff, warnings): the server was there, and a notice may be imminent.
        self._seen_server = threading.Event()
        self._lock = threading.Lock()
        self._emit_lock = threading.Lock()  # on_notice is never called concurrently
        self._states: dict[str, str] = {}
        self._connections: set[http.client.HTTPConnection] = set()
        self._threads: list[threading.Thread] = []
        self._logged_off_cloud = False

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        if self._threads:
            raise RuntimeError("MetadataWatcher already started")
        loops = {
            "preempted": lambda: self._watch_key("instance/preempted", "preempted", preempted_kind),
            "maintenance_event": lambda: self._watch_key("instance/maintenance-event", "maintenance_event",
                                                         maintenance_kind),
            "upcoming_maintenance": self._poll_upcoming,
        }
        for name, target in loops.items():
            self._states[name] = "idle"
            thread = threading.Thread(target=self._run, args=(name, target), name=f"tpud-metadata-{name}",
                                      daemon=True)
            self._threads.append(thread)
            thread.start()
        log.info("watching GCE metadata for preemption and maintenance", host=self.host)

    def stop(self) -> None:
        """Stop the threads; returns within about a second. Hanging reads are cut by shutting
        their sockets (a read could otherwise last timeout_sec); the threads are daemon threads
        anyway, so one that does not finish in time never holds up the daemon's exit."""
        self._stop.set()
        with self._lock:
            connections = list(self._connections)
        for conn in connections:
            sock = conn.sock
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in recv()
                except OSError:
                    pass
        deadline = time.monotonic() + 1.0
        for thread in self._threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))

    @property
    def state(self) -> str:
        """retrying if any loop is in backoff, else watching if any has a server, else idle."""
        with self._lock:
            states = set(self._states.values())
        for s in ("retrying", "watching"):
            if s in states:
                return s
        return "idle"

    # -- the loops -------------------------------------------------------------------------

    def _run(self, name: str, target: Callable[[], None]) -> None:
        # Last line of defence: a bug here must not kill the thread silently or reach the daemon.
        while not self._stop.is_set():
            try:
                target()
                return
            except Exception:
                log.exception("metadata watcher failed; restarting it", loop=name)
                self._set_state(name, "retrying")
                self._stop.wait(self.backoff_max_seconds)

    def _watch_key(self, key: str, source: str, classify: Callable[[str], str | None]) -> None:
        backoff = _Backoff(self.backoff_initial_seconds, self.backoff_max_seconds)
        meaning = "clear"  # so a TRUE/TERMINATE/MIGRATE already there at the first read is a notice
        etag: str | None = None
        have_baseline = False
        unknown_logged: set[str] = set()
        while not self._stop.is_set():
            if not have_baseline:
                # A plain read first: a hanging GET without last_etag would wait for the next
                # change and miss a notice given before the daemon started.
                response = self._fetch(source, key, {}, READ_TIMEOUT, backoff)
            else:
                query = {"wait_for_change": "true", "timeout_sec": str(self.timeout_sec)}
                if etag:
                    query["last_etag"] = etag
                response = self._fetch(source, key, query, self.timeout_sec + HANGING_READ_MARGIN, backoff)
            if response is None:
                continue
            if response.status == 404:
                # The key does not exist on this VM (not a notice, and no etag to wait on):
                # check again now and then.
                have_baseline, etag = False, None
                self._stop.wait(self.idle_retry_seconds)
                continue
            have_baseline = True
            # Same etag after timeout_sec means "no change": just wait again.
            etag = response.etag
            kind = classify(response.body)
            if kind is None:
                if response.body not in unknown_logged:
                    unknown_logged.add(response.body)
                    log.warning("unknown metadata value; ignored", key=key, value=response.body)
                continue
            if kind != meaning:
                meaning = kind
                self._emit(Notice(source, kind, response.body))

    def _poll_upcoming(self) -> None:
        source, key = "upcoming_maintenance", "instance/upcoming-maintenance"
        backoff = _Backoff(self.backoff_initial_seconds, self.backoff_max_seconds)
        current: str | None = None  # canonical form of the maintenance announced, None when none
        while not self._stop.is_set():
            response = self._fetch(source, key, {}, READ_TIMEOUT, backoff)
            if response is None:
                continue
            body = response.body.strip() if response.status == 200 else ""
            new = _canonical_json(body) if body else None
            if new != current:
                # Appeared or changed (a new window, a status moving to ONGOING): "upcoming";
                # gone: "clear" (only after one was announced).
                if new is not None or current is not None:
                    self._emit(Notice(source, "upcoming" if new is not None else "clear", body))
                current = new
            self._stop.wait(self.upcoming_poll_seconds)

    # -- helpers -----------------------------------------------------------------------------

    def _fetch(self, source: str, key: str, query: dict[str, str], read_timeout: float,
               backoff: _Backoff) -> _Response | None:
        """One GET; None after an error (already waited out) or once stopped: the loop goes round."""
        try:
            response = self._get(key, query, read_timeout)
        except _OffCloud as e:
            self._off_cloud(source, e)
            return None
        except _Transient as e:
            self._retry(source, key, backoff, e)
            return None
        if self._stop.is_set():
            return None
        self._recovered(source, key, backoff)
        return response

    def _get(self, key: str, query: dict[str, str], read_timeout: float) -> _Response:
        path = f"/computeMetadata/v1/{key}"
        if query:
            path += "?" + urllib.parse.urlencode(query)
        conn = http.client.HTTPConnection(self.host, timeout=CONNECT_TIMEOUT)
        with self._lock:
            if self._stop.is_set():  # stop() has already cut the connections it knew of
                raise _Transient("stopped")
            self._connections.add(conn)
        try:
            conn.connect()
            conn.sock.settimeout(read_timeout)
            conn.request("GET", path, headers={FLAVOR_HEADER: FLAVOR})
            response = conn.getresponse()
            body = response.read().decode("utf-8", "replace")
        except (OSError, http.client.HTTPException, ValueError) as e:
            # DNS failure, refused, unreachable, timeout, reset, garbage: without a server seen
            # before, this machine is not on GCE.
            raise (_Transient if self._seen_server.is_set() else _OffCloud)(f"{type(e).__name__}: {e}") from e
        finally:
            with self._lock:
                self._connections.discard(conn)
            conn.close()
        if response.getheader(FLAVOR_HEADER) != FLAVOR:
            # Something answers HTTP here (a proxy, a captive portal, another service), but it is
            # not a metadata server: the header is how google-auth tells them apart too.
            raise (_Transient if self._seen_server.is_set() else _OffCloud)(
                f"HTTP {response.status} without {FLAVOR_HEADER}: {FLAVOR}")
        self._seen_server.set()
        if response.status not in (200, 404):
            # 503 (server busy or restarting), 429, any other error: worth retrying.
            raise _Transient(f"HTTP {response.status}: {body[:200].strip()}")
        return _Response(response.status, body, response.getheader("ETag"))

    def _emit(self, notice: Notice) -> None:
        log.info("metadata notice", source=notice.source, kind=notice.kind, value=notice.value)
        with self._emit_lock:
            if self._stop.is_set():
                return
            try:
                self.on_notice(notice)
            except Exception:
                log.exception("metadata notice handler failed", source=notice.source, kind=notice.kind)

    def _set_state(self, name: str, state: str) -> None:
        with self._lock:
            self._states[name] = state

    def _off_cloud(self, name: str, error: Exception) -> None:
        self._set_state(name, "idle")
        with self._lock:
            first, self._logged_off_cloud = not self._logged_off_cloud, True
        if first:
            log.info(OFF_CLOUD_MESSAGE, host=self.host, reason=str(error))
        self._stop.wait(self.idle_retry_seconds)

    def _retry(self, name: str, key: str, backoff: _Backoff, error: Exception) -> None:
        if self._stop.is_set():
            return  # stop() cut the connection: not an error
        self._set_state(name, "retrying")
        delay = backoff.next_delay()
        if backoff.should_log():
            log.warning("metadata server request failed; retrying", key=key, error=str(error),
                        failures=backoff.failures, retry_in_seconds=round(delay, 2))
        self._stop.wait(delay)

    def _recovered(self, name: str, key: str, backoff: _Backoff) -> None:
        if backoff.failures:
            log.info("metadata server answers again", key=key, failures=backoff.failures)
        backoff.reset()
        self._set_state(name, "watching")


def _canonical_json(body: str) -> str:
    """Compare upcoming-maintenance announcements by content, not by formatting."""
    try:
        return json.dumps(json.loads(body), sort_keys=True)
    except ValueError:
        return body
