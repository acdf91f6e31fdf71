"""Goodput under chaos: the memory tier off, every step, and auto, on the same seeded schedules.

For each job and seed, three arms, one after the other, run `tpud daemon` on the job (a log line
per step, async disk checkpoints every --checkpoint-interval s, hung after 5 s without a
heartbeat, 1 s kill grace, 0.5 s first backoff; preemption notices from our metadata server,
tests/metadata_server.py) for --minutes each, differing only in checkpoint.memory:
- off:   `memory: null` (the disk tier alone);
- every: `memory: {interval_steps: 1}` (issue 16's default: every step, within max_overhead);
- auto:  `memory: {interval_steps: auto}` (engine/checkpoint/policy.py), the job's prior
         checkpoint.disruptions_per_hour set to the rate of the schedule's work-losing disruptions
         (SIGKILLs and hangs), as an operator states what their VMs see.
Two jobs: `tiny` (the tiny preset at seq 128 x 4: a 10 MB state against a ~40 ms step) and
`long-step` (the same model at seq 512 x 16: the same state against a step ~15x longer, so a
save is small next to a step).

Chaos: the arm is cut into round(--minutes x --per-minute) equal slots, each with one disruption at
a seeded random time; kinds cycle through a seeded shuffle of the three. A disruption waits until
the arm's worker has logged a step since it started.
- sigkill: SIGKILL the worker.
- hang: SIGSTOP it (no heartbeats); tpud's hang bound kills it.
- preemption: instance/preempted=TRUE; --deadline s later SIGKILL daemon and worker,
  preempted=FALSE, a new daemon on the same home (same disk): the VM recreated at once.

Per disruption: step reached (last logged before the replacement's `trainer ready`), step resumed
from (its resumed_at), lost steps = reached - resumed, recovery s until a step past `reached` is
logged. Goodput: last step x clean step time / arm wall time; the clean step time is the median of
an undisturbed run first (--clean-seconds, `python -m engine.train`: no memory tier). The ideal
goodput of a schedule is what a supervisor that loses nothing it could save would reach: the arm's
time less the first cold start, each hang's bound, each preempted VM's cold start (the clean
run's, from its launch to its first step) and each SIGKILLed or hung worker's restart (from its
end to its replacement's `trainer ready`: the median over the three arms, which restart alike).

Targets (every job and seed): auto's goodput >= the better of off and every minus 0.01, and within
0.03 of the ideal; auto's median lost steps per SIGKILL <= half its median interval in force (the
step lines' auto_intervals).

    .venv/bin/python bench/goodput.py       # ~40 min: 2 jobs x seeds 0, 1, 2, each a 20 s clean run and three 2 min arms
    .venv/bin/python bench/goodput.py --jobs tiny --seed 0 --minutes 0.5 --out /tmp/goodput.json
Results: a table per job and seed and a summary on stdout, and bench/results/goodput.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.metadata_server import MetadataServer  # noqa: E402
from tpud.control import ControlClient  # noqa: E402
from tpud.paths import Paths  # noqa: E402
from machine import describe  # noqa: E402

KINDS = ("sigkill", "preemption", "hang")
# Other load slows this 2-thread job in bursts that a median hides: warn when an arm's mean step
# time and the clean run's differ by more than this factor (goodput is then off, either way).
NOISY = 1.2
HANG_BOUND_S = 5.0  # the job's heartbeat_timeout_seconds: its steps are far below a tenth of it
JOBS = {"tiny": {"seq_len": 128, "micro_batch_size": 4}, "long-step": {"seq_len": 512, "micro_batch_size": 16}}
ARMS = {"off": "null", "every": "{interval_steps: 1}", "auto": "{interval_steps: auto}"}
# checkpoint_timeout_seconds: a hang that lands while an async save is in flight would
# otherwise get the default 600 s allowance; this job's saves take well under a second.
JOB = """\
name: goodput
include: {repo}/configs/jobs/tiny-cpu.yaml
model: {{max_seq_len: 512}}
data: {{corpus_bytes: 400000, seq_len: {seq_len}, micro_batch_size: {micro_batch_size}}}
train: {{max_steps: 100000000, log_interval: 1}}
scheduler: {{warmup_steps: 1}}
checkpoint: {{interval_steps: 0, interval_seconds: {interval}, async: true, memory: {memory}, disruptions_per_hour: {prior}}}
restart: {{max_restarts: 1000, backoff_initial_seconds: 0.5}}
health: {{heartbeat_timeout_seconds: {hang_bound}, kill_grace_seconds: 1, checkpoint_timeout_seconds: 30}}
"""
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def spawn(cmd: list[str], log: Path, **env: str) -> subprocess.Popen:
    """A process in its own group (killed as one), output appended to log."""
    with open(log, "ab") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env={**ENV, **env})


def kill_group(pid: int | None) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError, TypeError):
        pass


class Tail:
    """The arm's log (JSON lines, ours and relayed), read as it grows; each record gets `_t`, epoch seconds."""

    def __init__(self, path: Path):
        self.path, self.offset, self.partial, self.records = path, 0, b"", []

    def read(self) -> list[dict]:
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            chunk = f.read()
        if not chunk:
            return []
        self.offset += len(chunk)
        *lines, self.partial = (self.partial + chunk).split(b"\n")
        new = []
        for line in lines:
            try:  # a relayed chunk may split a line: such lines are skipped
                record = json.loads(line)
                record["_t"] = datetime.fromisoformat(record["timestamp"]).timestamp()
            except (ValueError, KeyError, TypeError):
                continue
            new.append(record)
        self.records += new
        return new


