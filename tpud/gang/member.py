"""The worker's side of a gang: meet the other hosts' workers, watch them, leave together.

All of it goes through torch.distributed's TCPStore in host 0's coordinator, under
`tpud/<job>/`:

    gen                   the current generation: each generation is one gang of workers
    g<G>/spec/<host>      the fingerprint of its job spec (engine.spec.fingerprint), set before its seat
    g<G>/seat/<host>      a worker of this host joined generation G
    g<G>/members          the hosts of the gang, fixed by the first worker to see it complete
    g<G>/started          every host was seated: the gang formed
    g<G>/beat/<host>      a counter each worker bumps every `interval`
    g<G>/arrivals/<host>  loop boundaries its training thread has reached
    g<G>/left/<host>      it exits on purpose (done, stopped, bad input): not a failure
    out/<host>            its worker was quarantined or evicted (exit 79), until it joins again

Once every host is seated, each compares every host's fingerprint: hosts whose job files
differ (one host's jobs.d/ edited, not the others') all refuse the job alike, with exit 78 and a
message naming the differing keys and each host's value, before training a step.

A worker that starts finds the current generation; if that gang already formed, one of its
workers is gone (this host's own, being replaced), so it opens the next generation. The
others see `gen` move, or a peer's beat stand still for `peer_timeout_s`, and exit with 77
(engine.exit_codes.GANG_RESTART) at once, from the watcher thread, even while their training
thread waits in a collective that would never finish. Every host's daemon starts its worker
again, and the new generation resumes from the newest global commit.

With `restart_peers` off (a setting, for comparison) there is no watcher: a worker learns of a
peer's failure only from a collective's error or its daemon's hang bound.

A gang is complete when every host is seated, except, with `min_hosts` below the host count,
hosts left out (`out/<host>`): the others form without them, as long as at least `min_hosts` are
seated. The members' ranks are their order (host 2 of hosts 0 and 2 is rank 1), and the
checkpoints' global commit spans the members. A host left out that starts again (an operator's
`tpud start`, a replaced VM) clears its mark and takes a seat; finding the gang formed without it,
it opens the next generation, which the others join: the gang grows back.

A worker whose training thread is ahead of a peer's (more arrivals) is waiting for that
peer: the watcher sends its daemon heartbeats, so that a hang is judged on the host whose
worker stopped, not on every host.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable

import structlog

from engine import events, exit_codes
from engine.checkpoint.hosts import Hosts
from engine.errors import ConfigError
from engine.spec import fingerprint

log = structlog.get_logger()

CONNECT_TIMEOUT_S = 2.0
# What gloo says when a peer's process died under a collective (its kernel closed its sockets).
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
INTERVAL_S = 0.25


class GangMember:
    def __init__(self, job: str, host: int, hosts: int, coordinator: str, peer_timeout_s: float,
                 emit: Callable[[events.Event], None], restart_peers: bool = True, min_hosts: int | None = None):
        self.host, self.hosts, self.coordinator = host, hosts, coordinator
        self.min_hosts = min_hosts or hosts
        self.members = list(range(hosts))  # this generation's, once formed
        self.peer_timeout_s, self.emit, self.restart_peers = peer_timeout_s, emit, restart_peers
        self.prefix = f"tpud/{job}/"
        self.store = None
        self.generation = -1
        self._at = events.Heartbeat(0)  # the training thread's latest boundary
        self._arrivals = 0
        self._leaving = False
        self._stop = threading.Event()
        self._stop_asked: Callable[[], bool] = lambda: False
        self._watcher: threading.Thread | None = None

    @classmethod
    def from_env(cls, job: str, emit: Callable[[events.Event], None]) -> GangMember | None:
        env = os.environ
        if "TPUD_GANG_HOSTS" not in env:
            return None
        hosts = int(env["TPUD_GANG_HOSTS"])
        return cls(job, int(env["TPUD_GANG_HOST"]), hosts, env["TPUD_GANG_COORDINATOR"],
                   float(env.get("TPUD_GANG_PEER_TIMEOUT", "3")), emit, env.get("TPUD_GANG_RESTART_PEERS") != "0",
                   int(env.get("TPUD_GANG_MIN_HOSTS", hosts)))

    @property
    def rank(self) -> int:
        """This host's rank in the gang: its place among the members."""
        return self.members.index(self.host)

    @property
    def place(self) -> Hosts:
        return Hosts(self.rank, len(self.members))

    def _key(self, name: str, generation: int | None = None) -> str:
        g = self.generation if generation is None else generation
        return f"{self.prefix}g{g}/{name}"

    # --- joining ---

    def join(self, backend: str, stop_asked: Callable[[], bool], spec: dict) -> bool:
        """Wait until every host's worker is here, then form the process group (not under xla,
        whose xla:// initialisation finds its peers through the TPU runtime). False when a stop
        was asked meanwhile; ConfigError when the hosts' job specs (their fingerprints) differ."""
        import torch.distributed as dist

        self._stop_asked = stop_asked
        while True:
            if not self._connect():
                return False
            try:
                self.store.delete_key(self.prefix + f"out/{self.host}")  # this host is back
                while not (seated := self._seated(spec)):
                    if seated is None:
                        self.leave()
                        return False
                break
            except (RuntimeError, OSError) as e:  # torch's DistNetworkError is a RuntimeError
                # Host 0's daemon stopped or restarted under this wait: wait for its next coordinator.
                log.warning("lost the gang's coordinator while waiting for the hosts; waiting for it again",
                            coordinator=self.coordinator, error=str(e).splitlines()[0][:200])
        try:
            self._same_spec()
        except ConfigError:
            self.leave()  # every host finds the same: none is waited for
            raise
        log.info("gang formed", host=self.host, hosts=self.hosts, members=self.members, generation=self.generation)
        self.emit(events.Gang(self.host, self.hosts, len(self.members), self.generation, self.members))
        if self.restart_peers:
            self._watcher = threading.Thread(target=self._watch, name="gang-watch", daemon=True)
            self._watcher.start()
        if backend != "xla":
            dist.init_process_group("nccl" if backend == "cuda" else "gloo",
                                    store=dist.PrefixStore(self._key("pg/"), self.store),
                                    rank=self.rank, world_size=len(self.members),
                                    timeout=datetime.timedelta(minutes=10))
        return True

    def _connect(self) -> bool:
        """Connect to the coordinator, waiting for it (host 0's daemon may be down); False on a stop.

        A plain TCP probe first: TCPStore's own failed attempts each log a C++ stack trace.
        """
        import torch.distributed as dist

        host, port = self.coordinator.rpartition(":")[0].strip("[]"), int(self.coordinator.rpartition(":")[2])
        waited = time.monotonic()
        while True:
            try:
                socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S).close()
                self.store = dist.TCPStore(host, port, is_master=False, use_libuv=True,
                                           timeout=datetime.timedelta(seconds=CONNECT_TIMEOUT_S))
                break
            except (RuntimeError, OSError) as e:  # not listening yet
                self.emit(events.Gang(self.host, self.hosts, 0, -1))
                if self._stop_asked():
                    return False
                if time.monotonic() - waited > 30:
                    log.warning("waiting for the gang's coordinator", coordinator=self.coordinator, error=str(e))
                    waited = time.monotonic()
                time.sleep(INTERVAL_S)
        self.store.set_timeout(datetime.timedelta(seconds=30))
        return True

    def _seated(self, spec: dict) -> bool | None:
        """Take this host's seat in the current generation and wait for the others; False when the
        generation moved on meanwhile (try the next one), None when a stop was asked."""
        store, gen = self.store, self.prefix + "gen"
        g = int(store.add(gen, 0))
        if store.check([self._key("started", g)]):  # that gang formed and lost a worker: open the next one
            store.compare_set(gen, str(g), str(g + 1))
            return False
        self.generation = g
        store.set(self._key(f"spec/{self.host}"), fingerprint.canonical(spec))  # first: a seat vouches for it
        store.set(self._key(f"seat/{self.host}"), str(os.getpid()))
        reported, told = None, 0.0
        while True:
            if int(store.add(gen, 0)) != g:
                return False
            seated = [h for h in range(self.hosts) if store.check([self._key(f"seat/{h}")])]
            out = [h for h in range(self.hosts) if h not in seated and store.check([self.prefix + f"out/{h}"])]
            present = len(seated)
            if present != reported:
                log.info("waiting for hosts", present=present, hosts=self.hosts, left_out=out, generation=g)
            if present != reported or time.monotonic() - told >= 1.0:  # the daemon's status, and its hang watch
                self.emit(events.Gang(self.host, self.hosts, present, g))
                reported, told = present, time.monotonic()
            if present + len(out) == self.hosts and present >= self.min_hosts:
                return self._form(seated)
            if self._stop_asked():
                store.delete_key(self._key(f"seat/{self.host}"))
                return None
            time.sleep(INTERVAL_S)

    def _form(self, seated: list[int]) -> bool:
        """Fix the members (the first worker to get here writes them, so all agree), or False when
        this host took its seat after they were fixed: the next generation takes it."""
        if self.store.add(self._key("forming"), 1) == 1:
            self.store.set(self._key("members"), json.dumps(seated))
        self.members = json.loads(self.store.get(self._key("members")))
        if self.host not in self.members:
            self.store.compare_set(self.prefix + "gen", str(self.generation), str(self.generation + 1))
            return False
        self.store.set(self._key("started"), "1")
        return True

    def _same_spec(self) -> None:
        """Compare every seated host's fingerprint; a seat without one is a worker of an older tpud
        (a rolling upgrade), which is not compared."""
        keys = {h: self._key(f"spec/{h}") for h in range(self.hosts)}
        fingerprint.check_hosts({h: json.loads(self.store.get(key)) for h, key in keys.items()
                                 if self.store.check([key])})

    # --- while training ---

    def arrived(self, at: events.Heartbeat) -> None:
        """The training thread reached a boundary (called from the hooks' poll)."""
        self._at, self._arrivals = at, self._arrivals + 1

    def _watch(self) -> None:
        store, me = self.store, self.host
        peers = [h for h in self.members if h != me]
        seen = {h: (-1, time.monotonic()) for h in peers}
        published, lost_since = 0, None
        while not self._stop.wait(INTERVAL_S):
            try:
                store.add(self._key(f"beat/{me}"), 1)
                arrivals = self._arrivals
                store.add(self._key(f"arrivals/{me}"), arrivals - published)
                published = arrivals
                if (g := int(store.add(self.prefix + "gen", 0))) != self.generation:
                    self._disrupted(f"another host's worker restarted (generation {self.generation} -> {g})")
                now, behind = time.monotonic(), False
                for h in peers:
                    beat = int(store.add(self._key(f"beat/{h}"), 0))
                    if beat != seen[h][0]:
                        seen[h] = (beat, now)
                    elif now - seen[h][1] > self.peer_timeout_s and not store.check([self._key(f"left/{h}")]):
                        self._disrupted(f"host {h}'s worker stopped responding for {self.peer_timeout_s:g}s")
                    behind = behind or int(store.add(self._key(f"arrivals/{h}"), 0)) < published
                if behind:  # waiting for a slower host in a collective: alive, and not the one to blame
                    self.emit(self._at)
                lost_since = None
            except Exception as e:  # noqa: BLE001
                # The coordinator is gone, and so is the gang: unless host 0 has just finished the job
                # and this worker is about to, which the grace lets it do.
                lost_since = lost_since or time.monotonic()
                if time.monotonic() - lost_since > self.peer_timeout_s:
                    self._disrupted(f"lost the gang's coordinator {self.coordinator}: {e}")

    def _disrupted(self, reason: str) -> None:
        if self._leaving:
            return
        log.error("the gang is broken; exiting so that every host restarts together", reason=reason,
                  host=self.host, generation=self.generation)
        self._end_generation()
        sys.stdout.flush()
        os._exit(exit_codes.GANG_RESTART)

    def _end_generation(self) -> None:
        try:
            self.store.compare_set(self.prefix + "gen", str(self.generation), str(self.generation + 1))
        except Exception:  # noqa: BLE001  (unreachable: the others find out by themselves)
            pass

    # --- leaving ---

    def leave(self) -> None:
        """Exiting on purpose (the gang agreed on it): the others must not take it for a failure."""
        self._leaving = True
        if self.generation < 0:
            return
        try:
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
            self.store.set(self.prefix + f"out/{self.host}", reason)
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
        self._end_generation()
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join(timeout=5)


def _collective_failure(error: BaseException) -> bool:
    import torch.distributed as dist

    text = str(error)
    return isinstance(error, dist.DistError) or any(s in text for s in ("Gloo", "gloo", "Connection closed", "NCCL"))
