"""Taking a seat in the gang: how a worker meets the other hosts' workers and forms a gang with them.

It meets in the best coordinator that answers (tpud/worker/gang/stores.py), sits down in the
current generation and waits until every host is seated or excused (formation.py's rule); the
first worker to see it complete fixes the members. Then each compares every member's job spec,
and finds which member holds the newest live state. The keys under `tpud/<job>/` are listed in
member.py, whose GangMember holds one Seating for the worker's life: its connections, and the
generation it sits in, outlive a change of the gang in place.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import structlog

from engine import events
from engine.spec import fingerprint
from tpud.worker.gang import stores
from tpud.worker.gang.formation import Seats
from tpud.worker.gang.host import arrival_key

log = structlog.get_logger()

INTERVAL_S = 0.25   # between two looks at the seats, and two beats of a member's watcher
REPROBE_S = 2.0     # how often a waiting worker looks for a coordinator with a newer gang
REJOIN_S = 30.0     # how long a host whose worker said it restarts is waited for
CHECKED_S = 10.0    # how long a refusing worker waits for every member to have compared


def _newness(record: bytes) -> tuple[int, int]:
    """How new a `last` record is: its generation, then (a commit's gang) its step; a garbled one
    is older than any."""
    try:
        fields = json.loads(record)
        return int(fields["generation"]), int(fields.get("step", -1))
    except (ValueError, KeyError, TypeError):
        return -2, -1


class Seating:
    def __init__(self, job: str, host: int, hosts: int, min_hosts: int, addresses: list[str],
                 peer_timeout_s: float, emit: Callable[[events.Event], None], record: Path | None,
                 clock: Callable[[], float], per_host: int):
        """record: the job's gang.json (what this host knew, across restarts); per_host: the
        processes of each host (each publishes its own arrivals)."""
        self.host, self.hosts, self.min_hosts, self.addresses = host, hosts, min_hosts, addresses
        self.peer_timeout_s, self.emit, self.record, self.clock = peer_timeout_s, emit, record, clock
        self.per_host = per_host
        self.prefix = f"tpud/{job}/"
        self.store = None
        self._clients: dict[int, object] = {}  # a connection per coordinator, kept across generations
        self.at = 0  # the index of the host whose coordinator this worker meets in
        self.generation = -1
        self.members = list(range(hosts))  # this generation's, once formed
        self.source: int | None = None  # the rank holding the gang's newest live state (Hosts.source)
        self.transfer = False

    def key(self, name: str, generation: int | None = None) -> str:
        g = self.generation if generation is None else generation
        return f"{self.prefix}g{g}/{name}"

    def host_key(self, name: str, host: int) -> str:
        return f"{self.prefix}{name}/{host}"

    def connect(self, stop_asked: Callable[[], bool], committed: int = -1,
                committed_by: tuple[int, ...] = ()) -> bool:
        """Meet in the best coordinator that answers (tpud/worker/gang/stores.py), waiting while none does
        (every host's daemon may be down, or starting); False on a stop. Moving to another
        coordinator than the one the last gang met in opens a generation above it there, and marks
        the host whose coordinator vanished as lost. A coordinator learns the last gang from this
        host's record or, on a host back blank, from the gang that made its newest commit
        (`committed`, by `committed_by`): without one it knows of no gang, and waits for every host."""
        waited = self.clock()
        while (found := stores.best(self.addresses, self.prefix, clients=self._clients)) is None:
            self.emit(events.Gang(self.host, self.hosts, 0, -1))
            if stop_asked():
                return False
            if self.clock() - waited > 30:
                log.warning("no gang coordinator answers; waiting for one", coordinators=self.addresses)
                waited = self.clock()
            time.sleep(INTERVAL_S)
        self.store, self.at = found.store, found.index
        known = stores.Known.read(self.record)
        store = self.store
        if known.generation >= 0 and found.index != known.coordinator:
            if known.coordinator != self.host and known.coordinator in known.members:
                if stores.open_store(self.addresses[known.coordinator]) is None:
                    store.set(self.host_key("mark", known.coordinator), "lost: its coordinator vanished")
            log.warning("meeting in another host's coordinator", coordinator=self.addresses[found.index],
                        before=self.addresses[known.coordinator] if known.coordinator < len(self.addresses) else None)
        if known.generation >= 0:
            # Above the gang it knew, also in its own coordinator come back empty: a generation at
            # or below that gang's would take the gang before it for the last one.
            stores.raise_generation(store, self.prefix + "gen", known.generation + 1)
            self._remember(known.generation, known.members)
        elif committed >= 0:
            self._remember(-1, committed_by, committed)
        if store.add(self.prefix + "made", 1) == 1:  # the first worker here makes every host's keys:
            for h in range(self.hosts):              # one multi_get then reads them all
                store.add(self.host_key("alive", h), 0)
                store.compare_set(self.host_key("mark", h), "", "")
        return True

    def _remember(self, generation: int, members: tuple[int, ...], step: int = -1) -> None:
        """Tell the coordinator of a gang formed before (generation -1: the one that committed
        `step`) unless it knows a newer one, which may be that host's peers' news. Not a gang of
        hosts this job does not have (its host count changed since, or a manifest was edited): no
        majority of it could ever form."""
        if not members or not set(members) <= set(range(self.hosts)):
            return
        key, value = self.prefix + "last", json.dumps({"generation": generation, "members": list(members),
                                                       "step": step})
        while True:
            current = self.store.get(key) if self.store.check([key]) else b""
            if current and _newness(current) >= (generation, step):
                return
            if self.store.compare_set(key, current, value) == value.encode():
                return

    def _last(self, before: int | None = None) -> tuple[int, tuple[int, ...]]:
        """The newest gang formed (before generation `before`: a peer may have formed this one
        already, and its members are no guide to whom this one may go on without)."""
        try:
            if not self.store.check([self.prefix + "last"]):
                return -1, ()
            record = json.loads(self.store.get(self.prefix + "last"))
            if before is not None and int(record["generation"]) >= before:
                return int(record.get("previous", -1)), tuple(record.get("before", ()))
            return int(record["generation"]), tuple(record["members"])
        except (ValueError, KeyError, TypeError):
            return -1, ()

    def _seats(self, g: int, observed: dict[int, tuple[int, float]]) -> Seats:
        """One look at generation g: who is seated, and who is excused (formation.py)."""
        store = self.store
        roster = stores.seated_in(store, self.key("roster", g))
        alive = [int(v) for v in store.multi_get([self.host_key("alive", h) for h in range(self.hosts)])]
        marks = [v.decode() for v in store.multi_get([self.host_key("mark", h) for h in range(self.hosts)])]
        now, last = self.clock(), self._last(before=g)[1]
        lost = set()
        for h in range(self.hosts):
            before = observed.get(h)
            if before is None or before[0] != alive[h]:
                observed[h] = (alive[h], now)
            waited = now - observed[h][1]
            if marks[h].startswith("lost") or (last and h not in last):  # gone, or not in the gang before
                lost.add(h)
            elif h in last and waited > (REJOIN_S if marks[h] == "rejoin" else self.peer_timeout_s):
                lost.add(h)
        return Seats(self.hosts, self.min_hosts, frozenset(roster),
                     frozenset(h for h in range(self.hosts) if marks[h].startswith("out")),
                     frozenset(lost), last)

    def sit(self, spec: dict, holds: str, stop_asked: Callable[[], bool]) -> bool | None:
        """Take this host's seat in the current generation and wait for the others; False when the
        generation moved on meanwhile, or a coordinator with a newer gang turned up (try again),
        None when a stop was asked."""
        store, gen = self.store, self.prefix + "gen"
        g = int(store.add(gen, 0))
        if store.check([self.key("started", g)]):  # that gang formed and lost a worker: open the next one
            store.compare_set(gen, str(g), str(g + 1))
            return False
        self.generation = g
        store.set(self.key(f"spec/{self.host}"), fingerprint.canonical(spec))  # first: a seat vouches for it
        store.set(self.key(f"holds/{self.host}"), holds)
        # Before the seat: once the gang forms, every member's exist (its processes' arrivals each).
        for name in [f"beat/{self.host}", *(arrival_key(self.host, local) for local in range(self.per_host))]:
            store.add(self.key(name), 0)
        store.set(self.host_key("mark", self.host), "")  # this host is back
        store.append(self.key("roster"), f"{self.host},")
        reported, told, probed, observed = None, 0.0, self.clock(), {}
        while True:
            if store.check([self.key("members", g)]):  # a peer found it complete: join it, even if the
                return self._form([], ())              # next one opened meanwhile (it then changes in turn)
            if int(store.add(gen, 0)) != g:
                return False
            store.add(self.host_key("alive", self.host), 1)
            seats = self._seats(g, observed)
            present = len(seats.seated)
            if present != reported:
                log.info("waiting for hosts", present=present, hosts=self.hosts, waiting_for=seats.waiting_for(),
                         excused=sorted(seats.excused), generation=g, coordinator=self.addresses[self.at])
                if seats.short_of_quorum():
                    log.warning("the hosts here are no majority of the last gang: waiting for the others",
                                seated=sorted(seats.seated), last=list(seats.last))
            if present != reported or self.clock() - told >= 1.0:  # the daemon's status, and its hang watch
                self.emit(events.Gang(self.host, self.hosts, present, g, missing=seats.waiting_for(),
                                      coordinator=self.addresses[self.at]))
                reported, told = present, self.clock()
            if seats.complete():
                return self._form(sorted(seats.seated), seats.last)
            if stop_asked():
                store.append(self.key("roster"), f"-{self.host},")
                return None
            if len(self.addresses) > 1 and self.clock() - probed >= REPROBE_S:
                probed = self.clock()
                if self._better_elsewhere(g, present):
                    store.append(self.key("roster"), f"-{self.host},")
                    return False
            time.sleep(INTERVAL_S)

    def _better_elsewhere(self, g: int, seats: int) -> bool:
        """Whether another coordinator holds a newer gang than this one (this host was cut off)."""
        here = (g, seats, -self.at)
        down = {i for i, address in enumerate(self.addresses) if stores.down_lately(address)}
        found = stores.best(self.addresses, self.prefix, skip=frozenset({self.at, *down}), clients=self._clients)
        if found is None or found.rank <= here:
            return False
        log.warning("another coordinator holds a newer gang: moving there", coordinator=self.addresses[found.index],
                    generation=found.generation, here=g)
        return True

    def _form(self, seated: list[int], last: tuple[int, ...]) -> bool:
        """Fix the members (the first worker to get here writes them, so all agree), or False when
        this host took its seat after they were fixed: the next generation takes it."""
        store = self.store
        if store.add(self.key("forming"), 1) == 1:
            store.set(self.key("members"), json.dumps(seated))
        self.members = json.loads(store.get(self.key("members")))
        if self.host not in self.members:
            store.compare_set(self.prefix + "gen", str(self.generation), str(self.generation + 1))
            return False
        previous = self._last(before=self.generation)
        store.set(self.prefix + "last", json.dumps({"generation": self.generation, "members": self.members,
                                                    "previous": previous[0], "before": list(previous[1])}))
        store.set(self.key("started"), "1")
        stores.Known(self.generation, tuple(self.members), self.at).write(self.record)
        if last and tuple(self.members) != tuple(last):
            grew, shrank = sorted(set(self.members) - set(last)), sorted(set(last) - set(self.members))
            log.warning("the gang changed", members=self.members, joined=grew, left=shrank, generation=self.generation)
        return True

    def live_state(self) -> None:
        """Whether some member kept a live state (a gang changed in place) at least as new as every
        member's newest commit: the newest one, on the lowest such member, is what every member
        trains on (Hosts.source); else all restore the newest global commit. (A host that was
        paused holds an old live state: the others, restarted meanwhile, may have committed past it.)"""
        published = [v.decode().split(",") for v in self.store.multi_get([self.key(f"holds/{h}")
                                                                           for h in self.members])]
        holds, commits = [int(v[0]) for v in published], [int(v[1]) for v in published]
        newest = max(holds)
        self.source = holds.index(newest) if newest >= 0 and newest >= max(commits) else None
        self.transfer = self.source is not None and any(h != newest for h in holds)

    def same_spec(self) -> None:
        """Compare every member's fingerprint."""
        specs = self.store.multi_get([self.key(f"spec/{h}") for h in self.members])  # set before each seat
        found = {h: json.loads(spec) for h, spec in zip(self.members, specs)}
        self.store.append(self.key("checked"), f"{self.host},")
        fingerprint.check_hosts(found)

    def wait_checked(self) -> None:
        """Before a refusing worker exits: every member has compared, so none waits on a coordinator
        that goes away with this host (a `tpud run`'s); bounded, the others may be gone."""
        deadline = self.clock() + CHECKED_S
        try:
            while not set(self.members) <= stores.hosts_in(self.store, self.key("checked")) and self.clock() < deadline:
                time.sleep(INTERVAL_S / 5)
        except (RuntimeError, OSError):
            pass
