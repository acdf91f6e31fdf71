"""The worker's side of a gang: meet the other hosts' workers, watch them, leave together.

All of it goes through torch.distributed's TCPStore in a coordinator (tpud/worker/gang/stores.py says
which, when every host runs one), under `tpud/<job>/`:

    gen                   the current generation: each generation is one gang of workers
    last                  the newest gang formed: {"generation", "members"}
    alive/<host>          a counter the host's worker bumps while it waits or trains
    mark/<host>           "" | "out: why" (quarantined or evicted, exit 79) | "lost: why" (another
                          worker judged it lost) | "rejoin" (its worker restarts): until it joins again
    g<G>/spec/<host>      the fingerprint of its job spec (engine.spec.fingerprint), set before its seat
    g<G>/roster           the seats of generation G in order: "H," as host H takes its seat, "-H," as it
                          gives it up (a stop asked while waiting, or a better coordinator found)
    g<G>/checked          hosts that compared every member's fingerprint, appended alike
    g<G>/members          the hosts of the gang, fixed by the first worker to see it complete
    g<G>/started          the gang formed
    g<G>/beat/<host>      a counter each worker bumps every `interval`
    g<G>/arrivals/<host>  loop boundaries its training thread has reached (<host>.<N>: local rank N's)
    g<G>/left/<host>      it exits on purpose (done, stopped, bad input): not a failure

A worker that starts finds the current generation; if that gang already formed, one of its
workers is gone (this host's own, being replaced), so it opens the next generation. The
others see `gen` move, or a peer's beat stand still for `peer_timeout_s`, and exit with 77
(engine.exit_codes.GANG_RESTART) at once, from the watcher thread, even while their training
thread waits in a collective that would never finish. Every host's daemon starts its worker
again, and the new generation resumes from the newest global commit.

A generation forms when every host is seated or excused (tpud/worker/gang/formation.py: with
`min_hosts` below the host count, hosts left out, lost, or unseen for the peer timeout, as long
as the seated hold a majority of the last gang). So a gang shrinks instead of waiting for a
host that does not come back, and grows again when it does: a host that takes a seat in a
generation that formed without it opens the next one, which the others join. The members'
ranks are their order (host 2 of hosts 0 and 2 is rank 1), and the checkpoints' global commit
spans the members, fenced by the generation (`fence`).

Once every member is seated, each compares every member's fingerprint: hosts whose job files
differ all refuse the job alike, with exit 78 and a message naming the differing keys and each
host's value, before training a step. A refusing worker waits (briefly) until every member has
compared, so that none is left waiting for a coordinator that exits with it.

With `restart_peers` off (a setting, for comparison) there is no watcher: a worker learns of a
peer's failure only from a collective's error or its daemon's hang bound.

A worker whose training thread is ahead of a peer's (more arrivals) is waiting for that
peer: the watcher sends its daemon heartbeats, so that a hang is judged on the host whose
worker stopped, not on every host.

A host of several processes (device.processes_per_host) is one member: its local rank 0 meets
the others and beats for it, and tells its host's other processes the gang it formed
(tpud/worker/gang/host.py); each process publishes its own arrivals, so the one that stopped is
the one judged hung. Such a gang always changes by the restart path.
"""

from __future__ import annotations

import datetime
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import structlog

from engine import events, exit_codes
from engine.checkpoint.hosts import Hosts
from engine.errors import ConfigError
from tpud.worker.gang import stores
from tpud.worker.gang.host import Formed, HostProcesses, arrival_key
from tpud.worker.gang.seating import INTERVAL_S, Seating

log = structlog.get_logger()

# What gloo says when a peer's process died under a collective (its kernel closed its sockets).
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


