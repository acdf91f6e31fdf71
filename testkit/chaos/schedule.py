"""A campaign's faults, drawn from its seed: what strikes, where, when, for how long.

Two clocks. Most faults strike at a time (seconds from the campaign's start) and some last a
while; those the worker must meet at a step boundary (a bit flip, poisoned data, a transient
spike of one host) strike at a step and go into the job file's `debug.inject`, where tpud's own
fault injection fires them once per job. The same seed, duration and host count draw the same
schedule, so a run is replayed from its seed; a schedule written out (to_json) can be run as it
is, which is how the minimiser drops faults from it.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field

# Faults at a time. "seconds" is how long the fault lasts (0: an instant), or for host_loss and
# preemption how long the host stays away.
TIMED = {
    "worker_kill": "SIGKILL the host's worker",
    "daemon_kill": "SIGKILL the host's daemon (its worker and helpers die with it); it starts again, same disk",
    "host_loss": "SIGKILL everything on the host; it comes back later with a blank disk and memory, or never",
    "host_stop": "SIGSTOP every process of the host, SIGCONT later",
    "slow_host": "the host's worker runs at half speed (SIGSTOP/SIGCONT, 50 % duty)",
    "full_disk": "the host's state file system (a tmpfs) filled to the last byte, freed later",
    "gcs_down": "the GCS server stopped, started again later",
    "gcs_slow": "the GCS server frozen (SIGSTOP): requests hang until it thaws",
    "corrupt_checkpoint": "a file of a committed local checkpoint truncated or a byte of it flipped",
    "preemption": "the GCE preemption notice; the VM is deleted 30 s later and comes back blank",
    "maintenance": "a GCE maintenance event (live migration) for a few seconds",
    "job_edit": "the job file edited in place or replaced by a rename, on one host after another",
}
# Faults at a step (debug.inject): the host is the replica they strike.
STEPPED = {
    "bit_flip": "one bit of one parameter flipped on one host (silent data corruption)",
    "data_spike": "the step's micro-batches poisoned: a loss spike that comes back when replayed",
    "host_spike": "one host's loss of a step spiked once (a transient hardware fault)",
}
KINDS = {**TIMED, **STEPPED}
# How long a lasting fault lasts, in seconds, drawn uniformly.
LASTS = {"host_loss": (20, 90), "host_stop": (4, 25), "slow_host": (10, 40), "full_disk": (10, 40),
         "gcs_down": (10, 60), "gcs_slow": (5, 30), "preemption": (20, 90), "maintenance": (2, 8),
         "daemon_kill": (1, 10)}
# Stepped faults after spike detection's warm-up (health.spikes.warmup_steps, 100 by default).
FIRST_STEP = 120
NEVER_BACK = 0.15  # of host losses, the share whose host does not come back before the campaign ends


@dataclass(frozen=True)
class Fault:
    kind: str
    host: int
    at: float | None = None     # seconds from the start (timed faults)
    step: int | None = None     # the step it strikes at (stepped faults)
    seconds: float = 0.0        # how long it lasts
    detail: dict = field(default_factory=dict)  # kind-specific draws (which file, which bit, ...)

    def label(self) -> str:
        where = f"t={self.at:.0f}s" if self.at is not None else f"step {self.step}"
        lasts = f" for {self.seconds:.0f}s" if self.seconds else ""
        return f"{self.kind}@host{self.host} {where}{lasts}"


def draw(seed: int, duration_s: float, hosts: int, *, every_s: float, steps_per_s: float = 1.0,
         kinds: tuple[str, ...] = tuple(KINDS)) -> list[Fault]:
    """About one fault per `every_s` seconds, at uniform random times, overlapping as they fall;
    stepped faults at steps the run is expected to reach (`steps_per_s`). Each kind drawn at least
    once where the duration allows, so a short campaign still meets many."""
    rng = random.Random(seed)
    count = max(1, round(duration_s / every_s))
    chosen = [kinds[i % len(kinds)] for i in range(min(count, len(kinds)))]
    chosen += [rng.choice(kinds) for _ in range(count - len(chosen))]
    rng.shuffle(chosen)
    # Nothing in the first minute's start-up (the workers import, compile and form the gang) nor in
    # the last 10 % (the campaign then heals and finishes the job).
    first, last = min(60.0, duration_s * 0.2), duration_s * 0.9
    faults = [_fault(rng, kind, rng.randrange(hosts), rng.uniform(first, last), steps_per_s) for kind in chosen]
    return sorted(faults, key=lambda f: (f.at if f.at is not None else f.step / steps_per_s, f.kind))


def _fault(rng: random.Random, kind: str, host: int, at: float, steps_per_s: float) -> Fault:
    seconds = round(rng.uniform(*LASTS[kind]), 1) if kind in LASTS else 0.0
    detail: dict = {}
    if kind == "host_loss" and rng.random() < NEVER_BACK:
        detail["never_back"] = True
    elif kind == "corrupt_checkpoint":
        detail = {"how": rng.choice(["truncate", "flip"]), "pick": rng.random(), "offset": rng.random()}
    elif kind == "job_edit":
        detail = {"how": rng.choice(["in_place", "replace"])}
    elif kind == "bit_flip":
        detail = {"element": rng.randrange(1 << 16), "bit": rng.choice([20, 23, 26, 29, 30])}
    if kind in STEPPED:
        return Fault(kind, host, step=max(FIRST_STEP, round(at * steps_per_s)), detail=detail)
    return Fault(kind, host, at=round(at, 1), seconds=seconds, detail=detail)


def inject_section(faults: list[Fault]) -> dict:
    """The job file's debug.inject for the stepped faults."""
    stepped = [f for f in faults if f.kind in STEPPED]
    section: dict = {}
    if spikes := sorted({f.step for f in stepped if f.kind == "data_spike"}):
        section["spike_at_step"] = spikes
    if flips := [{"step": f.step, "rank": f.host, **f.detail} for f in stepped if f.kind == "bit_flip"]:
        section["bit_flips"] = flips
    if host_spikes := [{"step": f.step, "rank": f.host} for f in stepped if f.kind == "host_spike"]:
        section["host_spikes"] = host_spikes
    return section


def to_json(faults: list[Fault]) -> list[dict]:
    return [asdict(f) for f in faults]


def from_json(rows: list[dict]) -> list[Fault]:
    faults = []
    for i, row in enumerate(rows):
        if row.get("kind") not in KINDS:
            raise ValueError(f"schedule row {i}: unknown fault kind {row.get('kind')!r} (known: {', '.join(KINDS)})")
        faults.append(Fault(**{k: row[k] for k in ("kind", "host", "at", "step", "seconds", "detail") if k in row}))
    return faults


def load(path) -> list[Fault]:
    """A schedule written by a campaign (its results file, or the minimiser's output)."""
    data = json.loads(open(path).read())
    return from_json(data["schedule"] if isinstance(data, dict) else data)
