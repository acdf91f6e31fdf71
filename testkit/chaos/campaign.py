"""One chaos campaign: the cluster up, its schedule of faults struck and ended on time while the
invariants are checked, then every fault healed, the job run to its end, every daemon stopped,
and the end's invariants checked. What it returns is the results file's content.

An operator acts as one would on a real fleet, and the results say when: a daemon that died by
itself is started again (systemd's Restart=always; the death is a violation); 20 s after a job
FAILED on a host, a host left out of the gang (its replica quarantined or evicted) is replaced by
a blank one, and a job that spent a budget (restarts, rollbacks) is started again (`tpud start`);
one that FAILED for another reason is started again too, and that is a violation.
"""

from __future__ import annotations

import heapq
import os
import shutil
import signal
import statistics
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from testkit.chaos import reference
from testkit.chaos import schedule as sch
from testkit.chaos.cluster import JOB, Cluster, Host, job_text
from testkit.chaos.faults import Injector
from testkit.chaos.invariants import Checker, as_dicts, longest_stall

REPLACE_FAILED_AFTER_S = 20.0
AROUND_S = 60.0
# The workers' records of the stepped faults firing (engine/health/faults.py), by schedule kind.
FIRED = {"injected bit flip": "bit_flip", "injected spike": "data_spike", "injected host spike": "host_spike"}


@dataclass
class Options:
    seed: int = 0
    duration_s: float = 1800.0
    hosts: int = 4
    min_hosts: int = 2
    every_s: float = 30.0       # a fault about this often
    steps_per_s: float = 12.0   # the gang's expected pace, to place the stepped faults
    kinds: tuple[str, ...] = tuple(sch.KINDS)
    schedule: list[sch.Fault] | None = None  # run this one instead of drawing it from the seed
    probe_s: float = 5.0
    settle_timeout_s: float = 300.0
    finish_steps: int = 30      # trained after the faults stop, to end the job
    keep: Path | None = None    # keep the cluster's files here
    keep_violating: bool = True  # without `keep`, a campaign that violated keeps them in a temporary directory
    reference: bool = True      # hold the loss curve to a run with nothing struck
    reference_steps: int | None = None  # ...over its first this many steps (None: all of them)
    stop_on: str | None = None  # end at this invariant's first violation, before the end's (a minimiser's try)
    say: Callable[[str], None] = print


def run(opts: Options) -> dict:
    faults = opts.schedule if opts.schedule is not None else sch.draw(
        opts.seed, opts.duration_s, opts.hosts, every_s=opts.every_s, steps_per_s=opts.steps_per_s, kinds=opts.kinds)
    inject = sch.inject_section(faults)
    root = Path(tempfile.mkdtemp(prefix="tpud-chaos-"))
    cluster = Cluster(root, opts.hosts, opts.min_hosts, tmpfs=True)
    result: dict = {}
    try:
        result = Campaign(opts, cluster, faults, inject).run()
        return result
    finally:
        cluster.close()
        keep = opts.keep
        try:
            # A campaign's violation is kept without being asked: its logs are what a diagnosis reads,
            # and a replay may not strike it again (chaos-12's stall did not).
            if keep is None and result.get("violations") and opts.keep_violating:
                keep = Path(tempfile.mkdtemp(prefix="tpud-chaos-kept-"))
            if keep is not None:
                shutil.copytree(root, keep, dirs_exist_ok=True, ignore=shutil.ignore_patterns("gcs", "*.sock"))
                result["kept"] = str(keep)
                opts.say(f"the cluster's files (daemon logs, state) are kept in {keep}")
        except OSError as e:  # a full disk there loses the copy, never the campaign's results
            opts.say(f"could not keep the cluster's files in {keep}: {e}")
        finally:
            shutil.rmtree(root, ignore_errors=True)


def left_out(row: dict) -> bool:
    """Whether the job FAILED on this host because the host itself is left out of the gang (its
    replica quarantined, or evicted as a straggler): never retried there, so the host is replaced."""
    error = row.get("error") or ""
    return bool((row.get("replicas") or {}).get("quarantined")) or "quarantined" in error or "evicted" in error


def budget_spent(why: str) -> bool:
    """Whether a job FAILED (`why`: its state's reason and its error) because the faults spent one
    of its budgets: its restarts (restart.max_restarts) or its rollbacks (health.max_rollbacks)."""
    return any(said in why for said in ("restart budget spent", "health.max_rollbacks", "rollbacks spent"))


