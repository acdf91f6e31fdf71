"""Silent data corruption across data-parallel replicas (health.replicas).

Replicas hold bitwise the same parameters and optimizer state after every step. Every
`interval_steps` steps, and before every disk save, each replica computes a fingerprint of its
state, the wrapping 64-bit sum of every element's bit pattern (one flipped bit anywhere changes
it; summation order does not), and the replicas compare them (8 bytes each, all-gathered over
the training thread's gloo group). When they differ:

- with three replicas or more, the odd ones are those outside the majority: they exit 79
  (engine.exit_codes.QUARANTINED; the supervisor fails the job on that host, naming why) and
  the others exit 77 (GANG_RESTART): the gang starts again from the last state all agreed on,
  without the quarantined host where gang.min_hosts allows, else waiting for its replacement;
- with two (or no majority), no replica can be named: all exit 77 and start again from that
  state.

Before exiting, every replica sets aside its states newer than the last agreed step (a bad
replica's gradients reached every replica through the all-reduce), so no restore takes them; no
disk save happens without a comparison first. A `replica_mismatch` event says what was found.
"""

from __future__ import annotations

import collections
import dataclasses
import json
from pathlib import Path

import structlog
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from engine import events, exit_codes
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
    odd: list[int]           # the ranks outside the majority; empty when none is one

    def describe(self) -> str:
        who = f"ranks {self.odd} differ from the majority" if self.odd else "no majority among them"
        return f"the replicas' states differ after step {self.step} ({len(self.fingerprints)} replicas: {who})"


def odd_ones(prints: list[int]) -> list[int]:
    """The ranks whose fingerprint is not the majority's; [] when no value has a majority."""
    value, count = collections.Counter(prints).most_common(1)[0]
    if count * 2 <= len(prints):
        return []
    return [rank for rank, p in enumerate(prints) if p != value]


class ReplicaCheck:
    def __init__(self, cfg: ReplicaConfig | None, backend: Backend, model: nn.Module,
                 optimizer: torch.optim.Optimizer, job_dir: Path):
        self.cfg, self.backend, self.model, self.optimizer = cfg, backend, model, optimizer
        self.path = Path(job_dir) / "replicas.json"
        # Replicas: several processes that do not shard the state between them.
        replicated = backend.data.world > 1 and not getattr(backend, "sharded", True)
        # The training thread's own group (as backend.agree's): the checkpoint group also carries a
        # background save's collectives, and two threads' collectives on one group mix their messages.
        self.group = backend.agreement_group if cfg is not None and replicated else None
        self.agreed = 0  # the last step every replica held the same state at

    @property
    def enabled(self) -> bool:
        return self.group is not None

    def due(self, step: int) -> bool:
        return self.enabled and step % self.cfg.interval_steps == 0

    def compare(self, step: int) -> Mismatch | None:
        """Every replica's fingerprint of its state after `step` (a collective); None when they agree."""
        if not self.enabled:
            return None
        mine = torch.tensor([fingerprint(self.model, self.optimizer)], dtype=torch.int64)
        prints = [torch.zeros_like(mine) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(prints, mine, group=self.group)
        values = [int(p) for p in prints]
        if len(set(values)) == 1:
            self.agreed = step
            return None
        return Mismatch(step, values, odd_ones(values))

    def quarantine(self, mismatch: Mismatch, forget_after, emit) -> int:
        """Act on a mismatch: set aside the states after the last agreed step, say so, and the exit
        code (79 for an odd replica, else 77)."""
        forget_after(self.agreed)
        rank = self.backend.data.rank
        odd = rank in mismatch.odd
        event = events.ReplicaMismatch(step=mismatch.step, agreed_step=self.agreed, rank=rank, odd=mismatch.odd,
                                       fingerprints=[f"{p & (2**64 - 1):016x}" for p in mismatch.fingerprints],
                                       reason=mismatch.describe())
        atomic_write(self.path, json.dumps(dataclasses.asdict(event)))
        if odd:
            log.error(f"replica mismatch: this process's state differs from the majority's; quarantined "
                      f"({mismatch.describe()}; back to step {self.agreed})", **dataclasses.asdict(event))
        else:
            log.error("replica mismatch: starting again from the last state all replicas agreed on",
                      **dataclasses.asdict(event))
        emit(event)
        return exit_codes.QUARANTINED if odd else exit_codes.GANG_RESTART
