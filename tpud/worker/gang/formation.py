"""When a gang may form without some of its hosts: the rule every worker applies alike (torch-free).

A generation forms once every host is seated or excused. Excused are, only with `min_hosts`
below the host count: hosts left out (quarantined or evicted: `out`), hosts another worker
judged lost (`lost`: its beat stood still, or its coordinator vanished), hosts that were no
members of the last gang (a gang that shrank goes on without them; one that comes back grows
it), and members of the last gang whose liveness counter this worker saw stand still for the
peer timeout (a host that was stopped or preempted, or vanished while no worker was watching),
unless that host said it is restarting (`rejoin`) and has not been gone for long.

Shrinking is safe only for a majority: the seated hosts must be more than half of the last
gang's members, or exactly half with its lowest host among them. Two groups of one gang (a
network split, a paused host coming back with an old view) can then never both go on, since
they cannot both hold a majority of the same gang. A gang of two can thus lose host 1 and go
on, but not host 0; from three hosts on, any one host (host 0 included) can be lost.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass


def quorum(seated: Collection[int], last: Collection[int]) -> bool:
    """Whether `seated` may go on as the successor of the gang `last` (empty: none formed yet)."""
    if not last:
        return True
    kept = set(seated) & set(last)
    return 2 * len(kept) > len(last) or (2 * len(kept) == len(last) and min(last) in kept)


@dataclass(frozen=True)
class Seats:
    """What one look at the store found for a generation."""

    hosts: int
    min_hosts: int
    seated: frozenset[int]
    out: frozenset[int] = frozenset()       # quarantined or evicted (exit 79)
    lost: frozenset[int] = frozenset()      # judged lost by a worker, or unseen for the peer timeout
    last: tuple[int, ...] = ()              # the members of the newest gang formed before

    @property
    def shrinking(self) -> bool:
        return self.min_hosts < self.hosts

    @property
    def excused(self) -> frozenset[int]:
        if not self.shrinking:
            return frozenset()
        return (self.out | self.lost) - self.seated

    def complete(self) -> bool:
        """Every host seated or excused, at least min_hosts seated, and a majority of the last gang."""
        if len(self.seated) < self.min_hosts:
            return False
        if (self.seated | self.excused) != frozenset(range(self.hosts)):
            return False
        return self.seated == frozenset(range(self.hosts)) or quorum(self.seated, self.last)

    def waiting_for(self) -> list[int]:
        """The hosts the gang waits for: neither seated nor excused."""
        return sorted(set(range(self.hosts)) - self.seated - self.excused)

    def short_of_quorum(self) -> bool:
        """Every host seated or excused, enough of them, but not a majority of the last gang: the
        others may be going on elsewhere (this host is the one cut off), so it must wait."""
        return (len(self.seated) >= self.min_hosts and (self.seated | self.excused) == frozenset(range(self.hosts))
                and not self.complete())