class TpudArm:
    def __init__(self, name: str, base: Path, job: str, deadline: float):
        self.name, self.home = name, base / name
        (self.home / "jobs.d").mkdir(parents=True)
        (self.home / "tpud.yaml").write_text(f"preemption_deadline_seconds: {deadline}\n")
        (self.home / "jobs.d" / "goodput.yaml").write_text(job)
        self.log, self.server, self.daemon = self.home / "arm.log", MetadataServer(), None

    def start(self) -> None:
        self.daemon = spawn([sys.executable, "-m", "tpud", "daemon", "--home", str(self.home), "--metrics-addr",
                             "127.0.0.1:0"], self.log, GCE_METADATA_HOST=self.server.host)

    def _job(self) -> dict:
        return ControlClient(self.home / "run" / "control.sock").call("status")["jobs"][0]

    def training_pid(self) -> int | None:
        """The worker in charge (status names it: forked workers are the fork server's children)."""
        try:
            return self._job()["pid"]
        except Exception:  # the daemon is starting, or between incarnations
            return None

    def notice(self) -> None:
        self.server.set("instance/preempted", "TRUE")

    def vm_end(self) -> None:
        """The VM is gone (daemon and worker with it) and recreated at once: a new daemon, same disk."""
        self.kill()
        self.server.set("instance/preempted", "FALSE")
        self.start()

    def status(self) -> dict:
        """tpud's own view: its goodput ledger persists in job.json, so it spans every daemon of the arm."""
        try:
            job = self._job()
            return {k: job[k] for k in ("goodput", "restarts", "state", "step")}
        except Exception as e:  # the daemon may be between incarnations at the very end
            return {"error": repr(e)}

    def kill(self) -> None:
        if self.daemon is not None:
            kill_group(self.training_pid())  # the worker has its own session
            kill_group(self.daemon.pid)
            self.daemon.wait()

    def close(self) -> None:
        self.kill()
        self.server.close()
        shutil.rmtree(Paths.resolve(self.home).memory, ignore_errors=True)  # the daemon's, in /dev/shm


def make_schedule(minutes: float, per_minute: float, seed: int) -> list[tuple[float, str]]:
    rng = random.Random(seed)
    n = max(1, round(minutes * per_minute))
    slot = minutes * 60 / n
    order = list(KINDS)
    rng.shuffle(order)
    return [(round((i + rng.uniform(0.2, 0.6)) * slot, 1), order[i % len(order)]) for i in range(n)]


