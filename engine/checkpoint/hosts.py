"""A job's checkpoints when it spans several hosts: the global commit and the restore agreement.

Each host writes its own part of a step into its own local tier with its own manifest (the
engine's state is replicated across hosts under data parallelism, so a part restores its
host by itself). The part counts as committed only once every host's part is durable: the
hosts exchange their outcome over a gloo group (one rank per host) and each writes
`global.json` into its part (engine.checkpoint.manifest). A host killed between its part and
the marker leaves a part that some peers marked and it did not; restore sees that through
the agreement below, so no step is lost to the order in which hosts die.

A host of several processes (device.processes_per_host) writes its part together, each process
its shards (one DCP checkpoint over the host's group); its processes agree on their outcome
before the exchange, which each runs with the processes of the other hosts that hold the same
shards, and its rank 0 writes the manifest and the marker.

Restore takes the newest step that some host marked (so every part was durable) and whose
part every host holds now; the supervisor has by then brought a missing part from GCS.

What each host held at the hosts' last exchange (every global commit and every gang start) is
kept in `<job>/hosts.json` on every host, for `tpud checkpoints` to show per step.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.checkpoint.errors import describe_error
from engine.checkpoint.manifest import read_small
from engine.layout import atomic_write

Key = tuple[int, int]  # (step, micro_step)


@dataclass(frozen=True)
class Hosts:
    """This worker's place among the job's hosts: `index` its host's rank in the gang. The commit
    and the agreement run on the backend's replica group (gloo, one process per host), a host of
    several processes agreeing first on its host group.
    `fence`, when given, says why this host may not write a global marker now (its gang moved on
    without it), or None. `source`: the rank that holds the gang's newest live state (a gang that
    changed while its survivors kept training), which the others take instead of a checkpoint;
    None: every host restores the newest global commit. `transfer`: some rank lacks that state,
    so the source sends it. `members`: the gang's hosts (their host numbers), which every commit
    records so that a host back blank knows whom the gang went on without."""

    index: int
    count: int
    members: tuple[int, ...] = ()
    fence: Callable[[], str | None] | None = field(default=None, compare=False, repr=False)
    source: int | None = None
    transfer: bool = False


@dataclass(frozen=True)
class Holdings:
    """What one host can restore from: its parts, and which of them it has marked global."""

    parts: frozenset[Key]
    marked: frozenset[Key]


def choose(holdings: list[Holdings], hosts_now: int, hosts_of: dict[Key, int]) -> tuple[Key | None, list[str]]:
    """The step every host restores, and why newer global steps were passed over.

    A partial-step checkpoint resumes only on the number of hosts that made it: the micro-
    batches of a step are laid out by the host count (`hosts_of` gives each part's).
    """
    marked = set().union(*(h.marked for h in holdings))
    common = frozenset.intersection(*(h.parts for h in holdings))
    passed: list[str] = []
    for key in sorted(marked, reverse=True):
        missing = [i for i, h in enumerate(holdings) if key not in h.parts]
        if missing:
            passed.append(f"step {key[0]}.{key[1]:04d}: host(s) {missing} lack their part")
        elif key[1] and hosts_of.get(key, hosts_now) != hosts_now:
            passed.append(f"step {key[0]}.{key[1]:04d}: a partial step made on {hosts_of[key]} hosts")
        elif key in common:
            return key, passed
    return None, passed


@dataclass(frozen=True)
class PeerSend:
    """A memory state one host sends the hosts that lack it before they all restore it."""

    key: Key
    source: int
    receivers: tuple[int, ...]


def peer_send(memories: list[frozenset[Key]], holdings: list[Holdings], on_disk: Key | None) -> PeerSend | None:
    """Which memory state hosts that lack it take from a peer (in host order; every host computes
    the same from the exchange), or None. Whole steps only: a partial step's accumulated gradients
    are its host's own micro-batches'.

    First, a global commit newer than the step the disks agree on (hosts went on without one that
    is back, behind or blank): the newest state that its holders with a memory tier all hold, as
    new as the commit or newer. Only a commit whose holders are a quorum of the hosts here (more
    than half, or half with the lowest): a gang that undid a commit by a rollback was a quorum and
    set it aside, so the hosts still holding it (away meanwhile) are not one. The price: a commit
    made by a gang that was a quorum only of an earlier, smaller gang (hosts 1 and 2 of 1-3, with
    host 0 gone before) is not sent when every host is back, and is passed over as before. Else,
    hosts whose memory tier is blank (a replaced VM) take the newest state every other host holds,
    newer than the disks' step."""
    def wanted(k: Key, floor: Key | None) -> bool:
        return k[1] == 0 and (on_disk is None or k > on_disk) and (floor is None or k >= floor)

    plans: list[tuple[Key | None, list[int]]] = []
    commits = [k for h in holdings for k in h.marked if on_disk is None or k > on_disk]
    if commits:
        commit = max(commits)
        holders = [i for i, h in enumerate(holdings) if commit in h.marked]
        if 2 * len(holders) > len(holdings) or (2 * len(holders) == len(holdings) and 0 in holders):
            plans.append((commit, [i for i in holders if memories[i]]))
    plans.append((None, [i for i, memory in enumerate(memories) if memory]))
    for floor, sources in plans:
        common = frozenset.intersection(*(memories[i] for i in sources)) if sources else frozenset()
        if found := sorted(k for k in common if wanted(k, floor)):
            key = found[-1]
            receivers = tuple(i for i, memory in enumerate(memories) if key not in memory)
            return PeerSend(key, sources[0], receivers) if receivers else None
    return None


HELD = "hosts.json"


def record_holdings(job_dir: Path, parts_by_host: list[Iterable[Key]]) -> None:
    """Write which parts every host held (host order), as the hosts just told each other."""
    atomic_write(job_dir / HELD, json.dumps({
        "hosts": len(parts_by_host), "recorded_unix": round(time.time(), 3),
        "parts": [sorted([step, micro] for step, micro in keys) for keys in parts_by_host]}))


def note_holdings(job_dir: Path, parts_by_host: list[Iterable[Key]]) -> None:
    """record_holdings, where a failure is only logged: the record only informs `tpud checkpoints`."""
    try:
        record_holdings(job_dir, parts_by_host)
    except OSError as e:
        import structlog  # only here: `tpud checkpoints` reads this module and starts without structlog

        structlog.get_logger().warning("could not record which host holds which part", path=str(job_dir),
                                       error=describe_error(e))


def holders(job_dir: Path) -> dict[Key, list[int]]:
    """Per step, the hosts that held their part at the last exchange; {} when never recorded
    (or the record is unreadable: it only informs)."""
    try:
        record = json.loads(read_small(job_dir / HELD))
        held: dict[Key, list[int]] = {}
        for host, keys in enumerate(record["parts"]):
            for step, micro in keys:
                held.setdefault((int(step), int(micro)), []).append(host)
        return held
    except (OSError, ValueError, TypeError, KeyError):
        return {}


def exchange(mine: Any, hosts: Hosts, group: Any) -> list[Any]:
    """Every host's `mine`, in host order (a collective on `group`, one rank per host: with several
    processes a host, each exchanges with the processes of the other hosts that hold its part)."""
    import torch.distributed as dist

    gathered: list[Any] = [None] * hosts.count
    dist.all_gather_object(gathered, mine, group=group)
    return gathered


def gather_host(mine: Any, group: Any) -> list[Any]:
    """Every process of this host's `mine` (a collective on `group`, the host's processes); [mine]
    when the host runs one."""
    if group is None:
        return [mine]
    import torch.distributed as dist

    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    return gathered


def from_host_rank_0(value: Any, group: Any) -> Any:
    """The host's rank 0's `value`, on every process of the host (`group`; itself when alone)."""
    if group is None:
        return value
    import torch.distributed as dist

    carried = [value]
    dist.broadcast_object_list(carried, src=dist.get_global_rank(group, 0), group=group)
    return carried[0]
