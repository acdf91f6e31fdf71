"""A gang job's board: every host's status, shared through the job's GCS prefix, for `tpud status --gang`.

Each host's daemon writes a small row of its own (state, step, the newest commit per tier,
restarts, health, when) to `<checkpoint.remote>/<job>/hosts/host_<N>.json` and reads the others'
rows from there, from a thread of its own: every EVERY_S it uploads its row when it changed (and
at least every HEARTBEAT_S) and lists the prefix, downloading only the rows whose generation
changed. So `tpud status --gang` answers from memory on any live host, however many hosts the
gang has and whichever are down, and the rows outlive the workers (a host in backoff, or
stopped, still says so). A row older than STALE_S is a host that stopped writing: its daemon
is gone. Who is missing from the gang itself comes faster from this host's worker, which
watches its peers' beats (the job's gang view, within the peer timeout); the board adds the rows.

A failing bucket changes nothing but the rows' age: the error is logged once, kept for status,
and the next round tries again. Torch-free: the daemon imports this.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable

import structlog

log = structlog.get_logger()

EVERY_S = 5.0
HEARTBEAT_S = 30.0
STALE_S = 3 * HEARTBEAT_S
REQUEST_TIMEOUT_S = 10.0


def row_of(snapshot: dict, now: float) -> dict:
    """What a host tells the others of its job: the status snapshot's few figures an operator scans."""
    checkpoints = snapshot.get("checkpoints") or {}
    warnings = snapshot.get("warnings") or []
    health = snapshot.get("error") or (warnings[0] if warnings else "ok")
    gang = snapshot.get("gang") or {}
    return {"state": snapshot.get("state"), "step": snapshot.get("step"), "max_steps": snapshot.get("max_steps"),
            "restarts": snapshot.get("restarts"), "health": str(health)[:200],
            "commits": {tier: (entry or {}).get("step") for tier, entry in checkpoints.items()},
            "generation": gang.get("generation"), "updated_unix": round(now, 3)}