def run_arm(arm, schedule, args) -> dict:
    """Run one arm under the schedule; its records, disruptions and tpud's own ledger."""
    arm.start()
    t0 = time.time()
    end, tail, pending, fired = t0 + args.minutes * 60, Tail(arm.log), list(schedule), []
    ready_pid, stepped, vm_end = None, False, None
    try:
        while time.time() < end:
            for record in tail.read():
                event = record.get("event")
                if event == "trainer ready":
                    ready_pid, stepped = arm.training_pid(), False
                    print(f"  [{arm.name} {record['_t'] - t0:5.1f}s] trainer ready, resumed at {record['resumed_at']}")
                elif event == "step":
                    stepped = True
                elif event == "worker hung; terminating it":
                    print(f"  [{arm.name} {record['_t'] - t0:5.1f}s] tpud: {event}")
            now = time.time()
            if vm_end is not None and now >= vm_end:
                arm.vm_end()
                vm_end = None
                print(f"  [{arm.name} {now - t0:5.1f}s] VM ended and recreated")
            if pending and now >= t0 + pending[0][0] and vm_end is None:
                pid = arm.training_pid()
                if pid is not None and pid == ready_pid and stepped:  # only a process that is training
                    scheduled, kind = pending.pop(0)
                    if kind == "sigkill":
                        os.kill(pid, signal.SIGKILL)
                    elif kind == "hang":
                        os.kill(pid, signal.SIGSTOP)
                    else:
                        arm.notice()
                        vm_end = now + args.deadline
                    fired.append({"kind": kind, "scheduled_s": scheduled, "at_s": round(now - t0, 2), "_t": now})
                    print(f"  [{arm.name} {now - t0:5.1f}s] {kind} (pid {pid}, scheduled at {scheduled}s)")
            time.sleep(0.1)
        tail.read()
        status = arm.status()
    finally:
        arm.close()
    return {"t0": t0, "end": end, "records": tail.records, "fired": fired, "status": status}


def analyse(run: dict, clean_step_s: float) -> dict:
    t0, end, records = run["t0"], run["end"], [r for r in run["records"] if r["_t"] <= run["end"]]
    steps = [(r["_t"], r["step"]) for r in records if r.get("event") == "step"]
    auto = [r["auto_intervals"]["memory"] for r in records
            if r.get("event") == "step" and "memory" in (r.get("auto_intervals") or {})]
    step_times = [r["step_time_s"] for r in records if r.get("event") == "step"]
    readies = [(r["_t"], r.get("resumed_at", 0)) for r in records if r.get("event") == "trainer ready"]
    commits = [(r["_t"], r["step"]) for r in records if r.get("event") == "checkpoint committed"]
    hung = [r["_t"] for r in records if r.get("event") == "worker hung; terminating it"]
    disruptions, replaced = [], set()
    for d in run["fired"]:
        t = d["_t"]
        replacement = next((r for r in readies if r[0] > t), None)
        until = replacement[0] if replacement else end
        reached = next((s for ts, s in reversed(steps) if ts < until), 0)
        if replacement is not None:
            resumed = replacement[1]
        else:  # never replaced by the arm's end: a restart would resume from the newest commit
            resumed = next((s for ts, s in reversed(commits) if ts < end), 0)
        # A second blow to a process already down loses nothing more.
        absorbed = replacement in replaced
        replaced.add(replacement)
        recovered = next((ts for ts, s in steps if ts > until and s > reached), None) if replacement else None
        row = {k: v for k, v in d.items() if k != "_t"}
        # From the old worker's end (SIGKILL, or the hang verdict) to its replacement's `trainer ready`.
        gone = next((h for h in hung if h > t), t) if d["kind"] == "hang" else t
        row["restart_s"] = round(until - gone, 2) if replacement and d["kind"] != "preemption" else None
        row.update(reached=reached, resumed=resumed, lost_steps=0 if absorbed else max(0, reached - resumed),
                   recovery_s=None if recovered is None else round(recovered - t, 2), absorbed=absorbed)
        if d["kind"] == "hang" and hung:  # tpud's hang detector: from SIGSTOP to its verdict
            row["detected_s"] = next((round(h - t, 2) for h in hung if h > t), None)
        disruptions.append(row)
    final_step = steps[-1][1] if steps else 0
    by_kind = {}
    for kind in (*KINDS, "all"):
        rows = [d for d in disruptions if kind in ("all", d["kind"])]
        rec = [d["recovery_s"] for d in rows if d["recovery_s"] is not None]
        lost = [d["lost_steps"] for d in rows]
        by_kind[kind] = {"n": len(rows), "lost_steps": sum(lost),
                         "lost_steps_mean": statistics.mean(lost) if rows else None,
                         "lost_steps_median": statistics.median(lost) if rows else None,
                         "recovery_s_mean": statistics.mean(rec) if rec else None,
                         "never_recovered": len(rows) - len(rec)}
    return {"wall_s": round(end - t0, 2), "final_step": final_step,
            "mean_step_s": statistics.mean(step_times) if step_times else None,
            "goodput": round(final_step * clean_step_s / (end - t0), 4),
            "auto_interval_median": statistics.median(auto) if auto else None,
            "disruptions": disruptions, "by_kind": by_kind, "tpud_status": run["status"]}


