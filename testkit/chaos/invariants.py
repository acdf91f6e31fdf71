"""The invariants a campaign checks, from what a user can read: `tpud status` over the control
socket, the daemons' logs (their workers' records relayed), the process table, the checkpoint
directories and GCS. Each violation is kept with its time, host and the faults around it.

While it runs (probe, every few seconds, and every new log record):
- commit_lost: a worker resumed (a restore, a state taken from a peer) below the newest global
  commit seen before, other than by a data rollback (the skip ledger: the states after the one a
  rollback restored may not be restored again);
- status_slow: a live, running host's status unanswered or slower than 1 s;
- processes: a host running more than one worker or coordinator of the job;
- replica_mismatch: replicas found to differ with no bit flip (or host spike, whose replay names
  a replica) injected shortly before;
- failed: the job FAILED on a host neither left out of the gang (quarantined, evicted) nor out
  of a budget (restarts, rollbacks): judged by the campaign's operator (campaign.py);
- stalled: no host trained past the newest step any had trained for STALL_BOUND_S while faults
  struck (a gang stuck while a quorum of hosts lives: the job would finish once they stop, so
  `unfinished` alone passed chaos-12's 20 minutes stuck).
At the end (every daemon stopped with SIGTERM):
- checksum: a committed checkpoint on a host's disk or in GCS that does not read back whole
  (those a corrupt_checkpoint fault damaged left out);
- replicas_differ: a step committed on several hosts, not bitwise the same on all (less each
  host's data rank);
- leaked: a process of the campaign still alive, a temporary file or directory left behind;
- memory: a daemon whose memory grew past twice its first size plus 64 MiB;
- unfinished: the job not finished on every host after the faults stopped, with no clear reason.
"""

from __future__ import annotations

import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from engine.checkpoint import manifest as mf
from testkit.chaos.cluster import JOB, REMOTE, Cluster, Host
from testkit.helpers import children_by_kind

STATUS_BOUND_S = 1.0
STARTUP_GRACE_S = 20.0  # a daemon just started (imports, first listen) is not yet expected to answer
FLIP_EXPLAINS_S = 120.0
MEMORY_SLACK = 64 << 20
ROLLBACK_SETTLES_S = 30.0
# Three times the longest recovery of any healthy campaign (chaos-1's 110 s; faults last at most
# 80 s, and the gang needs only min_hosts of its hosts).
STALL_BOUND_S = 300.0
STALL_CAUSE_S = 60.0  # a stall's faults are those around its first minute, not its last (chaos-13's were none)


@dataclass
class Violation:
    invariant: str
    t: float            # seconds from the campaign's start
    host: int | None
    detail: str
    faults: list[str] = field(default_factory=list)  # struck within a minute before, or still lasting