class GangMember:
    def __init__(self, job: str, host: int, hosts: int, coordinator: str, peer_timeout_s: float,
                 emit: Callable[[events.Event], None], restart_peers: bool = True, min_hosts: int | None = None,
                 addresses: list[str] | None = None, record: Path | None = None,
                 clock: Callable[[], float] = time.monotonic, in_place: bool = True,
                 local: HostProcesses | None = None):
        """local: this process's place among its host's (device.processes_per_host above 1; host.py)."""
        self.host, self.hosts, self.coordinator = host, hosts, coordinator
        self.local = local
        self.addresses = addresses or [coordinator]
        self.peer_timeout_s, self.emit, self.restart_peers, self.clock = peer_timeout_s, emit, restart_peers, clock
        # Its seat: the coordinator, the generation and the gang (record: the job's gang.json).
        self.seating = Seating(job, host, hosts, min_hosts or hosts, self.addresses, peer_timeout_s, emit, record,
                               clock, self.per_host)
        self._at = events.Heartbeat(0)  # the training thread's latest boundary
        self._arrivals = 0
        self._leaving = False
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        self._read_at: float | None = None  # observe(): the peers' beats, and when each was last seen alive
        self._beats: dict[int, int] = {}
        self._alive_at: dict[int, float] = {}
        self.allow_in_place = in_place  # gang.in_place
        self.in_place = False  # whether a change of the gang keeps this process (gloo: see regroups)
        self.regroup_wanted: str | None = None  # why the training thread should leave for the next gang
        self._wanted_at = (0.0, 0)  # when it was asked, and the training thread's arrivals then
        self.path = "restart"  # how this worker came to its gang: a new process, or in_place
        self._cut_off = False  # it left its gang finding every peer silent: it moves no generation

    @classmethod
    def from_env(cls, job: str, emit: Callable[[events.Event], None], record: Path | None = None) -> GangMember | None:
        env = os.environ
        if "TPUD_GANG_HOSTS" not in env:
            return None
        hosts = int(env["TPUD_GANG_HOSTS"])
        addresses = env["TPUD_GANG_COORDINATOR"].split(",")
        return cls(job, int(env["TPUD_GANG_HOST"]), hosts, addresses[0],
                   float(env.get("TPUD_GANG_PEER_TIMEOUT", "3")), emit, env.get("TPUD_GANG_RESTART_PEERS") != "0",
                   int(env.get("TPUD_GANG_MIN_HOSTS", hosts)), addresses, record,
                   in_place=env.get("TPUD_GANG_IN_PLACE", "1") != "0", local=HostProcesses.from_env(env))

    @property
    def rank(self) -> int:
        """This host's rank in the gang: its place among the members."""
        return self.members.index(self.host)

    @property
    def per_host(self) -> int:
        """The processes of each host (every host runs as many: they compared their specs)."""
        return self.local.count if self.local is not None else 1

    @property
    def leads(self) -> bool:
        """Whether this process meets the other hosts for its host (its local rank 0)."""
        return self.local is None or self.local.leads

    @property
    def process_rank(self) -> int:
        """This process's rank in the gang's process group: a host's processes are consecutive."""
        return self.rank * self.per_host + (self.local.local_rank if self.local is not None else 0)

    @property
    def world(self) -> int:
        return len(self.members) * self.per_host

    @property
    def place(self) -> Hosts:
        return Hosts(self.rank, len(self.members), tuple(self.members),
                     fence=self.fence if self.restart_peers else None, source=self.seating.source,
                     transfer=self.seating.transfer)

    # What the seat says (seating.py): the coordinator's store and index, the generation, the gang.
    store = property(lambda self: self.seating.store)
    at = property(lambda self: self.seating.at)
    generation = property(lambda self: self.seating.generation)
    members = property(lambda self: self.seating.members)
    prefix = property(lambda self: self.seating.prefix)

    def _key(self, name: str, generation: int | None = None) -> str:
        return self.seating.key(name, generation)

    def _host_key(self, name: str, host: int) -> str:
        return self.seating.host_key(name, host)

    # --- joining ---

    def join(self, backend: str, stop_asked: Callable[[], bool], spec: dict, holds: int = -1,
             committed: int = -1, committed_by: tuple[int, ...] = ()) -> bool:
        """Wait until the gang is complete, then form the process group (not under xla, whose
        xla:// initialisation finds its peers through the TPU runtime). False when a stop was asked
        meanwhile; ConfigError when the members' job specs (their fingerprints) differ. `holds`:
        the step whose state this worker holds live (it kept it through a change of its gang), or -1;
        `committed`: the newest step globally committed on this host's disk, or -1, and
        `committed_by` the gang's members that made it (a host back blank learns from it whom the
        gang went on without)."""
        # Only gloo's gang changes in place, with one process a host: nccl's abort and xla's runtime
        # are not built on here, and a host's processes restart together.
        self.in_place = self.allow_in_place and self.restart_peers and backend == "cpu" and self.local is None
        if not self.leads:
            return self._follow(backend, stop_asked)
        if self.local is not None:
            self.local.store()  # served from now on: the host's other processes wait in it for the gang
        while True:
            if not self.seating.connect(stop_asked, committed, committed_by):
                return False
            try:
                seated = self.seating.sit(spec, f"{holds},{committed}", stop_asked)
                if seated is None:
                    self.leave()
                    return False
                if seated:
                    break
            except (RuntimeError, OSError) as e:  # torch's DistNetworkError is a RuntimeError
                # The coordinator stopped or restarted under this wait: find the next one.
                log.warning("lost the gang's coordinator while waiting for the hosts; looking for it again",
                            coordinator=self.addresses[self.at], error=str(e).splitlines()[0][:200])
        try:
            self.seating.same_spec()
        except ConfigError:
            self.seating.wait_checked()
            self.leave()  # every host finds the same: none is waited for
            raise
        self.seating.live_state()
        if self.local is not None:
            self.local.share(Formed(self.generation, self.members, self.at))
        log.info("gang formed", host=self.host, hosts=self.hosts, members=self.members, generation=self.generation,
                 coordinator=self.addresses[self.at], path=self.path, source=self.seating.source,
                 transfer=self.seating.transfer)
        self.emit(events.Gang(self.host, self.hosts, len(self.members), self.generation, self.members,
                              coordinator=self.addresses[self.at], path=self.path))
        self._start(backend)
        return True

    def _follow(self, backend: str, stop_asked: Callable[[], bool]) -> bool:
        """A host's process other than local rank 0: that one meets the other hosts; this one waits
        until it says the gang formed (host.py), then joins the gang's process group."""
        formed = self.local.wait(stop_asked, lambda: self.emit(events.Heartbeat(0)))
        if formed is None:
            return False
        seat = self.seating
        seat.generation, seat.members, seat.at = formed.generation, formed.members, formed.coordinator
        seat.store = stores.open_store(self.addresses[self.at], stores.STORE_TIMEOUT_S)
        if self.store is None:
            raise RuntimeError(f"the gang's coordinator {self.addresses[self.at]} does not answer")
        log.info("gang formed", host=self.host, local_rank=self.local.local_rank, members=self.members,
                 generation=self.generation, coordinator=self.addresses[self.at])
        self._start(backend)
        return True

    def _start(self, backend: str) -> None:
        """Watch the gang, and form its process group (not under xla, whose xla:// initialisation
        finds its peers through the TPU runtime)."""
        import torch.distributed as dist

        if self.restart_peers:
            self._watcher = threading.Thread(target=self._watch, name="gang-watch", daemon=True)
            self._watcher.start()
        if backend != "xla":
            # A connection of its own: the group's rendezvous blocks in its store calls, and the watcher
            # must reach the coordinator meanwhile (a gang that changes under the rendezvous).
            dist.init_process_group("nccl" if backend == "cuda" else "gloo",
                                    store=dist.PrefixStore(self._key("pg/"), self.store.clone()),
                                    rank=self.process_rank, world_size=self.world,
                                    timeout=datetime.timedelta(minutes=10))

    # --- while training ---

    def arrived(self, at: events.Heartbeat) -> None:
        """The training thread reached a boundary (called from the hooks' poll)."""
        self._at, self._arrivals = at, self._arrivals + 1

    def _watch(self) -> None:
        """Every interval: publish how far the training thread got, and tell the daemon it lives while
        another process (of any host) is behind it. Local rank 0 also beats for its host and judges
        the others' (a host's other processes leave that to it: their daemon ends them with it)."""
        store, me, leads = self.store, self.host, self.leads
        mine = self._key(arrival_key(me, self.local.local_rank if self.local is not None else 0))
        others = [key for key in (self._key(arrival_key(h, local)) for h in self.members
                                  for local in range(self.per_host)) if key != mine]
        published, lost_since = 0, None
        while not self._stop.wait(INTERVAL_S):
            if self.regroup_wanted is not None:
                self._disrupted(self.regroup_wanted)  # falls back to a restart if the training thread is held
            try:
                arrived = self._arrivals
                store.add(mine, arrived - published)
                published = arrived
                if leads:
                    self._judge()
                if others and any(int(a) < published for a in store.multi_get(others)):
                    # Waiting for a slower process in a collective: alive, and not the one to blame.
                    self.emit(self._at)
                lost_since = None
            except Exception as e:  # noqa: BLE001
                # The coordinator is gone, and so is the gang: unless the coordinator's host has just
                # finished the job and this worker is about to, which the grace lets it do.
                lost_since = lost_since or self.clock()
                if leads and self.clock() - lost_since > self.peer_timeout_s:
                    self._disrupted(f"lost the gang's coordinator {self.addresses[self.at]}: {e}", reachable=False)

    def _judge(self) -> None:
        """Beat for this host, and end this worker when the gang moved on or a peer's beat stood still."""
        store, me = self.store, self.host
        store.add(self._key(f"beat/{me}"), 1)
        store.add(self._host_key("alive", me), 1)
        if (g := int(store.add(self.prefix + "gen", 0))) != self.generation:
            self._disrupted(f"another host's worker restarted (generation {self.generation} -> {g})")
        if stale := self._silent(self.observe()):
            self._lost(stale)

    def observe(self) -> float:
        """Read the peers' beats in this generation (the watcher, every interval); the time read.

        A beat that moved since the previous read proves its worker alive at that previous read,
        not now: a host paused between two reads must not take its peers' beats from before its
        pause for signs of life after it (the fence below)."""
        peers = [h for h in self.members if h != self.host]
        now = self.clock()
        if self._read_at is None:
            self._read_at, self._beats = now, {}
            self._alive_at = {h: now for h in peers}
        beats = self.store.multi_get([self._key(f"beat/{h}") for h in peers]) if peers else []
        for h, beat in zip(peers, beats):
            if self._beats.get(h) != int(beat):
                self._beats[h] = int(beat)
                self._alive_at[h] = self._read_at
        self._read_at = now
        return now

    def _silent(self, now: float) -> list[int]:
        """The peers not seen beating for the peer timeout (observe), less those that left on purpose."""
        return [h for h, at in self._alive_at.items() if now - at > self.peer_timeout_s
                and not self.store.check([self._key(f"left/{h}")])]

    def _lost(self, stale: list[int]) -> None:
        """Peers whose beat stood still. When every peer's did, this host is more likely the one that
        was cut off (paused, partitioned): it blames none and does not move the generation."""
        if len(stale) == len(self.members) - 1 and len(stale) > 1:
            self._disrupted(f"no other host's worker beat for {self.peer_timeout_s:g}s: this host was cut off",
                            bump=False)
            return
        for h in stale:
            self.store.set(self._host_key("mark", h), f"lost: its worker stopped beating in generation "
                                                      f"{self.generation}")
        self._disrupted(f"host(s) {', '.join(map(str, stale))}'s worker stopped responding for "
                        f"{self.peer_timeout_s:g}s")

    def fence(self) -> str | None:
        """Before a global commit: why this worker may not commit for its generation, or None.

        The generation must still be current at the coordinator, and every other member must have
        been seen beating in it within the peer timeout (observe: seen, not assumed): a host that
        was paused or cut off (its coordinator with it) comes back with an old view, and commits
        nothing for a generation the others left. Instant: it waits for nothing."""
        if self.generation < 0 or self.store is None or self._read_at is None:
            return None
        now = self.clock()
        try:
            silent = self._silent(now)
            current = int(self.store.add(self.prefix + "gen", 0))
        except Exception as e:  # noqa: BLE001
            return f"the gang's coordinator did not answer: {str(e)[:200]}"
        if current != self.generation:
            return f"generation {self.generation} is over (the gang is at {current})"
        if silent:
            return (f"host(s) {', '.join(map(str, sorted(silent)))} not seen beating in generation "
                    f"{self.generation} for {self.peer_timeout_s:g}s")
        return None

    def _disrupted(self, reason: str, reachable: bool = True, bump: bool = True) -> None:
        if self._leaving:
            return
        if self.in_place:
            if self.regroup_wanted is None:
                self._cut_off = not bump
                log.warning("the gang changed; leaving the step to form the next gang in place", reason=reason,
                            host=self.host, generation=self.generation)
                self.regroup_wanted, self._wanted_at = reason, (self.clock(), self._arrivals)
                if reachable and bump:
                    self._end_generation()
                return
            if self._arrivals != self._wanted_at[1] or self.clock() - self._wanted_at[0] <= self.peer_timeout_s:
                return  # the training thread will leave at its next boundary
            reason = f"{self.regroup_wanted}; the training thread is held in a collective that cannot be left"
        log.error("the gang is broken; exiting so that every host restarts together", reason=reason,
                  host=self.host, generation=self.generation)
        if reachable:
            self._restarting(bump)
        sys.stdout.flush()
        os._exit(exit_codes.GANG_RESTART)

    def _restarting(self, bump: bool = True) -> None:
        """This worker exits and its daemon starts another: the next gang waits for it (seating.REJOIN_S)."""
        try:
            self.store.set(self._host_key("mark", self.host), "rejoin")
        except Exception:  # noqa: BLE001  (unreachable: the others find out by themselves)
            pass
        if bump:
            self._end_generation()

    def _end_generation(self) -> None:
        try:
            self.store.compare_set(self.prefix + "gen", str(self.generation), str(self.generation + 1))
        except Exception:  # noqa: BLE001  (unreachable: the others find out by themselves)
            pass

    def regroups(self, error: BaseException) -> bool:
        """Whether the worker forms the next gang in place after its training raised `error`: the
        gang changed (engine.errors.GangChanged), or a peer's process died under a collective. It
        then leaves this generation (its watcher, its process groups) and the caller joins again,
        keeping its model and optimizer. gloo only: its collective fails when a peer's process dies
        (the kernel closes the connection); a collective waiting on a silent peer (a paused or
        unplugged VM) cannot be left (ProcessGroupGloo.abort does not wake it), so the watcher then
        falls back to exit 77 and the restart path."""
        import torch.distributed as dist

        from engine.errors import GangChanged

        if not self.in_place or self._leaving or self.generation < 0:
            return False
        if not (isinstance(error, GangChanged) or any(s in str(error) for s in PEER_GONE)):
            return False
        log.warning("forming the next gang in place", host=self.host, generation=self.generation,
                    reason=str(error).splitlines()[0][:200] if str(error) else type(error).__name__)
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001  (a group whose peer is gone may fail to shut down: it is gone too)
                pass
        self.leave_generation()
        return True

    def leave_generation(self) -> None:
        """Stop watching this generation and end it (the first to notice opens the next one; the
        others' watchers see it), saying this host comes back: the next gang waits for it (seating.REJOIN_S)
        rather than take a slow regroup for a lost host."""
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join(timeout=5)
        self._restarting(bump=not self._cut_off)
        self._stop, self._watcher, self._read_at = threading.Event(), None, None
        self.regroup_wanted, self.path, self._cut_off = None, "in_place", False

    # --- leaving ---

    def leave(self) -> None:
        """Exiting on purpose (the gang agreed on it): the others must not take it for a failure."""
        self._leaving = True
        if self.generation < 0:
            return
        try:
            if self.leads:
                self.store.set(self._key(f"left/{self.host}"), "1")
        except Exception:  # noqa: BLE001
            pass
        self._stop.set()
        if self._watcher is not None:  # not inside a store call as the interpreter exits (that aborts)
            self._watcher.join(timeout=5)

    def left_out(self, reason: str) -> None:
        """This host's worker was quarantined or evicted and exits 79 next: with min_hosts the others
        go on without it. From now on the others' restart is no disruption to this worker."""
        self._leaving = True
        try:
            self.store.set(self._host_key("mark", self.host), f"out: {reason}")
        except Exception:  # noqa: BLE001  (the coordinator is gone: the others wait, as without min_hosts)
            pass

    def crashed(self, error: BaseException) -> None:
        """The training thread raised. A collective whose peer's connection closed is a peer's
        failure: exit 77 at once. Another collective failure may be one too, which the watcher
        finds within the peer timeout and then exits 77. Any other failure is this host's: end
        the generation now, so the others restart at once, and fail (its budget pays)."""
        import torch.distributed as dist

        if self.generation < 0:
            return
        if self.restart_peers and isinstance(error, (dist.DistError, RuntimeError)) and _collective_failure(error):
            if any(s in str(error) for s in PEER_GONE):
                self._disrupted(f"a peer's connection closed in a collective: {str(error)[:200]}")
            time.sleep(self.peer_timeout_s + 2 * INTERVAL_S)
        self._leaving = True
        self._restarting()
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join(timeout=5)


def _collective_failure(error: BaseException) -> bool:
    import torch.distributed as dist

    text = str(error)
    return isinstance(error, dist.DistError) or any(s in text for s in ("Gloo", "gloo", "Connection closed", "NCCL"))