class Campaign:
    def __init__(self, opts: Options, cluster: Cluster, faults: list[sch.Fault], inject: dict):
        self.opts, self.cluster, self.faults, self.inject = opts, cluster, faults, inject
        self.injector = Injector(cluster, self.job)
        self.entries: list[dict] = []   # one per timed fault struck: what it did, what ended it
        self.operator: list[dict] = []  # what the operator did (restarts, replacements)
        self.pending: list = []         # (time from t0, seq, action, entry)
        self.t0 = time.time()
        self.checker = Checker(cluster, self.t0, self.around)
        self.failed_since: dict[int, float] = {}
        self.loss: dict | None = None

    def job(self, variant: int, max_steps: int = 100_000_000) -> str:
        return job_text(self.inject, max_steps=max_steps, interval_steps=(20, 25)[variant])

    def now(self) -> float:
        return time.time() - self.t0

    def around(self, t: float) -> list[str]:
        return [e["fault"] for e in self.entries
                if e["struck"] and (0 <= t - e["t"] <= AROUND_S or e["t"] <= t <= e.get("until", e["t"]))]

    # --- the campaign ---

    def run(self) -> dict:
        try:
            return self._run()
        except KeyboardInterrupt:  # Ctrl-C, or SIGTERM (bench/chaos.py): what was found so far is kept
            return self.stopped("interrupted")

    def _run(self) -> dict:
        self.cluster.write_job(self.job(0))
        for h in self.cluster.hosts:
            h.start()
        timed = [f for f in self.faults if f.at is not None]
        self.opts.say(f"chaos seed {self.opts.seed}: {len(timed)} timed faults and "
                      f"{len(self.faults) - len(timed)} at steps over {self.opts.duration_s:.0f} s on "
                      f"{self.opts.hosts} hosts ({self.cluster.root})")
        next_probe = 0.0
        while self.now() < self.opts.duration_s:
            while timed and timed[0].at <= self.now():
                self.strike(timed.pop(0))
            self.due(self.now())
            self.read()
            if self.now() >= next_probe:
                self.checker.probe([h for h in self.cluster.hosts if h.up and h.index not in self.injector.gone])
                self.tend()
                next_probe = self.now() + self.opts.probe_s
            if self.opts.stop_on is not None and self.opts.stop_on in {v.invariant for v in self.checker.violations}:
                return self.stopped(f"{self.opts.stop_on} violated")
            time.sleep(0.2)
        return self.finish()

    def stopped(self, why: str) -> dict:
        """What a campaign ended early found (a minimiser's try at its target's first violation, or
        an interrupted one): the cluster is then torn down, and nothing at the end is checked."""
        self.opts.say(f"  {self.now():7.1f}s  {why}: the campaign ends here")
        return {"seed": self.opts.seed, "hosts": self.opts.hosts, "duration_s": self.opts.duration_s,
                "schedule": sch.to_json(self.faults), "struck": self.entries, "operator": self.operator,
                "stopped": why, "stopped_at_s": round(self.now(), 1),
                "violations": as_dicts(self.checker.violations),
                "violations_per_invariant": dict(Counter(v.invariant for v in self.checker.violations))}

    def strike(self, fault: sch.Fault) -> None:
        struck = self.injector.strike(fault, self.now())
        entry = {"fault": fault.label(), "kind": fault.kind, "host": fault.host, "t": round(self.now(), 1),
                 "did": struck.what, "struck": struck.struck, "ended": []}
        if fault.kind == "corrupt_checkpoint" and struck.struck:
            self.checker.damaged.add(self.cluster.hosts[fault.host].home / struck.what.split(" ", 1)[1])
        for at, action in struck.later:
            heapq.heappush(self.pending, (at, len(self.entries), id(action), action, entry))
            entry["until"] = max(entry.get("until", 0), round(at, 1))
        self.entries.append(entry)
        self.opts.say(f"  {entry['t']:7.1f}s  {fault.label():44s} {struck.what}")

    def due(self, until: float) -> None:
        while self.pending and self.pending[0][0] <= until:
            _, _, _, action, entry = heapq.heappop(self.pending)
            entry["ended"].append({"t": round(self.now(), 1), "did": action()})

    def read(self) -> None:
        for h in self.cluster.hosts:
            for record in h.log.read():
                self.checker.record(h, record)

    def tend(self) -> None:
        """The operator: a daemon that died by itself started again; a host whose job failed there replaced."""
        for h in self.cluster.hosts:
            if h.index in self.injector.gone:
                continue
            if h.proc is not None and h.proc.poll() is not None:
                tail = [r.get("event") for r in h.log.records[-5:]]
                self.checker.violate("daemon_died", h.index, f"daemon exited {h.proc.returncode}; last: {tail}")
                self.act(h, f"daemon exited {h.proc.returncode}: started again", blank=False)
                continue
            row, _ = h.status() if h.up and not h.stopped else (None, 0)
            if row and row.get("state") == "INVALID":  # the campaign's own mistake: nothing to learn from going on
                raise RuntimeError(f"host {h.index}: the job file is invalid: {row.get('error')}")
            if row and row.get("state") == "FAILED":
                since = self.failed_since.setdefault(h.index, self.now())
                if self.now() - since < REPLACE_FAILED_AFTER_S:
                    continue
                why = f"job FAILED ({(row.get('error') or 'no error given')[:160]})"
                if left_out(row):
                    self.act(h, f"{why}: host replaced blank", blank=True)
                else:  # a budget spent (restarts, rollbacks): looked at, then started again
                    said = [f["reason"] or "" for f in self.checker.failures if f["host"] == h.index][-1:]
                    if not budget_spent(" ".join([*said, row.get("error") or ""])):
                        self.checker.violate("failed", h.index, f"{why}, with no budget spent: {said}")
                    self.failed_since.pop(h.index, None)
                    self.operator.append({"t": round(self.now(), 1), "host": h.index,
                                          "did": f"{why}: tpud start: {h.start_job()}"})
                    self.opts.say(f"  {self.now():7.1f}s  operator: host {h.index} {self.operator[-1]['did']}")
            else:
                self.failed_since.pop(h.index, None)

    def act(self, h: Host, what: str, blank: bool) -> None:
        h.kill()
        if blank:
            h.wipe()
        h.start()
        self.failed_since.pop(h.index, None)
        self.operator.append({"t": round(self.now(), 1), "host": h.index, "did": what})
        self.opts.say(f"  {self.now():7.1f}s  operator: host {h.index} {what}")

    # --- the end ---

    def finish(self) -> dict:
        faults_end = self.now()
        self.due(float("inf"))
        healed = self.injector.heal()
        self.opts.say(f"  {self.now():7.1f}s  faults over; healed: {', '.join(healed) or 'nothing left'}")
        settled = self.settle()
        top = max((s for records in self.checker.steps.values() for _, s, _ in records), default=0)
        final_steps = top + self.opts.finish_steps
        self.cluster.write_job(self.job(self.injector.variant, max_steps=final_steps))
        finished = self.wait_finished(final_steps)
        rows = {h.index: (h.status()[0] or {}) for h in self.cluster.hosts}
        self.stop_daemons()
        self.read()
        with tempfile.TemporaryDirectory() as scratch:
            self.checker.final(Path(scratch))
        exclude = {self.cluster.gcs.proc.pid} if self.cluster.gcs.proc else set()
        self.checker.leaks(self.cluster.gcs.url, exclude | {os.getpid()})
        skip = self.skip_ledger()
        self.loss = self.against_reference(final_steps, skip) if self.opts.reference and finished and skip is not None \
            else None
        return self.results(faults_end, settled, finished, final_steps, rows)

    def skip_ledger(self) -> list[list[int]] | None:
        """The samples the hosts' skip ledgers left out at the end; each host's must cover the same."""
        try:
            skip, per_host = reference.ledger({h.index: h.paths.layout.skips_file(JOB) for h in self.cluster.hosts
                                               if h.index not in self.injector.gone})
        except ValueError as e:
            self.checker.violate("replicas_differ", None, str(e))
            return None
        if len(set(per_host.values())) > 1:
            self.checker.violate("replicas_differ", None, "the hosts' skip ledgers cover other samples at the end: "
                                 + "; ".join(f"host {h}: {list(map(list, r))}" for h, r in per_host.items()))
        return skip

    def against_reference(self, final_steps: int, skip: list[list[int]]) -> dict | None:
        """The loss curve against the reference run's (testkit/chaos/reference.py), fed the skip
        ledger the campaign's hosts ended with."""
        steps = min(final_steps, self.opts.reference_steps or final_steps)  # the lr is constant: max_steps is free
        text = job_text({}, max_steps=steps, interval_steps=(20, 25)[self.injector.variant], remote=None, skip=skip)
        self.opts.say(f"  {self.now():7.1f}s  the reference run: {steps} steps, nothing struck, "
                      f"{sum(count for _, count in skip)} samples skipped as the campaign's ledger says")
        try:
            theirs = reference.losses(text, self.cluster.root / "reference", timeout=120 + steps)
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            self.checker.violate("loss_curve", None, f"the reference run failed: {e}")
            return None
        found = reference.compare(reference.lineage(self.checker.steps), theirs)
        found["skipped"] = skip
        if not found["within"]:
            self.checker.violate("loss_curve", None, f"window {found['worst_window']}: mean loss "
                                 f"{found['max_rel_diff']:.2%} from the reference's (bound {reference.BOUND:.0%})")
        return found

    def settle(self) -> float | None:
        """Every host a member again and training: seconds it took, None if it never was."""
        started = self.now()
        top = self.top_step()
        while self.now() - started < self.opts.settle_timeout_s:
            self.read()
            self.tend()
            rows = [h.status()[0] for h in self.cluster.hosts]
            if all(r and r.get("state") == "RUNNING" and (r.get("step") or 0) > top
                   and not (r.get("gang") or {}).get("missing") for r in rows):
                return round(self.now() - started, 1)
            time.sleep(1.0)
        self.unfinished(f"the gang did not settle in {self.opts.settle_timeout_s:.0f} s")
        return None

    def top_step(self) -> int:
        return max((s for records in self.checker.steps.values() for _, s, _ in records), default=0)

    def wait_finished(self, final_steps: int) -> bool:
        deadline = self.now() + self.opts.settle_timeout_s + 5 * self.opts.finish_steps
        while self.now() < deadline:
            self.read()
            self.tend()
            states = [(h.status()[0] or {}).get("state") for h in self.cluster.hosts]
            if all(s == "SUCCEEDED" for s in states):
                return True
            time.sleep(1.0)
        self.unfinished(f"not every host finished step {final_steps}; failures: {self.checker.failures[-3:]}")
        return False

    def unfinished(self, what: str) -> None:
        """The violation, with what an operator would look at on each host: its job's row in `tpud
        status` and the daemon's last events (said in full too: the violation keeps 800 characters)."""
        hosts = []
        for h in self.cluster.hosts:
            row = h.status()[0] or {}
            last = [r.get("event") for r in h.log.records[-4:]]
            hosts.append(f"host {h.index}: {row.get('state')} at step {row.get('step')} (error {row.get('error')!r}, "
                         f"gang {(row.get('gang') or {}).get('state')!r}); last: {last}")
        self.opts.say(f"  {self.now():7.1f}s  unfinished: {what}\n" + "\n".join(f"    {line}" for line in hosts))
        self.checker.violate("unfinished", None, f"{what}: {' | '.join(hosts)}")

    def stop_daemons(self) -> None:
        for h in self.cluster.hosts:
            if h.up:
                h.proc.send_signal(signal.SIGTERM)
        for h in self.cluster.hosts:
            if h.proc is None:
                continue
            try:
                h.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.checker.violate("leaked", h.index, "the daemon did not stop within 60 s of SIGTERM")
                h.kill()

    def results(self, faults_end: float, settled, finished: bool, final_steps: int, rows: dict) -> dict:
        struck = [e for e in self.entries if e["struck"]]
        seen = {(FIRED[r["event"]], r.get("step"), r.get("rank"), r.get("element"))
                for h in self.cluster.hosts for r in h.log.records if r.get("event") in FIRED}
        fired = Counter(kind for kind, *_ in seen)  # once each, however often replayed
        recovery: dict[str, list[float]] = {}
        for e in struck:
            if (s := self.resumed_after(self.t0 + e["t"])) is not None:
                recovery.setdefault(e["kind"], []).append(s)
                e["recovered_s"] = s  # each fault's own, beside the per-kind figures
        redone = {h: len(records) - len({s for _, s, _ in records}) for h, records in self.checker.steps.items()}
        goodputs = [((row.get("goodput") or {}).get("ratio")) for row in rows.values()]
        return {
            "seed": self.opts.seed, "hosts": self.opts.hosts, "min_hosts": self.opts.min_hosts,
            "duration_s": self.opts.duration_s, "faults_end_s": round(faults_end, 1),
            "schedule": sch.to_json(self.faults), "inject": self.inject, "struck": self.entries,
            "operator": self.operator,
            "faults_per_kind": dict(Counter(e["kind"] for e in struck)),
            "not_struck": dict(Counter(e["kind"] for e in self.entries if not e["struck"])),
            "stepped_fired": dict(fired),
            "violations": as_dicts(self.checker.violations),
            "violations_per_invariant": dict(Counter(v.invariant for v in self.checker.violations)),
            "checked": dict(self.checker.checked),
            "settled_s": settled, "finished": finished, "final_steps": final_steps,
            "goodput": [round(g, 4) if g is not None else None for g in goodputs],
            "steps_redone": redone,
            "longest_stall_s": longest_stall(self.checker.steps, self.t0, self.t0 + faults_end),
            "recovery_s": {k: {"n": len(v), "median": round(statistics.median(v), 2), "max": round(max(v), 2)}
                           for k, v in sorted(recovery.items())},
            "status_s": {"n": len(self.checker.status_s),
                         "median": round(statistics.median(self.checker.status_s), 4) if self.checker.status_s else None,
                         "max": round(max(self.checker.status_s), 4) if self.checker.status_s else None},
            "failures": self.checker.failures,
            "loss_curve": self.loss,
        }

    def resumed_after(self, t: float) -> float | None:
        """From `t` until some host trains a step past the newest any had trained by `t`."""
        records = sorted(r for rs in self.checker.steps.values() for r in rs)
        reached = max((s for at, s, _ in records if at <= t), default=0)
        return next((round(at - t, 2) for at, s, _ in records if at > t and s > reached), None)
