"""Restoring the newest valid training state of both tiers, the disk's and the memory's.

Every file's CRC32C is checked before a state is applied; a damaged disk checkpoint is moved
aside and the next older one tried, a damaged memory state discarded. A job on several hosts
restores the step the hosts agree on (engine.checkpoint.hosts), or a memory state every host
holds, which a host that lacks it (a replaced VM, or one that was away while the others went on
and committed) first takes from a peer.
"""

from __future__ import annotations

import time
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from engine.backends.base import Backend
from engine.checkpoint import hosts as gang
from engine.checkpoint import manifest as mf
from engine.checkpoint import memory as mem
from engine.checkpoint import retention
from engine.checkpoint.errors import describe_error
from engine.checkpoint.state import Progress, TrainingState

log = structlog.get_logger()
Candidate = tuple[int, Path, mf.Manifest]  # (step, directory, its manifest)


@dataclass(frozen=True)
class Restored:
    progress: Progress
    manifest: mf.Manifest
    loader: dict  # the loader state it was saved with
    path: Path
    started: float  # time.monotonic() when its load began


class Restorer:
    def __init__(self, job_dir: Path, state: TrainingState, backend: Backend, group: Any, rank: int,
                 hosts: gang.Hosts | None, hosts_group: Any, memory: mem.MemoryTier | None, pool: Executor):
        """pool: verifies a checkpoint's checksums while it loads."""
        self.job_dir, self.state, self.backend, self.group, self.rank = job_dir, state, backend, group, rank
        self.hosts, self.hosts_group, self.memory, self._pool = hosts, hosts_group, memory, pool
        self._memory_agreed: frozenset = frozenset()  # with several hosts: memory states every host holds

    def restore(self, at_most: int | None = None) -> Restored | None:
        """Load the newest valid checkpoint (of step `at_most` or earlier: a rollback,
        engine.health.healing) into the model and optimizer; None when there is none.

        Every file's CRC32C is checked while DCP loads (both read the same files, so the
        second read comes from the page cache), and the state is applied only once the check
        passes; a damaged checkpoint is moved aside and the next older one loaded, which
        overwrites every tensor the damaged one touched. Copies are not made: they would
        double the state's memory. If no valid checkpoint is left after a damaged one was
        loaded, the process must not train on that state: it raises, and a restart begins
        afresh.
        """
        tainted = False
        candidates = mf.committed_steps(self.job_dir) if self.hosts is None else self._agreed_part(at_most)
        in_memory = self._memory_states(candidates)
        if at_most is not None:  # a partial step of at_most itself holds batches of step at_most + 1
            candidates, in_memory = ([c for c in found if (c[0], c[2].micro_step) <= (at_most, 0)]
                                     for found in (candidates, in_memory))
        # Newest first; of two copies of a step, the memory one (read at memory speed).
        ordered = sorted([(item, False) for item in candidates] + [(item, True) for item in in_memory],
                         key=lambda c: (c[0][0], c[0][2].micro_step, c[1]), reverse=True)
        for (_, path, manifest), from_memory in ordered:
            if from_memory:
                restored = self._restore_memory(path, manifest)
                if restored is not None:
                    return restored
                continue
            found = mf.problems(path, manifest, checksums=False)
            if found:
                retention.move_aside(self.job_dir, path, found, self.rank)
                continue
            started = time.monotonic()
            verifying = self._pool.submit(mf.problems, path, manifest, checksums=True)
            try:
                template = self._load(path, manifest)
            except Exception as e:  # unreadable despite matching sizes: judged by its checksums below
                template, error = None, e
            found = verifying.result()
            if found:
                retention.move_aside(self.job_dir, path, found, self.rank)
                tainted = True
                continue
            if template is None:
                raise error
            return self._apply(template, manifest, path, started)
        if tainted:
            raise RuntimeError("every checkpoint failed verification (moved aside); restart to begin afresh")
        return None

    def _memory_states(self, on_disk: list[Candidate]) -> list[Candidate]:
        """The memory tier's states worth trying: as new as the disk's newest candidate or newer, and with
        several hosts, held by every host (the agreement put it in `self._memory_agreed`)."""
        if self.memory is None:
            return []
        newest = max(((step, m.micro_step) for step, _, m in on_disk), default=(-1, -1))
        held = [(step, path, m) for step, path, m in mf.parts(self.memory.job_dir) if (step, m.micro_step) >= newest]
        if self.hosts is None and self.group is not None:
            self._memory_agreed = self._held_by_every_process(held)
        if self.hosts is not None or self.group is not None:
            held = [item for item in held if (item[0], item[2].micro_step) in self._memory_agreed]
        return held

    def _held_by_every_process(self, held: list[Candidate]) -> frozenset:
        """The processes of one host each keep their own shards: the states every one of them holds,
        verified, so that all restore the same step (or all go to the disk's)."""
        mine = frozenset((step, m.micro_step) for step, path, m in held if not mf.problems(path, m, checksums=True))
        everyone: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(everyone, mine, group=self.group)
        return frozenset.intersection(*everyone)

    def _restore_memory(self, path: Path, manifest: mf.Manifest) -> Restored | None:
        """Load a memory state once every byte matches its manifest; None (and the state discarded) otherwise."""
        started = time.monotonic()
        found = mf.problems(path, manifest, checksums=True)
        if not found:
            try:
                template = mem.load(path, self.state.template(manifest))
            except (OSError, ValueError, KeyError, TypeError) as e:
                found = [describe_error(e)]
            else:
                return self._apply(template, manifest, path, started)
        self.memory.discard(path, found)
        return None

    def _agreed_part(self, at_most: int | None) -> list[Candidate]:
        """This host's part of the step every host restores (engine.checkpoint.hosts), marked
        global here too; none when the hosts have no step in common. A rollback's (`at_most`)
        takes no peer's state: its gang is whole, and a state sent would be past the rollback."""
        held = {(step, m.micro_step): (step, path, m) for step, path, m in mf.parts(self.job_dir)
                if not mf.problems(path, m, checksums=False)}
        mine = gang.Holdings(frozenset(held), frozenset(k for k, (_, p, m) in held.items() if mf.is_global(p, m)))
        # Verified before they are offered: every host must restore the step it agreed to. A host's
        # processes each hold their own shards: the host offers the states all of them hold. A whole
        # step's state is every host's (data parallelism), whichever gang made it: a host that comes
        # back blank to a gang that went on without it takes the newest from a peer, never an older
        # commit; a partial step's micro-batches are laid out by the host count that made it.
        in_memory = frozenset((step, m.micro_step) for step, path, m in mf.parts(self.memory.job_dir)
                              if (m.micro_step == 0 or m.hosts == self.hosts.count)
                              and m.world_size == self._processes()
                              and not mf.problems(path, m, checksums=True)
                              ) if self.memory is not None else frozenset()
        in_memory = frozenset.intersection(*gang.gather_host(in_memory, self.group))
        everyone = gang.exchange((mine, {k: m.hosts for k, (_, _, m) in held.items()}, in_memory,
                                  self.memory is not None), self.hosts, self.hosts_group)
        memories, tiers = [memory for _, _, memory, _ in everyone], [tier for *_, tier in everyone]
        # A state every host holds in memory (each verifies its own) may restore them all.
        self._memory_agreed = frozenset.intersection(*memories)
        everyone = [(h, made) for h, made, _, _ in everyone]
        hosts_of = {k: n for _, made in everyone for k, n in made.items()}
        if self.rank == 0:
            gang.note_holdings(self.job_dir, [h.parts for h, _ in everyone])
        key, passed = gang.choose([h for h, _ in everyone], self.hosts.count, hosts_of)
        if passed:
            log.warning("newer global checkpoints passed over", reasons=passed, restoring=key)
        if all(tiers) and at_most is None:
            self._memory_from_peer(memories, [h for h, _ in everyone], key)
        if key is None:
            if any(h.marked for h, _ in everyone) and not self._memory_agreed:
                raise RuntimeError(f"no globally committed step is held by every host ({'; '.join(passed)}); "
                                   "give the job a checkpoint.remote so a host can fetch its part")
            return []
        step, path, manifest = held[key]
        if self.rank == 0 and not mf.is_global(path, manifest):
            mf.write_global(path, manifest)
        return [held[key]]

    def _processes(self) -> int:
        """The processes writing one checkpoint together (a memory state is each one's shards)."""
        return dist.get_world_size(self.group) if self.group is not None else 1

    def _memory_from_peer(self, memories: list[frozenset], holdings: list[gang.Holdings],
                          on_disk: tuple[int, int] | None) -> None:
        """Hosts that lack the newest state the gang can vouch for take it from a peer
        (gang.peer_send says which): the engine's state is replicated across hosts (data
        parallelism), so a peer's state is this host's too. The receivers' checks are agreed
        again; a failed transfer may have cost a receiver the state in the slot it reused, so then
        no memory state is agreed, and every host restores the disks' step."""
        send = gang.peer_send(memories, holdings, on_disk)
        if send is None:
            return
        # Each process from the process of the source host that holds the same shards.
        received = self.memory.transfer(send.key, send.source, list(send.receivers), self.hosts.index,
                                        self.hosts_group)
        received = all(gang.gather_host(received, self.group))
        if all(gang.exchange(received, self.hosts, self.hosts_group)):
            log.info("a peer's memory state restores the hosts that lack it", step=send.key[0],
                     micro_step=send.key[1], source=send.source, hosts=list(send.receivers))
            self._memory_agreed = frozenset({send.key})
        else:
            log.warning("a peer's memory state did not reach every host that lacks it: restoring from disk",
                        step=send.key[0], source=send.source, hosts=list(send.receivers))
            self._memory_agreed = frozenset()

    def _load(self, path: Path, manifest: mf.Manifest) -> dict:
        template = self.state.template(manifest)
        _, load_planner = self.backend.planners()
        dcp.load(template, storage_reader=dcp.FileSystemReader(path), planner=load_planner,
                 process_group=self.group, no_dist=self.group is None)
        return template

    def _apply(self, template: dict, manifest: mf.Manifest, path: Path, started: float) -> Restored:
        progress = self.state.apply(template, manifest)
        return Restored(progress, manifest, dict(template["loader"]), path, started)
