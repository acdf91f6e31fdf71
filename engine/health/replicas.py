"""Silent data corruption across data-parallel replicas (health.replicas).

Replicas hold bitwise the same parameters and optimizer state after every step. Every
`interval_steps` steps, and before every disk save, each replica computes a fingerprint of its
state, the wrapping 64-bit sum of every element's bit pattern (one flipped bit anywhere changes
it; summation order does not), and the replicas compare them (8 bytes each, all-gathered over
the training thread's gloo group). When they differ, every replica first sets aside its states
newer than the last agreed step (a bad replica's gradients reached every replica through the
all-reduce), so no restore takes them; no disk save happens without a comparison first. Then:

- with three replicas or more, the odd ones are those outside the majority: they exit 79
  (engine.exit_codes.QUARANTINED; the supervisor fails the job on that host, naming why) and
  the others exit 77 (GANG_RESTART): the gang starts again from the last state all agreed on,
  without the quarantined host where gang.min_hosts allows, else waiting for its replacement;
- with two (or no majority), the steps since the last agreed state are replayed in place, and
  each replica compares what it computes again with what it computed the first time, bitwise,
  step by step: its own forward's output (a print of the final norm's, taken by a forward hook:
  the bits of every token's hidden state, which a loss's rounding would hide) and its own loss,
  then the gradient norm after the all-reduce, and last its fingerprint. A fault shows first on
  the replica it struck: a flipped weight changes that replica's next output, and only then,
  through the all-reduce, the others' norm and weights; a flipped gradient changes its own
  weights a step before the others', so its next output, or at least its fingerprint. The
  replica whose values departed first is named and quarantined as above. With none named (all
  departed at once, or none did) and the replay agreeing, the fault was transient: training
  goes on in place from the replayed state; otherwise, or with no state to replay from, all
  exit 77.

A `replica_mismatch` event says what was found (`replicas.json` keeps the last one).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import struct
from pathlib import Path

import structlog
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from engine import events, exit_codes
from engine.errors import WorkerExit
from engine.backends.base import Backend
from engine.layout import atomic_write
from engine.spec.schema import ReplicaConfig

log = structlog.get_logger()

_AS_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def fingerprint(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """The wrapping int64 sum of the bit patterns of every parameter and optimizer state tensor
    this process holds."""
    total = torch.zeros((), dtype=torch.int64)
    tensors = [p for p in model.parameters()]
    tensors += [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    for tensor in tensors:
        local = (tensor.to_local() if isinstance(tensor, DTensor) else tensor).detach()
        bits = local.contiguous().view(_AS_INT[local.element_size()])
        total += bits.sum(dtype=torch.int64).cpu()
    return int(total)


@dataclasses.dataclass(frozen=True)
class Mismatch:
    step: int
    fingerprints: list[int]  # by rank
    odd: list[int]           # the ranks named: outside the majority, or the first to depart in a replay
    found_by: str = ""       # "majority", "replay", or "" when none is named
    spike: bool = False      # found by the healer: a spike its replay did not reproduce
    healed: bool = False     # none named, and the replay agreed: training went on in place
    replayed: bool = False   # the steps since the last agreed state were replayed
    replicas: int = 0        # copies of the state (0: one a rank); HSDP's hold theirs over several ranks

    def describe(self) -> str:
        if self.spike:
            return (f"step {self.step}'s loss spiked and its replay did not: ranks {self.odd} computed it differently "
                    "the first time (a hardware fault)")
        if self.found_by == "majority":
            who = f"ranks {self.odd} differ from the majority"
        elif self.found_by == "replay":
            who = f"ranks {self.odd} departed first from their own values when the steps were replayed"
        elif self.healed:
            who = "none could be named; replayed, they agree: a transient fault, healed in place"
        elif self.replayed:
            who = "no majority, and a replay named none"
        else:
            who = "no majority, and no replay (no state to replay from, or stopping)"
        return f"the replicas' states differ after step {self.step} ({self.replicas or len(self.fingerprints)} replicas: {who})"


def parts(prints: list[int], shard_of=lambda rank: 0) -> list[list[tuple[int, int]]]:
    """(rank, fingerprint) grouped by the part of the state the ranks hold (`shard_of`: with HSDP
    each host's processes hold its shards, and only the ranks holding the same shard are copies)."""
    grouped: dict[int, list[tuple[int, int]]] = {}
    for rank, p in enumerate(prints):
        grouped.setdefault(shard_of(rank), []).append((rank, p))
    return list(grouped.values())


def odd_ones(prints: list[int], shard_of=lambda rank: 0) -> list[int]:
    """The ranks whose fingerprint is not the majority's of their part; [] when a part that differs
    has no majority."""
    odd = []
    for part in parts(prints, shard_of):
        value, count = collections.Counter(p for _, p in part).most_common(1)[0]
        if count == len(part):
            continue
        if count * 2 <= len(part):
            return []
        odd += [rank for rank, p in part if p != value]
    return sorted(odd)


NEVER = 2**62  # a replica whose replayed values all matched its first ones
KEEP_STEPS = 256  # the step values kept before the last agreed step
# What a replay compares, in the order a step computes it: this replica's own forward output and
# loss (before the all-reduce), the gradient norm (after it), and after the last step the fingerprint.
PARTS = ("output", "loss", "gradient norm", "fingerprint")


def bits(value: float | int) -> int:
    """A step value as comparable bits: a float's bit pattern (so -0.0 is not 0.0), an int itself."""
    return struct.unpack("<q", struct.pack("<d", value))[0] if isinstance(value, float) else int(value)


def departure(step: int, before: list, again: list) -> int:
    """Where a replayed step's values ([output's print, loss, gradient norm]) first differ,
    bitwise, from the same step's first run, as an order key (step, then PARTS); NEVER when
    they are the same. A print that either run lacks (None: not whole) is not compared."""
    for part, (a, b) in enumerate(zip(before, again)):
        if a is not None and b is not None and bits(a) != bits(b):
            return step * len(PARTS) + part
    return NEVER


def where(keys: list[int]) -> list[str | None]:
    """Departure keys as words, for the log: `step 12 output`, or None where none departed."""
    return [None if k == NEVER else f"step {k // len(PARTS)} {PARTS[k % len(PARTS)]}" for k in keys]


def first_to_depart(keys: list[int]) -> list[int]:
    """The ranks whose values departed first; [] when none departed or all did at once."""
    earliest = min(keys)
    named = [rank for rank, key in enumerate(keys) if key == earliest]
    return named if earliest != NEVER and len(named) < len(keys) else []


class ReplicaCheck:
    def __init__(self, cfg: ReplicaConfig | None, backend: Backend, model: nn.Module,
                 optimizer: torch.optim.Optimizer, job_dir: Path):
        self.cfg, self.backend, self.model, self.optimizer = cfg, backend, model, optimizer
        self.path = Path(job_dir) / "replicas.json"
        # Replicas: copies of the state (DDP's processes, or HSDP's hosts, each a copy sharded over its own).
        replicated = backend.replicas > 1
        # The training thread's own group (as backend.agree's): the checkpoint group also carries a
        # background save's collectives, and two threads' collectives on one group mix their messages.
        self.group = backend.agreement_group if cfg is not None and replicated else None
        self.agreed = 0  # the last step every replica held the same state at
        # This replica's step values since then, unread: its StepResult values (loss before the
        # all-reduce, grad norm after it, ...) and its output's print. A replay compares against
        # them. Kept on the device; read only after a mismatch.
        self._trace: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self._summing: torch.Tensor | None = None  # this step's output print, micro-batch by micro-batch
        self.output_print: torch.Tensor | None = None  # the last step's; None when not all of it ran here
        self._partial = False  # the step under way began before this process's state (a partial-step restore)
        self._replayed: tuple[torch.Tensor, torch.Tensor | None] | None = None  # the last replayed step's
        self._hook = model.norm.register_forward_hook(self._print_output) if self.enabled else None

    @property
    def enabled(self) -> bool:
        return self.group is not None

    def close(self) -> None:
        """Take the forward hook off the model (a gang changing in place keeps the model)."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def due(self, step: int) -> bool:
        return self.enabled and step % self.cfg.interval_steps == 0

    def _print_output(self, module, args, output: torch.Tensor) -> None:
        """The final norm's output, of a training forward (not an evaluation's, without gradients)."""
        if torch.is_grad_enabled():
            output = output.detach()
            summed = output.contiguous().view(_AS_INT[output.element_size()]).sum(dtype=torch.int64)
            self._summing = summed if self._summing is None else self._summing + summed

    def step_done(self) -> None:
        """Every optimizer step (the loop's, and every replay's): its output's print is complete,
        unless some of the step's micro-batches ran before a partial-step state was restored."""
        self.output_print = None if self._partial else self._summing
        self._summing, self._partial = None, False

    def record(self, step: int, values: torch.Tensor) -> None:
        """A step the loop trained: its values, as this replica computed them."""
        if self.enabled:
            self._trace[step] = (values, self.output_print)

    def replayed(self, step: int, values: torch.Tensor) -> None:
        """A step a replay trained (the healer's, or a replica check's): from now on its values are
        those a later replay compares with (the callers kept the first run's they need)."""
        self._replayed = (values, self.output_print)
        self.record(step, values)

    def recorded(self, step: int) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        return self._trace.get(step)

    @staticmethod
    def _read(recorded: tuple[torch.Tensor, torch.Tensor | None]) -> list:
        """A recorded step's [output's print (None: not whole), loss, gradient norm]."""
        values, output_print = recorded
        return [None if output_print is None else int(output_print), values[0].item(), values[1].item()]

    def name_after_spike(self, step: int, first) -> Mismatch | None:
        """The healer's replay of a spiked `step` did not reproduce it (its verdict: the hardware).
        Every replica (a collective; all reach the same verdict) compares its first run of the
        step (`first`, as recorded() gave it before the rewind) with the replay's: the ones whose
        own values departed are named, as in replay()."""
        if not self.enabled:
            return None
        departed = NEVER if first is None else departure(step, self._read(first), self._read(self._replayed))
        keys = self._gather(departed)
        log.info("spike replayed", step=step,
                 departed=where(keys))
        named = first_to_depart(keys)
        return Mismatch(step, [], named, "replay", spike=True, replayed=True) if named else None

    def _values(self, values: list[float]) -> list:
        """[output's print (None: not whole), loss, gradient norm] of the last step."""
        return [None if self.output_print is None else int(self.output_print), values[0], values[1]]

    def restored(self, progress) -> None:
        """The loop's state was restored (at start-up, or a rewind to an earlier one); a partial
        step's print cannot be whole. The later steps' values stay until they are trained again
        (a replay compares only steps trained since its state)."""
        self.agreed = min(self.agreed, progress.step)
        self._summing, self._partial = None, progress.micro_step > 0

    def _gather(self, value: int) -> list[int]:
        mine = torch.tensor([value], dtype=torch.int64)
        everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(everyone, mine, group=self.group)
        return [int(v) for v in everyone]

    def compare(self, step: int) -> Mismatch | None:
        """Every replica's fingerprint of its state after `step` (a collective); None when they agree."""
        if not self.enabled:
            return None
        values = self._gather(fingerprint(self.model, self.optimizer))
        if all(len({p for _, p in part}) == 1 for part in parts(values, self.backend.shard_of)):
            self.agreed = step
            # Kept a while after: the guard finds a spike at its next report, which may come later.
            self._trace = {s: v for s, v in self._trace.items() if s > step - KEEP_STEPS}
            return None
        odd = odd_ones(values, self.backend.shard_of)
        return Mismatch(step, values, odd, "majority" if odd else "", replicas=self.backend.replicas)

    def replay(self, mismatch: Mismatch, loop) -> Mismatch:
        """No majority: replay the steps since the last agreed state in place (`loop`: the
        engine.health.healing.Rewindable) and name the replicas whose values departed first.
        Every replica calls it alike (collectives). With none named and the replay agreeing,
        the mismatch comes back healed and the loop stands at its step again."""
        agreed = self.agreed
        first = {s: self._read(recorded) for s, recorded in self._trace.items()}
        mine = fingerprint(self.model, self.optimizer)
        if loop.rewind(agreed) is None:
            log.warning("no state of the last agreed step or before to replay from", agreed_step=agreed)
            return mismatch
        departed = NEVER
        while loop.progress.step < mismatch.step:
            again = self._values(loop.replay_step(local=True))
            if departed == NEVER and loop.progress.step in first:
                departed = departure(loop.progress.step, first[loop.progress.step], again)
        if departed == NEVER and fingerprint(self.model, self.optimizer) != mine:
            departed = mismatch.step * len(PARTS) + PARTS.index("fingerprint")
        keys = self._gather(departed)
        log.info("replicas replayed", from_step=agreed, to_step=mismatch.step,
                 departed=where(keys))
        named = first_to_depart(keys)
        still = self.compare(mismatch.step)
        self.agreed = agreed  # what the event reports; once healed, settle() moves it on
        if named:
            return dataclasses.replace(mismatch, odd=named, found_by="replay", replayed=True)
        return dataclasses.replace(mismatch, healed=still is None, replayed=True)

    def settle(self, mismatch: Mismatch, emit) -> None:
        """Say what was found; returns when healed in place, else raises WorkerExit (79 for a named
        replica, else 77)."""
        rank = self.backend.data.rank
        # A host's processes (consecutive ranks of a gang) are quarantined together.
        odd = self.backend.host_of(rank) in {self.backend.host_of(r) for r in mismatch.odd}
        event = events.ReplicaMismatch(step=mismatch.step, agreed_step=self.agreed, rank=rank, odd=mismatch.odd,
                                       fingerprints=[f"{p & (2**64 - 1):016x}" for p in mismatch.fingerprints],
                                       reason=mismatch.describe(), found_by=mismatch.found_by,
                                       healed=mismatch.healed)
        try:
            atomic_write(self.path, json.dumps(dataclasses.asdict(event)))
        except OSError as e:  # a full disk must not turn a quarantine (79) or restart (77) into a crash
            log.warning("could not record the replica mismatch", path=str(self.path), error=str(e))
        if mismatch.healed:
            log.warning("replica mismatch healed in place: " + mismatch.describe(), **dataclasses.asdict(event))
            emit(event)
            self.agreed = mismatch.step
            return
        if odd:
            log.error(f"replica mismatch: this process's state is the odd one; quarantined "
                      f"({mismatch.describe()}; back to step {self.agreed})", **dataclasses.asdict(event))
        else:
            log.error("replica mismatch: starting again from the last state all replicas agreed on",
                      **dataclasses.asdict(event))
        emit(event)
        raise WorkerExit(exit_codes.QUARANTINED if odd else exit_codes.GANG_RESTART)
