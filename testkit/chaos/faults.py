"""Each timed fault done to the cluster, and undone when it has lasted its time.

strike(fault) returns what it did (for the results file) and, for a lasting fault, the action
that ends it; the campaign's loop calls that at `fault.at + fault.seconds`. A fault that finds
nothing to strike (its host is down, no checkpoint is committed yet) says so and is counted as
not struck.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path

from engine.checkpoint import manifest as mf
from testkit.chaos.cluster import Cluster, Host
from testkit.chaos.schedule import Fault

PREEMPTION_NOTICE_S = 30.0  # GCE deletes a preempted VM about 30 s after the notice
ROLLOUT_GAP_S = 2.0         # between two hosts' copies of an edited job file


class Struck:
    """What a fault did, and what ends it: (when, action) pairs, each action saying what it did."""

    def __init__(self, what: str, *later: tuple[float, Callable[[], str]]):
        self.what, self.later = what, list(later)

    @property
    def struck(self) -> bool:
        return not self.what.startswith("not struck")


class Injector:
    def __init__(self, cluster: Cluster, job_text: Callable[[int], str]):
        """job_text(variant): the job file, in one of two harmless variants (job_edit flips them)."""
        self.cluster, self.job_text = cluster, job_text
        self.variant = 0
        self.gone: set[int] = set()  # hosts away (lost, preempted) until their undo brings them back
        self.full: dict[int, str] = {}  # host -> the ballast file that fills its disk

    def strike(self, fault: Fault, now: float) -> Struck:
        host = self.cluster.hosts[fault.host]
        if fault.kind in ("gcs_down", "gcs_slow", "job_edit"):
            return getattr(self, fault.kind)(fault, now)
        if fault.host in self.gone or not host.up:
            return Struck("not struck: the host is down")
        return getattr(self, fault.kind)(fault, host, now)

    # --- processes ---

    def worker_kill(self, fault: Fault, host: Host, now: float) -> Struck:
        pid = host.worker()
        if pid is None:
            return Struck("not struck: no worker running")
        _kill(pid, signal.SIGKILL)
        return Struck(f"SIGKILL worker {pid}")

    def daemon_kill(self, fault: Fault, host: Host, now: float) -> Struck:
        pid, tree = host.proc.pid, host.processes()
        host.proc.send_signal(signal.SIGKILL)
        host.proc.wait()
        for child in tree:  # stopped, they would not act on their parent's death until continued
            _kill(child, signal.SIGCONT)
        host.stopped = False
        self.gone.add(fault.host)
        return Struck(f"SIGKILL daemon {pid}", (now + fault.seconds, lambda: self._back(host, blank=False)))

    def host_loss(self, fault: Fault, host: Host, now: float) -> Struck:
        host.kill()
        host.wipe()
        self._free(host)
        self.gone.add(fault.host)
        if fault.detail.get("never_back"):
            return Struck("every process SIGKILLed, disk and memory wiped; never back")
        return Struck("every process SIGKILLed, disk and memory wiped",
                      (now + fault.seconds, lambda: self._back(host, blank=True)))

    def preemption(self, fault: Fault, host: Host, now: float) -> Struck:
        host.metadata.set("instance/preempted", "TRUE")

        def deleted() -> str:
            host.kill()
            host.wipe()
            self._free(host)
            return "the VM deleted"

        self.gone.add(fault.host)
        return Struck("preempted=TRUE", (now + PREEMPTION_NOTICE_S, deleted),
                      (now + max(fault.seconds, PREEMPTION_NOTICE_S + 5), lambda: self._back(host, blank=True)))

    def _back(self, host: Host, blank: bool) -> str:
        if blank:
            host.wipe()
        host.start()
        self.gone.discard(host.index)
        return "started again" + (" blank" if blank else "")

    def host_stop(self, fault: Fault, host: Host, now: float) -> Struck:
        host.signal(signal.SIGSTOP)
        host.stopped = True

        def cont() -> str:
            host.signal(signal.SIGCONT)
            host.stopped = False
            return "SIGCONT"

        return Struck("SIGSTOP every process", (now + fault.seconds, cont))

    def slow_host(self, fault: Fault, host: Host, now: float) -> Struck:
        pid = host.worker()
        if pid is None:
            return Struck("not struck: no worker running")
        done = threading.Event()

        def throttle() -> None:
            while not done.is_set() and _kill(pid, signal.SIGSTOP):
                done.wait(0.1)
                _kill(pid, signal.SIGCONT)
                done.wait(0.1)

        threading.Thread(target=throttle, daemon=True).start()

        def end() -> str:
            done.set()
            _kill(pid, signal.SIGCONT)
            return "full speed"

        return Struck(f"worker {pid} at 50 % duty", (now + fault.seconds, end))

    # --- storage ---

    def full_disk(self, fault: Fault, host: Host, now: float) -> Struck:
        if not host.tmpfs:
            return Struck("not struck: the state directory is no tmpfs of its own (not root)")
        ballast = host.paths.state / ".chaos-ballast"
        with open(ballast, "wb", buffering=0) as f:
            for block in (b"\0" * (1 << 20), b"\0" * 4096):  # to the last page
                try:
                    while True:
                        f.write(block)
                except OSError:
                    pass
        self.full[host.index] = str(ballast)
        return Struck("state file system full", (now + fault.seconds, lambda: self._free(host) or "freed"))

    def _free(self, host: Host) -> None:
        if host.index in self.full:
            Path(self.full.pop(host.index)).unlink(missing_ok=True)

    def corrupt_checkpoint(self, fault: Fault, host: Host, now: float) -> Struck:
        committed = mf.committed_steps(host.checkpoints())
        if not committed:
            return Struck("not struck: no committed checkpoint")
        _, path, manifest = committed[int(fault.detail["pick"] * len(committed))]
        files = sorted(entry.path for entry in manifest.files if entry.size > 0)
        if not files:
            return Struck("not struck: an empty checkpoint")
        target = path / files[int(fault.detail["offset"] * len(files))]
        size = target.stat().st_size
        if fault.detail["how"] == "truncate":
            with open(target, "r+b") as f:
                f.truncate(size // 2)
        else:
            with open(target, "r+b") as f:
                f.seek(int(fault.detail["offset"] * size))
                byte = f.read(1)
                f.seek(-1, 1)
                f.write(bytes([byte[0] ^ 0x10]))
        return Struck(f"{fault.detail['how']} {target.relative_to(host.home)}")

    # --- outside services ---

    def gcs_down(self, fault: Fault, now: float) -> Struck:
        self._thaw_gcs()
        self.cluster.gcs.stop()
        return Struck("GCS server stopped", (now + fault.seconds, self._gcs_up))

    def _gcs_up(self) -> str:
        if self.cluster.gcs.running:
            return "GCS server already up"
        self.cluster.gcs.start()
        return "GCS server started"

    def gcs_slow(self, fault: Fault, now: float) -> Struck:
        gcs = self.cluster.gcs
        if gcs.proc is None or self.cluster.gcs_frozen:
            return Struck("not struck: the GCS server is down or frozen")
        gcs.proc.send_signal(signal.SIGSTOP)
        self.cluster.gcs_frozen = True
        return Struck("GCS server frozen", (now + fault.seconds, lambda: self._thaw_gcs() or "GCS server thawed"))

    def _thaw_gcs(self) -> None:
        if self.cluster.gcs_frozen and self.cluster.gcs.proc is not None:
            self.cluster.gcs.proc.send_signal(signal.SIGCONT)
        self.cluster.gcs_frozen = False

    def maintenance(self, fault: Fault, host: Host, now: float) -> Struck:
        host.metadata.set("instance/maintenance-event", "MIGRATE_ON_HOST_MAINTENANCE")
        return Struck("maintenance-event=MIGRATE_ON_HOST_MAINTENANCE",
                      (now + fault.seconds,
                       lambda: host.metadata.set("instance/maintenance-event", "NONE") or "maintenance over"))

    def job_edit(self, fault: Fault, now: float) -> Struck:
        """The job file edited on every host, one after another from the fault's host, as an
        operator's copy loop does: for a few seconds the gang's hosts hold different versions."""
        self.variant ^= 1
        variant, how, count = self.variant, fault.detail.get("how"), len(self.cluster.hosts)
        order = [(fault.host + i) % count for i in range(count)]

        def copy(index: int) -> str:
            if self.variant != variant:  # a newer edit is rolling out: it reaches this host too
                return f"host {index}: superseded by a newer edit"
            self.cluster.write_job(self.job_text(variant), self.cluster.hosts[index], replace=how == "replace")
            return f"copied to host {index}"

        copy(order[0])
        return Struck(f"job file variant {variant}, {how}, host {order[0]} first",
                      *[(now + ROLLOUT_GAP_S * i, lambda index=index: copy(index)) for i, index in enumerate(order[1:], 1)])

    def heal(self) -> list[str]:
        """Everything undone that still lasts (the campaign's end): every host up, GCS up."""
        done = []
        self._thaw_gcs()
        if not self.cluster.gcs.running:
            self.cluster.gcs.start()
            done.append("GCS server started")
        for host in self.cluster.hosts:
            self._free(host)
            if host.stopped:
                host.signal(signal.SIGCONT)
                host.stopped = False
                done.append(f"host {host.index} SIGCONT")
            if not host.up:
                done.append(f"host {host.index} {self._back(host, blank=True)}")
            host.metadata.set("instance/maintenance-event", "NONE")
        return done


def _kill(pid: int, signum: int) -> bool:
    try:
        os.kill(pid, signum)
        return True
    except ProcessLookupError:
        return False
