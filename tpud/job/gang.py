"""A job's view of its gang, when it spans several hosts (tpud/gang/): what status and metrics show.

The worker reports the gang as it forms (`gang` events: who is present, which generation, the
members once formed, whom it waits for, the coordinator); the job passes the place to each
worker it starts and counts restarts a peer caused apart from its own crashes, which spend its
restart budget. From the members of successive gangs it counts shrinks and grows and keeps
since when each missing host has been missing; `path` says how this host's worker came to its
gang: in_place (it kept its process through the change) or restart (a new worker).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import structlog

from engine import events
from tpud.gang.discovery import GangPlace

log = structlog.get_logger()


class GangView:
    def __init__(self, place: GangPlace | None, job: str, metrics, wall: Callable[[], float] = time.time):
        self.place, self.job, self.metrics, self.wall = place, job, metrics, wall
        self.latest: events.Gang | None = None  # the current worker's latest report
        self.peer_restarts = 0
        self.members: list[int] | None = None  # the newest gang formed
        self.missing_since: dict[int, float] = {}  # host -> unix time it was first missing
        self.shrinks = self.grows = 0

    def worker_env(self) -> dict[str, str]:
        if self.place is None:
            return {}
        return {**self.place.worker_env(), "RANK": str(self.place.host), "WORLD_SIZE": str(self.place.hosts),
                "LOCAL_RANK": "0"}

    def uploads(self) -> bool:
        """Whether this host uploads the job's steps to GCS now. One host of a gang does (every
        host's part holds the whole state): its first member, host 0 unless the gang formed
        without it (gang.min_hosts, host 0 quarantined or evicted), so the run stays durable."""
        if self.place is None:
            return True
        members = self.latest.members if self.latest is not None and self.latest.members else [0]
        return self.place.host == min(members)

    def new_worker(self) -> None:
        self.latest = None

    def on_gang(self, event: events.Gang) -> None:
        if event.members is not None:
            if self.members is not None and set(event.members) != set(self.members):
                shrank, grew = bool(set(self.members) - set(event.members)), bool(set(event.members) - set(self.members))
                self.shrinks, self.grows = self.shrinks + shrank, self.grows + grew
                self.metrics.gang_changed(self.job, event.host, shrank, grew)
                log.warning("the gang changed", job=self.job, members=event.members, before=self.members,
                            generation=event.generation, path=event.path)
            self.members = list(event.members)
        missing = set(self.missing(event))
        now = self.wall()
        self.missing_since = {h: self.missing_since.get(h, now) for h in sorted(missing)}
        self.metrics.gang(self.job, event.host, event.present, event.generation, members=self._members(event),
                          missing=len(missing))
        before, self.latest = self.state, event
        if self.state != before:
            log.info("gang", job=self.job, state=self.state, host=event.host, hosts=event.hosts,
                     generation=event.generation)

    def missing(self, event: events.Gang) -> list[int]:
        """The hosts the gang is without: left out of the members once formed, else those it waits for."""
        if event.members is not None:
            return sorted(set(range(event.hosts)) - set(event.members))
        if event.missing is not None:
            return list(event.missing)
        return [] if event.generation < 0 else sorted(set(range(event.hosts)) - set(self.members or range(event.hosts)))

    def _members(self, event: events.Gang) -> int:
        return len(event.members) if event.members is not None else len(self.members or ())

    @property
    def state(self) -> str | None:
        """What status shows beside the job's state: `waiting for hosts (2 of 3)` or `formed`."""
        if self.place is None:
            return None
        g = self.latest
        if g is None:
            return "not joined"
        if g.generation < 0:
            return f"no gang coordinator answers ({', '.join(self.place.addresses)}): waiting for one"
        if g.members is not None and len(g.members) < g.hosts:
            left_out = sorted(set(range(g.hosts)) - set(g.members))
            return f"formed without host(s) {', '.join(map(str, left_out))} (lost, stopped, quarantined or evicted)"
        if g.present < g.hosts and g.members is None:
            waiting = f": waiting for host(s) {', '.join(map(str, g.missing))}" if g.missing else ""
            least = self.place.min_hosts or g.hosts
            if g.present < least < g.hosts:
                waiting += f" (it goes on with at least {least}: gang.min_hosts)"
            return f"waiting for hosts ({g.present} of {g.hosts}){waiting}"
        return "formed"

    def snapshot(self) -> dict | None:
        if self.place is None:
            return None
        g = self.latest
        return {"host": self.place.host, "hosts": self.place.hosts, "state": self.state,
                "present": None if g is None else max(g.present, 0),
                "generation": None if g is None or g.generation < 0 else g.generation,
                "peer_restarts": self.peer_restarts, "members": self.members,
                "missing": [{"host": h, "since_unix": round(t, 3)} for h, t in self.missing_since.items()],
                "coordinator": None if g is None else g.coordinator, "shrinks": self.shrinks, "grows": self.grows,
                "path": None if g is None else g.path}
