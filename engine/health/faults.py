"""Injected faults (job spec `debug.inject`) for tests and drills of the supervisor.

Each looks like the real thing from outside the worker:

- hang_at_step N: right after step N completes the training thread stops for good: no more
  heartbeats, polls or checkpoints, and SIGTERM does not help (SignalHooks only records it;
  the loop never reaches another boundary to act on it). Only SIGKILL ends it.
- crash_at_step N: right after step N, an exception leaves the loop (exit 1, traceback).
- nan_at_step N: the micro-batches the data stream assigns to step N (counted without any
  skips) give a NaN loss, and so NaN gradients and weights. Keyed on the data, not the step:
  after a rollback that skips those batches, step N trains on the next ones and is finite.
- spike_at_step N: the same micro-batches' loss is multiplied by SPIKE (and so their gradients):
  a loss spike that comes back when the step is replayed, as bad data's does.
- bit_flips [{step, rank, tensor, element, bit, gradient}]: right after `step`, the process of
  that rank (with several hosts, the host) flips one bit of one element of one parameter (with
  `gradient`, of its gradient of step `step`, after the all-reduce and before the update): silent
  data corruption, which the replicas' fingerprints find (engine.health.replicas). A flip is
  transient: a replay of its step in the same worker does not meet it again.
- host_spikes [{step, rank}]: that process's loss of that step is multiplied by SPIKE, once:
  a transient hardware fault. Its replay does not meet it, so the healer's verdict is the
  hardware's, and with replicas the replay names that process (engine.health.replicas).
- slow_host {rank, factor, from_step}: that process's forward and backward passes take factor x
  as long (it sleeps the difference) from that step on, every run: a straggler
  (engine.health.stragglers).

Transient faults fire once per job: a marker file `<state>/jobs/<job>/faults/<kind>-<step>`
is made durable before the fault fires, and a worker started after it exists does not fire
that fault again. With `repeat` every run fires it (a deterministic fault). The markers are
read once, at start-up, so that all ranks sharing a state directory decide alike however
their timing differs. Step 0 of hang and crash means before the first step of a fresh run.

address_space_mib N is no fault that fires but a limit: every worker caps its own address space
(RLIMIT_AS) at its size at start plus N MiB, so a micro-batch too large fails a real allocation
(engine.fitting's tests).

A job without `debug.inject` gets `NoFaults`, which never fires: the loop asks either alike.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import structlog

from engine.spec.schema import InjectConfig
from engine.data.loader import AccumSchedule
from engine.layout import atomic_write

log = structlog.get_logger()

HANG, CRASH, NAN, SPIKE_KIND = "hang", "crash", "nan", "spike"
FLIP, GRAD_FLIP, HOST_SPIKE = "flip", "gradflip", "hostspike"
SPIKE = 10.0  # what spike_at_step multiplies the loss by


def limit_address_space(extra_mib: int) -> None:
    """Cap this process's address space at its size now plus `extra_mib` (debug.inject.address_space_mib)."""
    import resource

    with open("/proc/self/statm") as f:
        now = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    limit = now + (extra_mib << 20) if hard == resource.RLIM_INFINITY else min(now + (extra_mib << 20), hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    log.info("address space limited (debug.inject.address_space_mib)", bytes=limit)


class NoFaults:
    """No faults injected (a job without debug.inject)."""

    def poison(self, index: int) -> float:
        return 1.0

    def at_step_boundary(self, step: int, model=None, rank: int = 0) -> None:
        pass

    def slow_down(self, step: int, rank: int, seconds: float) -> None:
        pass

    def glitch(self, step: int, rank: int) -> float:
        return 1.0

    def before_update(self, step: int, model, rank: int) -> None:
        pass


class Faults:
    def __init__(self, cfg: InjectConfig, job_dir: Path, accum: AccumSchedule, host: int | None = None):
        """host: this host's index in a gang (engine.runtime)."""
        self.cfg = cfg
        # In a gang a fault names a host, whatever its rank (a gang without some hosts renumbers them).
        self.host = host
        self.dir = Path(job_dir) / "faults"
        self._fired_before = {p.name for p in self.dir.iterdir()} if self.dir.is_dir() else set()
        self._fired_now: set[str] = set()
        # Global micro-batch index (unskipped stream) -> (the fault, the logged step it poisons).
        self._poisoned = {i: (kind, n) for kind, steps in ((NAN, cfg.nan_at_step), (SPIKE_KIND, cfg.spike_at_step))
                          for n in steps if n >= 1
                          for i in range(accum.before(n - 1), accum.before(n - 1) + accum.at(n - 1))}

    def _fire(self, kind: str, step: int) -> bool:
        """Whether the fault fires in this process; records it durably before it does."""
        name = f"{kind}-{step}"
        if name in self._fired_now:
            # Poisoned data stays poisoned: the step's other micro-batches, and a replay of it. A
            # flipped bit is a transient fault: a replay of its step does not meet it again.
            return kind in (NAN, SPIKE_KIND)
        if name in self._fired_before and not self.cfg.repeat:
            return False
        # Durably, directory entry included: a crash right after must not forget it fired.
        atomic_write(self.dir / name, json.dumps({"kind": kind, "step": step, "pid": os.getpid(), "unix": time.time()}))
        self._fired_now.add(name)
        return True

    def poison(self, index: int) -> float:
        """What the loss of the micro-batch with this global index (unskipped stream) is multiplied
        by: NaN or SPIKE when a fault poisons it, else 1."""
        kind, step = self._poisoned.get(index, (None, None))
        if kind is None or not self._fire(kind, step):
            return 1.0
        log.warning(f"injected {kind}", step=step, micro_batch=index)
        return float("nan") if kind == NAN else SPIKE

    def _who(self, rank: int) -> int:
        return rank if self.host is None else self.host

    def glitch(self, step: int, rank: int) -> float:
        """What this process's loss of a micro-batch of `step` (the step being trained) is
        multiplied by: SPIKE once where a host spike strikes, else 1."""
        for spike in self.cfg.host_spikes:
            if (spike.step, spike.rank) == (step, self._who(rank)) and self._fire(HOST_SPIKE, step * 1000 + spike.rank):
                log.warning("injected host spike", step=step, rank=spike.rank)
                return SPIKE
        return 1.0

    def slow_down(self, step: int, rank: int, seconds: float) -> None:
        """After a forward or backward pass of `seconds` at `step` (steps done): slow_host's rank
        sleeps (factor - 1) x as long, from its from_step on."""
        slow = self.cfg.slow_host
        if slow is not None and self._who(rank) == slow.rank and step >= slow.from_step:
            time.sleep((slow.factor - 1) * seconds)

    def before_update(self, step: int, model, rank: int) -> None:
        """Step `step`'s gradients are ready (after the all-reduce) and about to be applied."""
        for flip in self.cfg.bit_flips:
            if (flip.gradient and (flip.step, flip.rank) == (step, self._who(rank))
                    and self._fire(GRAD_FLIP, step * 1000 + flip.rank)):
                flip_bit(model, flip)

    def at_step_boundary(self, step: int, model=None, rank: int = 0) -> None:
        """Called once after each step completes (`step` = steps done; `model` and this process's
        `rank` for bit flips), and at a fresh start with 0."""
        for flip in self.cfg.bit_flips:
            if (not flip.gradient and (flip.step, flip.rank) == (step, self._who(rank)) and model is not None
                    and self._fire(FLIP, step * 1000 + flip.rank)):
                flip_bit(model, flip)
        if step in self.cfg.crash_at_step and self._fire(CRASH, step):
            log.error("injected crash", step=step)
            raise RuntimeError(f"injected crash after step {step}")
        if step in self.cfg.hang_at_step and self._fire(HANG, step):
            log.error("injected hang", step=step)
            while True:  # a sleeping loop, not a blocked signal: SIGTERM's handler runs, and changes nothing
                time.sleep(1)


def flip_bit(model, flip) -> None:
    """Flip bit `flip.bit` of element `flip.element` of parameter `flip.tensor` (the first by
    default), or of its gradient: of this process's shard where the state is sharded (a sharded
    tensor's whole view would be a collective that the other processes never enter)."""
    import torch
    from torch.distributed.tensor import DTensor

    params = dict(model.named_parameters())
    name = flip.tensor or next(iter(params))
    if name not in params:
        raise ValueError(f"debug.inject.bit_flips: the model has no parameter {name!r}")
    target = params[name].grad if flip.gradient else params[name]
    if target is None:
        raise ValueError(f"debug.inject.bit_flips: parameter {name!r} has no gradient at this step")
    with torch.no_grad():
        flat = (target.to_local() if isinstance(target, DTensor) else target).detach().view(-1)
        i = flip.element % flat.numel()
        bits = flat[i:i + 1].view(torch.int32)  # 32-bit parameters: fp32
        bits ^= (1 << flip.bit) if flip.bit < 31 else -(1 << 31)  # the sign bit, as an int32
    log.error("injected bit flip", parameter=name, gradient=flip.gradient, element=i, bit=flip.bit)