class GangBoard:
    def __init__(self, remote: str, job: str, host: int, *, client: Callable[[], object] | None = None,
                 every_s: float = EVERY_S, wall: Callable[[], float] = time.time):
        from tpud.jobfiles.remote import split_url

        self.bucket_name, prefix = split_url(remote)
        self.prefix = f"{prefix}{job}/hosts/"
        self.job, self.host, self.every_s, self.wall = job, host, every_s, wall
        self._client_factory = client or _default_client
        self._bucket = None
        self._cond = threading.Condition()
        self._row: dict | None = None  # the newest row of this host, set by the daemon's loop
        self._sent: tuple[dict, float] | None = None  # the last row uploaded (without its time), when
        self._generations: dict[str, int] = {}
        self.rows: dict[int, dict] = {}  # host -> its newest row read back (this host's too)
        self.error: str | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=f"tpud-board-{job}", daemon=True)

    def start(self) -> GangBoard:
        self._thread.start()
        return self

    def stop(self, wait: bool = True) -> None:
        """No round starts after this; wait: for the one in flight (its requests are bounded)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if wait and self._thread.is_alive():
            self._thread.join(timeout=REQUEST_TIMEOUT_S)

    def update(self, row: dict) -> None:
        """From the daemon's loop: this host's newest row (uploaded by the board's thread)."""
        with self._cond:
            self._row = row

    def _run(self) -> None:
        while True:
            try:
                self._round()
                if self.error is not None:
                    log.info("gang board: reachable again", job=self.job)
                self.error = None
            except Exception as e:  # noqa: BLE001 - the bucket: the rows only age
                if self.error is None:
                    log.warning("gang board: cannot share this host's status", job=self.job, error=str(e)[:300])
                self.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
            with self._cond:
                if not self._stopping:
                    self._cond.wait(self.every_s)
                if self._stopping:
                    return

    def _round(self) -> None:
        if self._bucket is None:
            self._bucket = self._client_factory().bucket(self.bucket_name)
        with self._cond:
            row = self._row
        if row is not None:
            content = {k: v for k, v in row.items() if k != "updated_unix"}
            if self._sent is None or self._sent[0] != content or self.wall() - self._sent[1] >= HEARTBEAT_S:
                self._bucket.blob(f"{self.prefix}host_{self.host}.json").upload_from_string(
                    json.dumps(row), content_type="application/json", timeout=REQUEST_TIMEOUT_S, retry=None)
                self._sent = (content, self.wall())
        for blob in self._bucket.list_blobs(prefix=self.prefix, timeout=REQUEST_TIMEOUT_S, retry=None):
            name = blob.name[len(self.prefix):]
            if not (name.startswith("host_") and name.endswith(".json") and name[5:-5].isdigit()):
                continue
            if self._generations.get(name) != blob.generation:
                try:
                    self.rows[int(name[5:-5])] = json.loads(blob.download_as_bytes(timeout=REQUEST_TIMEOUT_S,
                                                                                  retry=None)[:1 << 16])
                except ValueError:
                    continue  # not a row (someone else's object): skipped, not retried
                self._generations[name] = blob.generation


class Boards:
    """The daemon's boards: one per gang job whose checkpoints have a GCS prefix, kept in line with
    its jobs and fed their rows from the loop (at most once a second)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.boards: dict[str, tuple[tuple[str, int], GangBoard]] = {}
        self._clock, self._last = clock, float("-inf")

    def get(self, job: str) -> GangBoard | None:
        entry = self.boards.get(job)
        return None if entry is None else entry[1]

    def tick(self, jobs) -> None:
        if self._clock() - self._last < 1.0:
            return
        self._last = self._clock()
        for job in jobs:
            place, remote = job.gang.place, job.spec.checkpoint.remote
            key = None if place is None or remote is None else (remote, place.host)
            entry = self.boards.get(job.name)
            if entry is not None and entry[0] != key:
                entry[1].stop(wait=False)
                del self.boards[job.name]
            if key is not None and job.name not in self.boards:
                self.boards[job.name] = (key, GangBoard(remote, job.name, place.host).start())
            if key is not None:
                self.boards[job.name][1].update(row_of(job.snapshot(), time.time()))

    def close(self) -> None:
        for _, board in self.boards.values():
            board.stop(wait=False)
        for _, board in self.boards.values():
            board.stop()


def gang_rows(snapshot: dict, board: GangBoard | None, now: float) -> dict:
    """`tpud status --gang`'s view of one job: a row per host, and who is missing and why."""
    gang = snapshot["gang"]
    hosts, here = gang["hosts"], gang["host"]
    lost = {m["host"]: m["since_unix"] for m in gang.get("missing") or []}
    shared = dict(board.rows) if board is not None else {}
    rows = []
    for host in range(hosts):
        row = dict(row_of(snapshot, now) if host == here else shared.get(host) or {})
        row["host"], row["here"] = host, host == here
        age = None if "updated_unix" not in row else max(0.0, now - row["updated_unix"])
        row["age_seconds"] = None if age is None else round(age, 1)
        if host in lost:
            row["missing"] = f"lost {now - lost[host]:.0f}s ago"
        elif host != here and board is None:
            row["missing"] = None  # nothing shared to judge by: the gang view alone
        elif host != here and age is None:
            row["missing"] = "never seen"
        elif host != here and age > STALE_S:
            row["missing"] = f"no word for {age:.0f}s"
        else:
            row["missing"] = None
        rows.append(row)
    return {"name": snapshot["name"], "host": here, "hosts": hosts, "generation": gang.get("generation"),
            "members": gang.get("members"), "shared": None if board is None else f"gs://{board.bucket_name}/"
            f"{board.prefix}", "board_error": None if board is None else board.error, "rows": rows,
            "missing": [r["host"] for r in rows if r["missing"]]}


def _default_client():
    from tpud.gcs.tier import make_client

    return make_client()
