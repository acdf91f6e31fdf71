"""A job's checkpoints when it spans several hosts: the global commit and the restore agreement.

Each host writes its own part of a step into its own local tier with its own manifest (the
engine's state is replicated across hosts under data parallelism, so a part restores its
host by itself). The part counts as committed only once every host's part is durable: the
hosts exchange their outcome over a gloo group (one rank per host) and each writes
`global.json` into its part (engine.checkpoint.manifest). A host killed between its part and
the marker leaves a part that some peers marked and it did not; restore sees that through
the agreement below, so no step is lost to the order in which hosts die.

Restore takes the newest step that some host marked (so every part was durable) and whose
part every host holds now; the supervisor has by then brought a missing part from GCS.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

Key = tuple[int, int]  # (step, micro_step)


@dataclass(frozen=True)
class Hosts:
    """This worker's place among the job's hosts: one worker per host, its rank the host's index.
    The commit and the agreement run on the backend's checkpoint group (gloo, one rank per host)."""

    index: int
    count: int


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


def exchange(mine: Any, hosts: Hosts, group: Any) -> list[Any]:
    """Every host's `mine`, in host order (a collective on `group`, one rank per host)."""
    import torch.distributed as dist

    gathered: list[Any] = [None] * hosts.count
    dist.all_gather_object(gathered, mine, group=group)
    return gathered