def clean_run(base: Path, job: str, seconds: float) -> dict:
    """Step times of an undisturbed run of the job: the median (the clean step time) and the mean."""
    (base / "clean").mkdir()
    (base / "clean" / "goodput.yaml").write_text(job)
    log = base / "clean" / "arm.log"
    launched = time.time()
    proc = spawn([sys.executable, "-m", "engine.train", str(base / "clean" / "goodput.yaml"), "--state-dir",
                  str(base / "clean")], log)
    try:
        time.sleep(seconds)
    finally:
        kill_group(proc.pid)
        proc.wait()
    steps = [r for r in Tail(log).read() if r.get("event") == "step"]
    times = [r["step_time_s"] for r in steps][5:]
    if not times:
        raise SystemExit(f"the clean run logged no steps in {seconds} s:\n{log.read_text()[-3000:]}")
    return {"step_s": statistics.median(times), "mean_step_s": statistics.mean(times), "steps": len(times) + 5,
            "cold_start_s": round(steps[0]["_t"] - launched, 2)}


def ideal_goodput(schedule: list[tuple[float, str]], wall_s: float, clean: dict, restart_s: float) -> float:
    """What a supervisor losing nothing it could save reaches on the schedule (module docstring)."""
    kinds = [kind for _, kind in schedule]
    unavoidable = (clean["cold_start_s"] * (1 + kinds.count("preemption")) + HANG_BOUND_S * kinds.count("hang")
                   + restart_s * (kinds.count("sigkill") + kinds.count("hang")))
    return round(1 - unavoidable / wall_s, 4)


def fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def report(job: str, arms: dict, clean: dict, ideal: float) -> dict:
    print(f"\n{job}: clean step time {clean['step_s'] * 1000:.1f} ms; lost = lost steps (sum, median), "
          "rec = mean recovery s")
    head = f"{'lost':>5} {'median':>6} {'rec':>5}"
    print(f"{'kind':<11} {'n':>3} | " + " | ".join(f"{name:^18}" for name in arms) + f"\n{'':<15} | "
          + " | ".join(head for _ in arms))
    for kind in (*KINDS, "all"):
        cells = [f"{k['lost_steps']:>5} {fmt(k['lost_steps_median'], '6.1f')} {fmt(k['recovery_s_mean'], '5.1f')}"
                 for k in (arm["by_kind"][kind] for arm in arms.values())]
        print(f"{kind:<11} {arms['auto']['by_kind'][kind]['n']:>3} | " + " | ".join(cells))
    print(f"{'goodput':<15} | " + " | ".join(f"{arm['goodput']:>18.3f}" for arm in arms.values()))
    print(f"{'ideal goodput':<15} | {ideal:>18.3f}   (the schedule's unavoidable time: cold starts, hang bounds, "
          "worker restarts)")
    print(f"{'auto interval':<15} | median {fmt(arms['auto']['auto_interval_median'], 'g')} steps")
    for name, arm in arms.items():  # goodput assumes the arms step as fast as the clean run did
        ratio = (arm["mean_step_s"] or clean["mean_step_s"]) / clean["mean_step_s"]
        if not 1 / NOISY <= ratio <= NOISY:
            print(f"WARNING: the {name} arm's mean step took {ratio:.2f}x the clean run's: other load on the "
                  "machine, or its own saves; its goodput is not reliable")
    auto, best = arms["auto"]["goodput"], max(arms["off"]["goodput"], arms["every"]["goodput"])
    sigkill, interval = arms["auto"]["by_kind"]["sigkill"]["lost_steps_median"], arms["auto"]["auto_interval_median"]
    met = {"auto_at_least_the_better_arm": auto >= best - 0.01, "auto_near_the_ideal": auto >= ideal - 0.03,
           "auto_lost_steps_per_sigkill": sigkill is None or (interval is not None and sigkill <= interval / 2)}
    print(f"target: auto {auto:.3f} >= better of off and every ({best:.3f}) - 0.01: "
          f"{'pass' if met['auto_at_least_the_better_arm'] else 'MISS'}")
    print(f"target: auto within 0.03 of the ideal {ideal:.3f}: {'pass' if met['auto_near_the_ideal'] else 'MISS'}")
    print(f"target: auto's median lost steps per SIGKILL ({fmt(sigkill, 'g')}) <= half its interval "
          f"({fmt(interval, 'g')}): {'pass' if met['auto_lost_steps_per_sigkill'] else 'MISS'}")
    return met


