"""A job's view of its gang, when it spans several hosts (tpud/gang/): what status and metrics show.

The worker reports the gang as it forms (`gang` events: who is present, which generation);
the job passes the place to each worker it starts and counts restarts a peer caused apart
from its own crashes, which spend its restart budget.
"""

from __future__ import annotations

import structlog

from engine import events
from tpud.gang.discovery import GangPlace

log = structlog.get_logger()


class GangView:
    def __init__(self, place: GangPlace | None, job: str, metrics):
        self.place, self.job, self.metrics = place, job, metrics
        self.latest: events.Gang | None = None  # the current worker's latest report
        self.peer_restarts = 0

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
        self.metrics.gang(self.job, event.host, event.present, event.generation)
        before, self.latest = self.state, event
        if self.state != before:
            log.info("gang", job=self.job, state=self.state, host=event.host, hosts=event.hosts,
                     generation=event.generation)

    @property
    def state(self) -> str | None:
        """What status shows beside the job's state: `waiting for hosts (2 of 3)` or `formed`."""
        if self.place is None:
            return None
        g = self.latest
        if g is None:
            return "not joined"
        if g.generation < 0:
            return f"waiting for the coordinator {self.place.coordinator}"
        if g.members is not None and len(g.members) < g.hosts:
            left_out = sorted(set(range(g.hosts)) - set(g.members))
            return f"formed without host(s) {', '.join(map(str, left_out))} (quarantined or evicted)"
        if g.present < g.hosts and g.members is None:
            return f"waiting for hosts ({g.present} of {g.hosts})"
        return "formed"

    def snapshot(self) -> dict | None:
        if self.place is None:
            return None
        g = self.latest
        return {"host": self.place.host, "hosts": self.place.hosts, "state": self.state,
                "present": None if g is None else max(g.present, 0),
                "generation": None if g is None or g.generation < 0 else g.generation,
                "peer_restarts": self.peer_restarts}
