"""Gang restart on three hosts: recovery after a worker's SIGKILL, and goodput, with and without it.

Three `tpud run` supervisors on this machine, each with its own home and tpud.yaml `gang:`
section, their workers meeting in host 0's coordinator on the loopback interface (gloo), train
the tiny model. Two arms, one after the other, on the same seeded schedule:
- gang: tpud as shipped: a worker's failure ends its gang generation, every other host's worker
  exits 77 within the peer timeout and all restart at once (no restart budget spent by peers);
- no-gang-restart: tpud.yaml `gang.restart_peers: false`: no peer watch; a peer learns of the
  failure only from a collective's error (gloo sees the killed worker's sockets close) or, when
  none comes, from its daemon's hang bound (`--hang-bound`), and then restarts as a crash would.

Each arm trains undisturbed for --warmup s, then for --minutes with --per-minute disruptions a minute: at a seeded moment in each slot, once
every host is training, a seeded host's worker is disrupted; the kinds (--kinds) take turns:
- sigkill: SIGKILL the worker (its kernel closes its sockets: gloo tells its peers at once);
- vanish: SIGKILL the worker while this script holds its sockets open (pidfd_getfd), so its
  peers get no FIN or reset: what they see of a host that drops off the network, and what XLA's
  collectives on a TPU slice see of a dead peer, which leave the others waiting. The sockets are
  closed once every peer's worker has exited;
- hang: SIGSTOP it (it stops without closing anything; its daemon's hang bound ends it).

The waits for recovery allow 30 minutes: without gang restart, a peer blocked in a checkpoint's
collective is judged only after the save allowance (health.checkpoint_timeout_seconds, 600 s),
and a hang right after a restart only after the startup allowance (900 s).

Per disruption: peers out s = from the disruption until every other host's worker has exited;
recovery s = until every host has logged a step from a worker started after it; steps lost = the
newest step logged before it - the step the gang resumed from. Goodput over the disrupted window =
steps advanced x clean step time / window seconds, the clean step time being the median interval
between consecutive steps of both arms. Both arms run the job's restart defaults (a
workers forked from the fork server, 1 s first backoff for the host whose worker failed).
Targets: gang recovery after a SIGKILL < 15 s; at least 3x faster than the no-gang-restart
arm's where its peers are left to their hang bound (vanish: over gloo a plain SIGKILL reaches
them as a socket error within a second or two, with or without gang restart); peers out within
5 s of a SIGKILL and within the hang bound + 5 s of a hang. `vanish` needs Linux 5.6 or later
and the right to ptrace the workers (root, or the same user with ptrace_scope 0).

    .venv/bin/python bench/multihost.py                      # ~8 min: two arms of 20 s + 3 min
    .venv/bin/python bench/multihost.py --minutes 1 --warmup 10 --out /tmp/multihost.json
Results: a table on stdout and bench/results/multihost.json.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from goodput import Tail, kill_group, spawn  # noqa: E402
from machine import describe  # noqa: E402
from testkit.helpers import free_port  # noqa: E402
from tpud.paths import Paths  # noqa: E402

HOSTS = 3
JOB = ["data.corpus_bytes=400000", "data.seq_len=64", "data.micro_batch_size=2", "train.global_batch_size=12",
       "scheduler.warmup_steps=1", "train.log_interval=1", "train.max_steps=100000000",
       "checkpoint.interval_steps=20"]


class Host:
    """One host's `tpud run`, in its own process group, its output read as it grows."""

    def __init__(self, root: Path, index: int, port: int, restart_peers: bool, hang_bound: float):
        self.index, self.home = index, root / f"host{index}"
        self.home.mkdir(parents=True)
        (self.home / "tpud.yaml").write_text(
            f"gang: {{host_index: {index}, host_count: {HOSTS}, coordinator: '127.0.0.1:{port}', "
            f"restart_peers: {str(restart_peers).lower()}}}\n")
        log = self.home / "run.log"
        self.proc = spawn([sys.executable, "-m", "tpud", "run", str(REPO / "configs/jobs/tiny-cpu.yaml"), *JOB,
                           f"health.heartbeat_timeout_seconds={hang_bound}", "health.kill_grace_seconds=1",
                           "--home", str(self.home)], log, OMP_NUM_THREADS="1")
        self.tail = Tail(log)

    def records(self, event: str) -> list[dict]:
        self.tail.read()
        return [r for r in self.tail.records if r.get("event") == event]

    def worker(self) -> tuple[int, float]:
        """The current worker: its pid and when it started."""
        started = self.records("worker started")[-1]
        return started["pid"], started["_t"]

    def training_since(self, t: float) -> float | None:
        """When this host's first worker started after `t` logged its first step."""
        starts = [r["_t"] for r in self.records("worker started") if r["_t"] > t]
        if not starts:
            return None
        return next((r["_t"] for r in self.records("step") if r["_t"] > starts[0]), None)

    def exited_since(self, t: float) -> float | None:
        """When this host's first worker exit after `t` was logged."""
        return next((r["_t"] for r in self.records("worker exited") if r["_t"] > t), None)

    def step(self) -> int:
        steps = self.records("step")
        return steps[-1]["step"] if steps else 0

    def stop(self) -> None:
        kill_group(self.proc.pid)
        self.proc.wait()
        shutil.rmtree(Paths.resolve(self.home).memory, ignore_errors=True)  # its memory tier, in /dev/shm