def run_seed(job_name: str, seed: int, args: argparse.Namespace) -> dict:
    """One job and seed: a clean run, then the off, every and auto arms on one schedule."""
    schedule = make_schedule(args.minutes, args.per_minute, seed)
    losing = sum(kind != "preemption" for _, kind in schedule) / (args.minutes / 60)  # per hour
    fields = dict(interval=args.checkpoint_interval, hang_bound=HANG_BOUND_S, prior=round(losing, 3), **JOBS[job_name])
    print(f"\n{job_name}, seed {seed}: schedule (s, kind): {schedule}")
    base = Path(tempfile.mkdtemp(prefix="tpud-goodput-"))
    arms, load_before = {}, os.getloadavg()
    try:
        print(f"clean run, {args.clean_seconds:.0f} s")
        clean = clean_run(base, JOB.format(repo=REPO, memory="null", **fields), args.clean_seconds)
        for name, memory in ARMS.items():
            print(f"{name} arm, {args.minutes:g} min")
            arm = TpudArm(name, base, JOB.format(repo=REPO, memory=memory, **fields), args.deadline)
            arms[name] = analyse(run_arm(arm, schedule, args), clean["step_s"])
    finally:
        shutil.rmtree(base, ignore_errors=True)
    # Every arm restarts its worker alike (a fork and a restore): the median, the same for all.
    restarts = [d["restart_s"] for arm in arms.values() for d in arm["disruptions"] if d.get("restart_s") is not None]
    ideal = ideal_goodput(schedule, args.minutes * 60, clean, statistics.median(restarts) if restarts else 0.0)
    met = report(job_name, arms, clean, ideal)
    # The result records the job with the repository as "<repo>": a checkout's path means nothing elsewhere.
    recorded = {name: JOB.format(repo="<repo>", memory=memory, **fields) for name, memory in ARMS.items()}
    return {"passed": all(met.values()), "met": met, "jobs": recorded, "schedule": schedule, "clean": clean,
            "ideal_goodput": ideal, "arms": arms, "machine": describe(load_before=load_before)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", nargs="+", default=list(JOBS), choices=list(JOBS))
    parser.add_argument("--minutes", type=float, default=2.0, help="wall time of each arm")
    parser.add_argument("--per-minute", type=float, default=1.5, help="disruptions per minute")
    parser.add_argument("--seed", type=int, nargs="+", default=[0, 1, 2], help="one schedule per seed")
    parser.add_argument("--deadline", type=float, default=5.0, help="seconds from a preemption notice to the VM's end")
    parser.add_argument("--checkpoint-interval", type=float, default=10.0, help="periodic disk checkpoints, every arm")
    parser.add_argument("--clean-seconds", type=float, default=20.0, help="the undisturbed run for the step time")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "goodput.json")
    args = parser.parse_args()

    runs = {job: {seed: run_seed(job, seed, args) for seed in args.seed} for job in args.jobs}
    print(f"\n{'job':<10} {'seed':<5} {'off':>6} {'every':>6} {'auto':>6} {'ideal':>6} {'interval':>8} "
          f"{'lost/kill':>9}  targets")
    for job, seeds in runs.items():
        for seed, r in seeds.items():
            arms = r["arms"]
            print(f"{job:<10} {seed:<5} " + " ".join(f"{arms[a]['goodput']:>6.3f}" for a in ARMS)
                  + f" {r['ideal_goodput']:>6.3f} {fmt(arms['auto']['auto_interval_median'], '>8g')} "
                  f"{fmt(arms['auto']['by_kind']['sigkill']['lost_steps_median'], '>9g')}  "
                  f"{'met' if r['passed'] else 'MISSED'}")
    passed = all(r["passed"] for seeds in runs.values() for r in seeds.values())
    print("all targets met on every job and seed" if passed else "targets MISSED")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "benchmark": "goodput", "passed": passed,
        "config": {k: v for k, v in vars(args).items() if k != "out"},  # where it was written: a local path
        "runs": runs,
    }, indent=2))


if __name__ == "__main__":
    main()