class Checker:
    def __init__(self, cluster: Cluster, t0: float, faults_around):
        """faults_around(t): labels of the faults struck shortly before `t` or lasting at it."""
        self.cluster, self.t0, self.faults_around = cluster, t0, faults_around
        self.violations: list[Violation] = []
        self.global_commit = 0            # the newest step committed on every member, seen so far
        self.awaiting: dict[int, int] = {}  # host -> the global commit when its worker started, until its first step
        self.rollback = (0, 0.0)          # the newest data rollback's restored step, and when
        self.flips: list[float] = []      # when bit flips (and host spikes) were injected
        self.mismatches: list[tuple[float, int, str]] = []  # replica mismatches not yet judged
        self.rss: dict[int, list[int]] = {}
        self.status_s: list[float] = []
        self.damaged: set[Path] = set()   # checkpoint files a fault damaged on purpose
        self.failures: list[dict] = []    # job state FAILED records
        self.steps: dict[int, list[tuple[float, int, float]]] = {}  # host -> (t, step, loss) of every step record
        self.newest = (0, t0)             # the newest step any host trained, and when it was first trained
        self.stalled_since: float | None = None  # the newest step's time when a stall was last reported
        self.verified: set[Path] = set()  # committed step directories read back whole
        # How often each invariant was actually checked: one never checked proves nothing.
        self.checked: Counter = Counter()

    def violate(self, invariant: str, host: int | None, detail: str, at: float | None = None,
                caused_at: float | None = None) -> None:
        """caused_at: where to look for the faults around it, when not at its own time."""
        t = (at if at is not None else time.time()) - self.t0
        cause = t if caused_at is None else caused_at - self.t0
        self.violations.append(Violation(invariant, round(t, 1), host, detail[:800], self.faults_around(cause)))

    # --- while it runs ---

    def probe(self, live: list[Host]) -> None:
        now = time.time()
        self._stalled(now)
        newest = max(newest_global(h) for h in self.cluster.hosts)
        restored, at = self.rollback
        if newest <= restored or now - at > ROLLBACK_SETTLES_S:  # until every host set the undone ones aside
            self.global_commit = max(self.global_commit, newest)
        for h in live:
            if h.stopped or now - h.started_at < STARTUP_GRACE_S:
                continue
            row, seconds = h.status()
            if row is None:
                self.violate("status_slow", h.index, f"no status answer in {seconds:.2f} s")
                continue
            self.status_s.append(seconds)
            if seconds > STATUS_BOUND_S:
                self.violate("status_slow", h.index, f"status answered in {seconds:.2f} s")
            if (rss := h.rss_bytes()) is not None:
                self.rss.setdefault(h.index, []).append(rss)
            kinds = children_by_kind(h.proc.pid)
            self.checked["status"] += 1
            self.checked["processes"] += 1
            if len(kinds.get("worker", [])) > 1 or len(kinds.get("coordinator", [])) > 1:
                self.violate("processes", h.index, f"processes: {kinds}")
        for h in self.cluster.hosts:
            self._verify_new(h)
        self._mismatches(before=now - 10.0)

    def _stalled(self, now: float) -> None:
        """Once per stall: the newest step trained is older than the bound."""
        step, since = self.newest
        self.checked["stalled"] += 1
        if now - since > STALL_BOUND_S and self.stalled_since != since:
            self.stalled_since = since
            self.violate("stalled", None, f"no host trained past step {step} for {STALL_BOUND_S:.0f} s (since "
                         f"{since - self.t0:.1f} s)", at=since + STALL_BOUND_S,
                         caused_at=since + STALL_CAUSE_S)

    def _mismatches(self, before: float) -> None:
        """Replicas found to differ: each explained by a fault injected on some host shortly before."""
        for at, host, event in [m for m in self.mismatches if m[0] <= before]:
            self.mismatches.remove((at, host, event))
            self.checked["replica_mismatch"] += 1
            if not any(-5.0 <= at - t <= FLIP_EXPLAINS_S for t in self.flips):
                self.violate("replica_mismatch", host, f"{event} with no bit flip or host spike injected before", at)

    def _verify_new(self, h: Host) -> None:
        """Each committed step directory read back once, while it is there (retention may take it)."""
        try:
            committed = mf.committed_steps(h.checkpoints())
        except OSError:
            return
        for _, path, manifest in committed:
            if path in self.verified or any(path in d.parents for d in self.damaged):
                continue
            try:
                found = mf.problems(path, manifest, checksums=True)
            except OSError:
                continue
            if not path.is_dir():  # deleted while read: retention, not damage
                continue
            self.verified.add(path)
            self.checked["checksum"] += 1
            if found:
                self.violate("checksum", h.index, f"{path.relative_to(h.home)}: {'; '.join(found)[:300]}")

    def record(self, host: Host, r: dict) -> None:
        """One new log record of a host."""
        event = r.get("event")
        if event == "step" and r.get("job") == JOB:
            self.steps.setdefault(host.index, []).append((r["_t"], r["step"], r.get("loss")))
            if r["step"] > self.newest[0]:
                self.newest = (r["step"], r["_t"])
            if (floor := self.awaiting.pop(host.index, None)) is not None:
                self.checked["commit_lost"] += 1
            if floor is not None and r["step"] - 1 < floor:
                self.violate("commit_lost", host.index, f"trained step {r['step']} after a start, below the global "
                             f"commit {floor} seen before it", r["_t"])
        elif event == "rolled back":
            if r.get("verdict") == "data":  # the skip ledger: the states after the one restored are undone
                self.rollback = (r["restored_step"], r["_t"])
                self.global_commit = min(self.global_commit, r["restored_step"])
        elif event == "trainer ready" and r.get("job") == JOB:
            # Its first step says where it resumed, from a checkpoint or (joining) from a peer's state.
            self.awaiting[host.index] = self.global_commit
        elif event in ("injected bit flip", "injected host spike"):  # a spike's replay names a replica too
            self.flips.append(r["_t"])
        elif event and event.startswith("replica mismatch"):
            self.mismatches.append((r["_t"], host.index, event))  # judged once every host's log is read
        elif event == "job state" and r.get("state") == "FAILED":
            self.failures.append({"host": host.index, "t": round(r["_t"] - self.t0, 1), "reason": r.get("reason")})

    # --- at the end ---

    def final(self, scratch: Path) -> None:
        self._mismatches(before=float("inf"))
        self._checksums()
        self._gcs()
        self._replicas(scratch)
        self._memory()

    def _checksums(self) -> None:
        self.verified.clear()  # every one there now, read back again
        for h in self.cluster.hosts:
            self._verify_new(h)

    def _gcs(self) -> None:
        from tpud.gcs.tier import GcsTier, RemoteError

        tier = GcsTier(REMOTE, JOB, client=self.cluster.gcs.client())
        with tempfile.TemporaryDirectory() as scratch:
            for remote in tier.committed_steps():
                try:
                    path = tier.download_step(remote.step, Path(scratch) / str(remote.step), remote.micro_step)
                except (RemoteError, OSError) as e:
                    self.violate("checksum", None, f"gs step {remote.step}: {e}")
                    continue
                manifest = mf.read_manifest(path)
                self.checked["checksum_gcs"] += 1
                if manifest is None or (found := mf.problems(path, manifest, checksums=True)):
                    self.violate("checksum", None, f"gs step {remote.step}: {found if manifest else 'no manifest'}")

    def _replicas(self, scratch: Path) -> None:
        from testkit.states import checkpoint_state, differences

        by_step: dict[int, list[tuple[Host, Path]]] = {}
        for h in self.cluster.hosts:
            for step, path, manifest in mf.committed_steps(h.checkpoints()):
                if manifest.micro_step == 0 and mf.is_global(path, manifest):
                    by_step.setdefault(step, []).append((h, path))
        for step, copies in sorted(by_step.items()):
            if len(copies) < 2 or any(p in d.parents for _, p in copies for d in self.damaged):
                continue
            states = [checkpoint_state(path, scratch) for _, path in copies]
            for state in states:
                state.get("loader", {}).pop("rank", None)
            self.checked["replicas"] += 1
            for (h, _), state in zip(copies[1:], states[1:]):
                if found := differences(states[0], state):
                    self.violate("replicas_differ", h.index, f"step {step}: host {copies[0][0].index} vs host "
                                 f"{h.index}: {'; '.join(found[:5])}")

    def _memory(self) -> None:
        for index, samples in self.rss.items():
            if len(samples) > 2 and max(samples) > 2 * samples[0] + MEMORY_SLACK:
                self.violate("memory", index, f"daemon RSS {samples[0] >> 20} MiB at first, {max(samples) >> 20} "
                             "MiB at most")

    def leaks(self, marker: str, exclude: set[int]) -> None:
        """Processes whose environment names this campaign (`marker`), temporary files left behind."""
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) in exclude:
                continue
            try:
                environ = (entry / "environ").read_bytes()
                command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if marker.encode() in environ:
                self.violate("leaked", None, f"process {entry.name} still alive: {command[:200]}")
        for h in self.cluster.hosts:
            for path in h.paths.state.rglob("*"):
                if path.name.startswith(".tmp-") or (path.name.startswith(".") and path.name.endswith(".tmp")):
                    self.violate("leaked", h.index, f"temporary {path.relative_to(h.home)} left behind")



def newest_global(h: Host) -> int:
    """The newest step committed globally (every member's part there) in a host's local tier."""
    try:
        steps = mf.committed_steps(h.checkpoints())
    except OSError:
        return 0
    return max((step for step, path, m in steps if m.micro_step == 0 and mf.is_global(path, m)), default=0)


def longest_stall(steps: dict[int, list[tuple[float, int, float]]], start: float, until: float) -> float:
    """The longest time from `start` to `until` in which no host trained past the newest step any
    had trained (the `stalled` invariant's figure), from each host's (t, step, loss) records."""
    marks, top = [start], 0
    for at, step, _ in sorted(r for records in steps.values() for r in records):
        if step > top and at <= until:
            marks.append(at)
            top = step
    marks.append(until)
    return round(max(b - a for a, b in zip(marks, marks[1:])), 1)


def as_dicts(violations: list[Violation]) -> list[dict]:
    return [asdict(v) for v in violations]