SYS_PIDFD_GETFD = 438  # Linux 5.6+; Python's os module has pidfd_open but not this


def hold_sockets(pid: int) -> list[int]:
    """Duplicates of every socket of process `pid`, so that its death closes none of them."""
    libc = ctypes.CDLL(None, use_errno=True)
    pidfd = os.pidfd_open(pid)
    held = []
    try:
        for name in os.listdir(f"/proc/{pid}/fd"):
            try:
                if not os.readlink(f"/proc/{pid}/fd/{name}").startswith("socket:"):
                    continue
            except FileNotFoundError:
                continue
            fd = libc.syscall(SYS_PIDFD_GETFD, pidfd, int(name), 0)
            if fd < 0:
                raise OSError(ctypes.get_errno(), f"pidfd_getfd on process {pid}'s fd {name} (needs Linux 5.6+ "
                              "and the right to ptrace it)")
            held.append(fd)
    except BaseException:
        for fd in held:
            os.close(fd)
        raise
    finally:
        os.close(pidfd)
    return held


def wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.05)
    return value


def run_arm(name: str, root: Path, args, schedule: list[tuple[float, int]]) -> dict:
    port = free_port()
    hosts = [Host(root / name, i, port, name == "gang", args.hang_bound) for i in range(HOSTS)]
    try:
        wait(lambda: all(h.step() >= 3 for h in hosts), 300, "the gang training")
        warm_from = time.time()
        time.sleep(args.warmup)
        start, first_step = time.time(), hosts[0].step()
        disruptions = []
        for offset, victim, kind in schedule:
            time.sleep(max(0.0, start + offset - time.time()))
            # Only once every host trains: a kill during recovery would measure the two together.
            since = disruptions[-1]["killed_unix"] if disruptions else 0.0
            wait(lambda: all(h.training_since(since) for h in hosts) if since else True, 1800, "recovery")
            reached = max(h.step() for h in hosts)
            pid, _ = hosts[victim].worker()
            held = hold_sockets(pid) if kind == "vanish" else []
            killed = time.time()
            os.kill(pid, signal.SIGSTOP if kind == "hang" else signal.SIGKILL)
            disruptions.append({"kind": kind, "host": victim, "killed_unix": killed, "step_reached": reached})
            if held:
                wait(lambda: all(h.exited_since(killed) for h in hosts if h.index != victim), 1800, "the peers out")
                for fd in held:
                    os.close(fd)
        time.sleep(max(0.0, start + args.minutes * 60 - time.time()))
        end = time.time()
        last_step = hosts[0].step()
        # The clean step time: the median interval between consecutive steps, warm-up and window
        # (a restart's gap is one interval of hundreds).
        steps = [r for r in hosts[0].records("step") if warm_from <= r["_t"] <= end]
        clean = statistics.median(b["_t"] - a["_t"] for a, b in zip(steps, steps[1:]) if b["step"] == a["step"] + 1)
        wait(lambda: all(h.training_since(disruptions[-1]["killed_unix"]) for h in hosts), 1800, "the last recovery")
        for d in disruptions:
            back = [h.training_since(d["killed_unix"]) for h in hosts]
            d["recovery_s"] = round(max(back) - d["killed_unix"], 2)
            d["peers_out_s"] = round(max(h.exited_since(d["killed_unix"]) for h in hosts if h.index != d["host"])
                                     - d["killed_unix"], 2)
            restored = [r["step"] for r in hosts[d["host"]].records("checkpoint restored") if r["_t"] > d["killed_unix"]]
            d["resumed_from"] = restored[0] if restored else 0
            d["steps_lost"] = d["step_reached"] - d["resumed_from"]
        exits = {h.index: [r["status"] for r in h.records("worker exited")] for h in hosts}
        return {"clean_step_s": clean, "window_s": round(end - start, 1), "steps_advanced": last_step - first_step,
                "disruptions": disruptions, "worker_exits": exits}
    finally:
        for h in hosts:
            h.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=3.0, help="disrupted minutes per arm")
    parser.add_argument("--per-minute", type=float, default=1.0, help="disruptions a minute")
    parser.add_argument("--warmup", type=float, default=20.0, help="undisturbed seconds before the first")
    parser.add_argument("--kinds", default="sigkill,vanish,hang",
                        help="disruption kinds, taking turns: sigkill, vanish, hang")
    parser.add_argument("--hang-bound", type=float, default=10.0,
                        help="health.heartbeat_timeout_seconds of the job, in both arms")
    parser.add_argument("--seed", type=int, default=2)  # its victims: hosts 0, 1 and 2
    parser.add_argument("--workdir", type=Path, help="keep every host's home and log here (default: a temporary "
                        "directory, removed)")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "multihost.json")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    slot = 60.0 / args.per_minute
    kinds = args.kinds.split(",")
    if not set(kinds) <= {"sigkill", "vanish", "hang"}:
        parser.error(f"--kinds: {args.kinds!r}: each one of sigkill, vanish, hang")
    schedule = [(i * slot + rng.uniform(0.2, 0.6) * slot, rng.randrange(HOSTS), kinds[i % len(kinds)])
                for i in range(max(1, round(args.minutes * args.per_minute)))]
    print(f"schedule (s into the window, host, kind): {[(round(t, 1), h, k) for t, h, k in schedule]}")
    arms = {}
    with tempfile.TemporaryDirectory(prefix="tpud-multihost-") as tmp:
        for name in ("gang", "no-gang-restart"):
            print(f"{name} arm: {args.warmup:g} s warm-up, {args.minutes:g} min disrupted", flush=True)
            arms[name] = run_arm(name, args.workdir or Path(tmp), args, schedule)
    clean = statistics.mean(a["clean_step_s"] for a in arms.values())  # the same job: one clean step time
    table = []
    for name, arm in arms.items():
        arm["goodput"] = round(arm["steps_advanced"] * clean / arm["window_s"], 3)
        arm["by_kind"] = {}
        for kind in kinds:
            ds = [d for d in arm["disruptions"] if d["kind"] == kind]
            if ds:
                arm["by_kind"][kind] = {f"{k}_mean": round(statistics.mean(d[k] for d in ds), 2)
                                        for k in ("peers_out_s", "recovery_s", "steps_lost")}
                table.append((name, kind, ", ".join(f"{d['recovery_s']:.1f}" for d in ds), arm["by_kind"][kind],
                              arm["goodput"]))
    gang, plain = arms["gang"]["by_kind"], arms["no-gang-restart"]["by_kind"]
    summary = {"goodput_ratio": round(arms["gang"]["goodput"] / arms["no-gang-restart"]["goodput"], 2)
               if arms["no-gang-restart"]["goodput"] else None}
    checks = []
    for kind in gang:
        summary[f"{kind}_recovery_ratio"] = round(plain[kind]["recovery_s_mean"] / gang[kind]["recovery_s_mean"], 2)
    for kind in ("sigkill", "vanish"):
        if kind in gang:
            checks += [(f"gang recovery after a {kind} < 15 s", gang[kind]["recovery_s_mean"] < 15),
                       (f"gang peers out within 5 s of a {kind}", gang[kind]["peers_out_s_mean"] <= 5)]
    if "vanish" in gang:
        checks.append(("no-gang-restart / gang recovery after a vanish (peers left to their hang bound) >= 3x",
                       summary["vanish_recovery_ratio"] >= 3))
    if "hang" in gang:
        checks.append((f"gang peers out within the hang bound + 5 s of a hang",
                       gang["hang"]["peers_out_s_mean"] <= args.hang_bound + 5))
    missed = [what for what, held in checks if not held]
    print(f"\n{'arm':<16}{'kind':<9}{'recovery s (each)':<26}{'peers out':>10}{'recovery':>9}{'lost':>7}{'goodput':>9}")
    for name, kind, each, means, goodput in table:
        print(f"{name:<16}{kind:<9}{each:<26}{means['peers_out_s_mean']:>10.1f}{means['recovery_s_mean']:>9.1f}"
              f"{means['steps_lost_mean']:>7.1f}{goodput:>9.3f}")
    print(f"\nrecovery no-gang-restart / gang: " + ", ".join(f"{k}: {summary[f'{k}_recovery_ratio']}x" for k in gang)
          + f"; goodput gang / no-gang-restart {summary['goodput_ratio']}x; clean step {clean * 1000:.0f} ms; "
          f"hang bound {args.hang_bound:g} s")
    print("targets missed: " + "; ".join(missed) if missed else "targets met")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: v for k, v in vars(args).items()
                                             if k not in ("out", "workdir")},  # local paths
                                    "schedule": schedule, "arms": arms, "summary": summary,
                                    "checks": [{"target": what, "held": held} for what, held in checks],
                                    "missed": missed, "machine": describe()}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
