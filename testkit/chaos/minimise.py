"""Delta debugging over a schedule: drop faults while the violation still occurs.

Each try is a campaign on the same seed with fewer faults (bench/chaos.py's shrink says how
long); the violation "still occurs" when the campaign violates the same invariant. ddmin's complement
steps (Zeller): split the schedule into n parts, keep any complement that still fails (then
n - 1 parts), else split finer, until single faults are tried.
"""

from __future__ import annotations

from collections.abc import Callable

from testkit.chaos.schedule import Fault


def minimise(faults: list[Fault], fails: Callable[[list[Fault]], bool], say=print) -> list[Fault]:
    """The smallest schedule found for which fails(schedule) holds; `faults` itself must fail."""
    n = 2
    while len(faults) >= 2:
        size = -(-len(faults) // n)
        for start in range(0, len(faults), size):
            part, rest = faults[start:start + size], faults[:start] + faults[start + size:]
            say(f"minimise: trying {len(rest)} of {len(faults)} faults (without {', '.join(f.label() for f in part)})")
            if fails(rest):
                faults, n = rest, max(n - 1, 2)
                say(f"minimise: still fails with {len(faults)}")
                break
        else:
            if n >= len(faults):
                break
            n = min(len(faults), 2 * n)
    return faults
