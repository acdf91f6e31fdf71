"""Which coordinator a worker meets the others in, when every host runs one.

Each host's daemon may run a coordinator (torch.distributed's TCPStore) at its own address
(gang.coordinators). A worker reads every reachable one's generation for the job and meets in
the one holding the newest generation, the most seats in it breaking a tie, then the lowest
host: while host 0's lives, that is host 0's; once it is gone the survivors move to the next
lowest live host's, opening there a generation above the newest they knew (kept in the job's
`gang.json` across worker restarts), so a coordinator that comes back empty, or a host that
was paused with an old view, never outranks the one the gang went on in.
"""

from __future__ import annotations

import datetime
import json
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from engine.checkpoint.manifest import read_small
from engine.layout import atomic_write

CONNECT_TIMEOUT_S = 2.0
# Every store call's bound: a coordinator that stopped answering (a paused VM) fails a call after
# this long, and the worker looks for another one.
STORE_TIMEOUT_S = 10.0


def split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


@dataclass
class Candidate:
    index: int          # the host whose coordinator it is
    address: str
    store: object       # a TCPStore client
    generation: int
    seats: int          # seats taken in that generation

    @property
    def rank(self) -> tuple[int, int, int]:
        return self.generation, self.seats, -self.index


# Addresses where nothing answered at the last try, with when. A waiting worker's look for a
# better coordinator skips them (a look at a silent one costs seconds) but only for a while: a
# connect that timed out on a loaded host is no lasting verdict, and a worker that never looked
# again would wait alone in the next host's coordinator while the gang met in the one it skipped.
DOWN: dict[str, float] = {}
RETRY_DOWN_S = 15.0


def down_lately(address: str) -> bool:
    """Whether nothing answered at `address` within the last RETRY_DOWN_S."""
    return time.monotonic() - DOWN.get(address, float("-inf")) < RETRY_DOWN_S


def open_store(address: str, timeout_s: float = CONNECT_TIMEOUT_S):
    """A TCPStore client, or None when nothing answers there.

    A plain TCP probe first: TCPStore's client retries a refused connection until its timeout,
    logging a C++ stack trace each time, where the probe is refused at once. The probe stays open
    until the store has connected: closed first, the store's server would hold the store's
    handshake behind it for half a second.
    """
    import torch.distributed as dist

    host, port = split(address)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            store = dist.TCPStore(host, port, is_master=False, use_libuv=True,
                                  timeout=datetime.timedelta(seconds=timeout_s))
    except (RuntimeError, OSError):  # torch's DistNetworkError is a RuntimeError
        DOWN[address] = time.monotonic()
        return None
    DOWN.pop(address, None)
    return store


def look(index: int, address: str, prefix: str, client=None) -> Candidate | None:
    """One coordinator as a candidate: its generation for the job and the seats taken in it.
    `client`: a connection to it kept from before (a new one costs a quarter of a second)."""
    try:
        if client is not None:
            return _candidate(index, address, prefix, client)
    except (RuntimeError, OSError):
        pass
    store = open_store(address)
    if store is None:
        return None
    try:
        store.set_timeout(datetime.timedelta(seconds=STORE_TIMEOUT_S))
        return _candidate(index, address, prefix, store)
    except (RuntimeError, OSError):
        return None


def _candidate(index: int, address: str, prefix: str, store) -> Candidate:
    generation = int(store.add(prefix + "gen", 0))
    seats = len(seated_in(store, f"{prefix}g{generation}/roster"))
    return Candidate(index, address, store, generation, seats)


def best(addresses: list[str] | tuple[str, ...], prefix: str, skip: frozenset[int] = frozenset(),
         clients: dict[int, object] | None = None) -> Candidate | None:
    """The coordinator to meet in among those that answer (module docstring); None when none does.
    `clients`: connections kept by coordinator index, reused and updated."""
    clients = {} if clients is None else clients
    found = []
    for i, address in enumerate(addresses):
        if i in skip:
            continue
        if (candidate := look(i, address, prefix, clients.get(i))) is None:
            clients.pop(i, None)
        else:
            clients[i] = candidate.store
            found.append(candidate)
    return max(found, key=lambda c: c.rank, default=None)


def hosts_in(store, key: str) -> set[int]:
    """The hosts appended to a list key ("0,2,"); empty when it does not exist."""
    if not store.check([key]):
        return set()
    return {int(h) for h in store.get(key).decode().split(",") if h}


def seated_in(store, key: str) -> set[int]:
    """The hosts a roster key seats, read in order: "H," takes host H's seat, "-H," gives it up (a stop
    asked while waiting). A host that gave its seat up and takes it again in the same generation (its
    worker stopped for a new job file, then started with it) is seated: a set of seats taken less a
    set of seats given up would leave it out for good, and every host waiting for it."""
    if not store.check([key]):
        return set()
    seated: set[int] = set()
    for entry in store.get(key).decode().split(","):
        if entry.startswith("-"):
            seated.discard(int(entry[1:]))
        elif entry:
            seated.add(int(entry))
    return seated


def raise_generation(store, key: str, at_least: int) -> int:
    """Move the counter `key` up to `at_least` (never down); its value after."""
    while (current := int(store.add(key, 0))) < at_least:
        store.compare_set(key, str(current), str(at_least))
    return current


@dataclass(frozen=True)
class Known:
    """What this host's workers knew of the gang: the newest generation formed, its members, and
    the coordinator it met in (the job's gang.json, written at every formation)."""

    generation: int = -1
    members: tuple[int, ...] = ()
    coordinator: int = 0

    @classmethod
    def read(cls, path: Path | None) -> Known:
        try:
            record = json.loads(read_small(path, 1 << 20)) if path is not None else {}  # a FIFO there never blocks
            return cls(int(record["generation"]), tuple(int(h) for h in record["members"]),
                       int(record.get("coordinator", 0)))
        except (OSError, ValueError, KeyError, TypeError):
            return cls()

    def write(self, path: Path | None) -> None:
        if path is None:
            return
        try:
            atomic_write(path, json.dumps({"generation": self.generation, "members": list(self.members),
                                           "coordinator": self.coordinator}))
        except OSError:  # only speeds up a failover; the gang forms without it too
            pass
