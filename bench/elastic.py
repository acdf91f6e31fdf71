"""The elastic gang: a host that vanishes, the others going on, the host coming back blank.

Four `tpud run` supervisors on this machine (loopback, gloo), each running its own coordinator
(tpud.yaml `gang.coordinators`) with `gang.min_hosts: 2`, train the tiny model. Two arms, one
after the other, on the same seeded schedule of victims:
- in_place (tpud as shipped): the survivors keep their processes and form the next gang where
  they stand; a host that comes back takes the newest state from a peer;
- restart (the gang before the elastic work: `gang.in_place: false`, `min_hosts` = every host):
  the others wait for the victim, whose VM comes straight back with its disk, and every worker
  restarts and resumes from the newest global commit.

Each drill SIGKILLs a seeded victim's daemon, worker and coordinator together (a vanished VM;
the first drill's victim is host 0) at a random moment, then starts the victim again (in place:
with an empty state directory, once the others went on). Per drill: recovery s = from the kill
until every survivor has trained a step in a gang without the victim (restart: in the whole gang
again; median and max; target <= 5 s in place); whether the
survivors' worker PIDs are unchanged; committed steps lost = the newest global commit before the
kill minus the step the survivors went on from (target 0); back s = from the victim's
`tpud run` start until it is a member again (target <= 10 s in place), and where its state came
from (a peer's live state, its rate, or a restore). After the drills, the shrink drill: hosts are
killed one at a time down to 2 (it must go on) and then to 1 (below min_hosts: it must wait and
say so). Every replica's fingerprint is compared every 10 steps (health.replicas: a mismatch is
logged and fails the run), and at the end the newest step every host committed is compared
across hosts, bitwise (less each host's data rank).

    .venv/bin/python bench/elastic.py                 # ~10 min on 2 cores: two arms of 20 drills
    .venv/bin/python bench/elastic.py --drills 3 --arms in_place --out /tmp/elastic.json
Results: a table on stdout and bench/results/elastic.json.
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
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from goodput import Tail, kill_group, spawn  # noqa: E402
from machine import describe  # noqa: E402
from testkit.helpers import free_port  # noqa: E402
from tpud.paths import Paths  # noqa: E402

JOB = ["data.corpus_bytes=400000", "data.seq_len=32", "data.micro_batch_size=2", "train.global_batch_size=12",
       "model.dim=64", "model.n_layers=2", "model.ffn_dim=128", "scheduler.warmup_steps=1", "train.log_interval=1",
       "train.max_steps=100000000", "checkpoint.interval_steps=20", "health.replicas.interval_steps=10",
       # A memory state every 5 steps, in both arms.
       "checkpoint.memory.interval_steps=5", "checkpoint.memory.max_overhead=1"]


class Host:
    """One host's `tpud run` in its own process group, its log read as it grows."""

    def __init__(self, root: Path, index: int, settings: str):
        self.index, self.home = index, root / f"host{index}"
        self.home.mkdir(parents=True, exist_ok=True)
        (self.home / "tpud.yaml").write_text(settings)
        self.proc, self.tail, self.runs = None, None, 0

    def start(self, *overrides: str) -> float:
        self.runs += 1
        log = self.home / f"run{self.runs}.log"
        started = time.time()
        self.proc = spawn([sys.executable, "-m", "tpud", "run", str(REPO / "configs/jobs/tiny-cpu.yaml"), *JOB,
                           *overrides, "--home", str(self.home)], log, OMP_NUM_THREADS="1")
        self.tail = Tail(log)
        return started

    def records(self, event: str, since: float = 0.0) -> list[dict]:
        self.tail.read()
        return [r for r in self.tail.records if r.get("event") == event and r["_t"] > since]

    def worker(self) -> int | None:
        started = self.records("worker started")
        return started[-1]["pid"] if started else None

    def vanish(self, blank: bool = True) -> None:
        """The VM gone: worker, daemon and coordinator at once, then (blank) its disk and memory."""
        if (pid := self.worker()) is not None:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        kill_group(self.proc.pid)
        self.proc.wait()
        if blank:
            shutil.rmtree(self.home / "state", ignore_errors=True)
        shutil.rmtree(Paths.resolve(self.home).memory, ignore_errors=True)

    def formed(self, since: float, members: list[int] | None = None) -> dict | None:
        return next((r for r in self.records("gang formed", since) if members is None or r["members"] == members),
                    None)

    def first_step_after(self, t: float) -> dict | None:
        return next(iter(self.records("step", t)), None)

    def committed(self, before: float) -> int:
        done = [r["step"] for r in self.records("checkpoint committed") if r["_t"] <= before and r["tier"] == "local"]
        return max(done, default=0)


def end(hosts: list[Host]) -> None:
    """Every host's `tpud run` that still runs killed, and every memory tier (/dev/shm) removed."""
    for h in hosts:
        if h.proc is not None and h.proc.poll() is None:
            kill_group(h.proc.pid)
            h.proc.wait()
        shutil.rmtree(Paths.resolve(h.home).memory, ignore_errors=True)


def wait(what: str, probe, timeout: float):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if got := probe():
            return got
        time.sleep(0.05)
    raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")


def dump_stacks(hosts: list[Host]) -> None:
    """Where every worker stands, when a drill timed out (py-spy, where installed)."""
    for h in hosts:
        if (pid := h.worker()) is not None and shutil.which("py-spy"):
            print(f"--- host {h.index} worker {pid}", flush=True)
            subprocess.run(["py-spy", "dump", "--pid", str(pid)], check=False)


def settings(index: int, count: int, ports: list[int], in_place: bool, min_hosts: int, peer_timeout: float) -> str:
    listed = ", ".join(f"'127.0.0.1:{p}'" for p in ports)
    return (f"gang: {{host_index: {index}, host_count: {count}, coordinators: [{listed}], min_hosts: {min_hosts}, "
            f"in_place: {str(in_place).lower()}, peer_timeout_seconds: {peer_timeout}}}\n")


def drill(hosts: list[Host], victim: Host, rng: random.Random, blank: bool) -> dict:
    alive = [h for h in hosts if h is not victim]
    time.sleep(rng.uniform(0.5, 2.0))
    pids = {h.index: h.worker() for h in alive}
    members = [h.index for h in alive]
    killed = time.time()
    committed = max(h.committed(killed) for h in alive)
    victim.vanish(blank)
    formed = {h.index: wait(f"host {h.index} formed without host {victim.index}",
                            lambda h=h: h.formed(killed, members), 60) for h in alive}
    steps = {h.index: wait(f"host {h.index} training again", lambda h=h: h.first_step_after(formed[h.index]["_t"]),
                           60) for h in alive}
    recovery = max(r["_t"] for r in steps.values()) - killed
    went_on_from = min(r["step"] for r in steps.values()) - 1
    started = victim.start()
    result = {"victim": victim.index, "recovery_s": round(recovery, 3),
              "pids_unchanged": all(h.worker() == pids[h.index] for h in alive),
              "committed_before": committed, "went_on_from": went_on_from,
              "committed_lost": max(0, committed - went_on_from), "path": formed[alive[0].index].get("path")}
    try:
        back = wait(f"host {victim.index} back in the gang",
                    lambda: victim.formed(started, sorted(h.index for h in hosts)), 120)
        wait("every host training after the victim's return",
             lambda: all(h.first_step_after(back["_t"]) for h in hosts), 120)
    except TimeoutError as e:
        failed = [r.get("reason") for h in hosts for r in h.records("job state") if r.get("state") == "FAILED"]
        return {**result, "back_error": f"{e}; {failed[-1] if failed else ''}"[:600]}
    taken = victim.records("state taken from a peer", started)
    restored = victim.records("checkpoint restored", started)
    return {**result, "back_s": round(back["_t"] - started, 3),
            "from": "peer" if taken else "restore" if restored else "none",
            "peer_bytes_per_s": taken[0]["bytes_per_s"] if taken else None,
            "restored_from": restored[0]["path"].split("/checkpoints/")[0].rsplit("/", 1)[-1] if restored else None}


def waiting_drill(hosts: list[Host], victim: Host, rng: random.Random) -> dict:
    """The restart path as it was before the elastic gang: min_hosts = every host, so the others wait
    for the victim, whose VM comes straight back with its disk (at once: kinder than any real VM
    restart); every worker then restarts and resumes from the newest global commit."""
    time.sleep(rng.uniform(0.5, 2.0))
    pids = {h.index: h.worker() for h in hosts if h is not victim}
    killed = time.time()
    committed = max(h.committed(killed) for h in hosts if h is not victim)
    victim.vanish(blank=False)
    started = victim.start()
    everyone = sorted(h.index for h in hosts)
    formed = {h.index: wait(f"host {h.index} in the gang again", lambda h=h: h.formed(killed, everyone), 120)
              for h in hosts}
    steps = {h.index: wait(f"host {h.index} training again", lambda h=h: h.first_step_after(formed[h.index]["_t"]),
                           120) for h in hosts}
    went_on_from = min(r["step"] for r in steps.values()) - 1
    restored = victim.records("checkpoint restored", started)
    return {"victim": victim.index, "recovery_s": round(max(r["_t"] for r in steps.values()) - killed, 3),
            "pids_unchanged": all(h.worker() == pids[h.index] for h in hosts if h is not victim),
            "committed_before": committed, "went_on_from": went_on_from,
            "committed_lost": max(0, committed - went_on_from), "path": formed[victim.index].get("path"),
            "back_s": round(formed[victim.index]["_t"] - started, 3), "from": "restore" if restored else "none"}


def shrink_drill(hosts: list[Host], peer_timeout: float, blank: bool) -> dict:
    """Down to 2 hosts one at a time (it goes on), then to 1 (under min_hosts: it waits, and says so)."""
    out = {}
    alive = list(hosts)
    for count in (3, 2):
        victim = alive.pop(0)
        killed = time.time()
        victim.vanish(blank)
        members = [h.index for h in alive]
        for h in alive:
            formed = wait(f"a gang of {count}", lambda h=h: h.formed(killed, members), 60)
            wait(f"training on {count} hosts", lambda h=h, f=formed: h.first_step_after(f["_t"]), 60)
        out[f"goes_on_with_{count}"] = True
    victim = alive.pop(0)
    killed = time.time()
    victim.vanish(blank)
    last = alive[0]
    time.sleep(2 * peer_timeout + 5)
    waiting = last.records("waiting for hosts", killed)
    out["under_min_hosts_waits"] = bool(waiting) and not last.records("step", killed + peer_timeout + 2)
    out["says"] = waiting[-1]["event"] + f": present {waiting[-1]['present']}" if waiting else None
    gang = [r for r in last.records("gang", killed) if "waiting" in str(r.get("state"))]
    out["status"] = gang[-1]["state"] if gang else None
    for h in hosts:
        if h is not last:
            h.start()
    wait("the gang of four again", lambda: last.formed(killed, [h.index for h in hosts]), 180)
    return out


def final_states(hosts: list[Host], scratch: Path) -> dict:
    """The newest step every host committed, compared across hosts (less each host's data rank)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from engine.checkpoint.manifest import committed_steps

    held = [{m.step: path for _, path, m in committed_steps(h.home / "state" / "checkpoints" / "tiny-cpu")
             if (path / "global.json").exists()} for h in hosts]
    common = set.intersection(*(set(h) for h in held))
    if not common:
        return {"step": None, "equal": None}
    step = max(common)
    states = []
    for h, paths in zip(hosts, held):
        dcp_to_torch_save(paths[step], scratch / f"host{h.index}.pt")
        state = torch.load(scratch / f"host{h.index}.pt", weights_only=False)
        state["loader"].pop("rank")
        states.append(state)

    def same(a, b) -> bool:
        if isinstance(a, dict):
            return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b

    return {"step": step, "equal": all(same(states[0], s) for s in states[1:])}


def loss_curve(root: Path, args) -> dict:
    """The same job (a fixed length, the same global batch) uninterrupted on 4 hosts, and across two
    shrinks and a grow in place (host 3 lost at step 40, host 2 at 80, host 2 back at 120): each
    step's loss as host 0 logged it, and their largest relative difference."""
    steps, curves = args.curve_steps, {}
    for name in ("uninterrupted", "shrunk_and_grown"):
        ports = [free_port() for _ in range(args.hosts)]
        hosts = [Host(root / f"curve-{name}", i, settings(i, args.hosts, ports, True, 2, args.peer_timeout))
                 for i in range(args.hosts)]
        for h in hosts:
            h.start(f"train.max_steps={steps}")
        try:
            if name == "shrunk_and_grown":
                for at, host in ((40, 3), (80, 2)):
                    wait(f"step {at}", lambda a=at: hosts[0].records("step") and hosts[0].records("step")[-1]["step"] >= a,
                         300)
                    hosts[host].vanish()
                wait("step 120", lambda: hosts[0].records("step")[-1]["step"] >= 120, 300)
                hosts[2].start(f"train.max_steps={steps}")
            for h in hosts:
                if h.proc.poll() is None or h.index == 0:
                    wait(f"host {h.index} done", lambda h=h: h.proc.poll() is not None, 600)
        finally:
            end(hosts)
        curves[name] = {r["step"]: r["loss"] for r in hosts[0].records("step")}
        if name == "shrunk_and_grown":
            curves["members"] = [(r["generation"], r["members"], r.get("path")) for r in hosts[0].records("gang formed")]
    ref, got = curves["uninterrupted"], curves["shrunk_and_grown"]
    common = sorted(set(ref) & set(got))
    worst = max(abs(got[s] - ref[s]) / abs(ref[s]) for s in common)
    return {"steps": steps, "max_relative_difference": worst, "steps_compared": len(common), **curves}


def split_brain(root: Path, args) -> dict:
    """Host 0's daemon and worker SIGSTOPped for --pause s (its coordinator runs on), then SIGCONT:
    the others go on without it; it must commit nothing for the generation it lost, rejoin, and
    every host end with the same weights."""
    steps = 100000000
    ports = [free_port() for _ in range(3)]
    hosts = [Host(root / "split-brain", i, settings(i, 3, ports, True, 2, args.peer_timeout)) for i in range(3)]
    for h in hosts:
        h.start()
    try:
        wait("host 0 training", lambda: hosts[0].records("step") and hosts[0].records("step")[-1]["step"] >= 15, 300)
        paused = [hosts[0].worker(), hosts[0].proc.pid]
        for pid in paused:
            os.kill(pid, signal.SIGSTOP)
        stopped = time.time()
        went_on = wait("a gang of two", lambda: hosts[1].formed(stopped, [1, 2]), 120)
        time.sleep(max(0.0, stopped + args.pause - time.time()))
        resumed = time.time()
        for pid in reversed(paused):
            os.kill(pid, signal.SIGCONT)
        rejoined = wait("host 0 rejoined", lambda: hosts[0].formed(resumed, [0, 1, 2]), 120)
        committed = [r["step"] for r in hosts[0].records("checkpoint committed", resumed) if r["_t"] < rejoined["_t"]]
        fenced = [r.get("error") for r in hosts[0].records("checkpoint failed", resumed) if "fenced" in str(r.get("error"))]
        wait("host 0 training again", lambda: hosts[0].first_step_after(rejoined["_t"]), 120)
        time.sleep(3)  # a commit or two of the three together
        for h in hosts:
            h.proc.send_signal(signal.SIGTERM)  # checkpoint and stop: the same step on every host
        for h in hosts:
            h.proc.wait(120)
    finally:
        end(hosts)
    final = final_states(hosts, root / "split-brain")
    return {"pause_s": args.pause, "others_went_on_s": round(went_on["_t"] - stopped, 2),
            "rejoined_s": round(rejoined["_t"] - resumed, 2), "commits_for_the_lost_generation": committed,
            "fenced": fenced, "path": rejoined.get("path"), "final": final, "steps": steps}


def refusals(root: Path, runs: int) -> dict:
    """Two hosts under `tpud run` whose optimizer.lr differ: both must exit 78 naming the key."""
    outcomes = []
    for n in range(runs):
        port = free_port()
        hosts = []
        for i, lr in enumerate(("0.001", "0.01")):
            h = Host(root / f"refusal-{n}", i, f"gang: {{host_index: {i}, host_count: 2, coordinator: '127.0.0.1:{port}'}}\n")
            JOB.append(f"optimizer.lr={lr}")
            started = h.start()
            JOB.pop()
            hosts.append(h)
        codes = []
        for h in hosts:
            try:
                codes.append(h.proc.wait(60))
            except Exception:  # noqa: BLE001  (still waiting: the failure this phase looks for)
                kill_group(h.proc.pid)
                h.proc.wait()
                codes.append(None)
        named = all(any(r.get("key") == "optimizer.lr" for r in h.records("job cannot run here")) for h in hosts)
        outcomes.append({"codes": codes, "seconds": round(time.time() - started, 2), "named": named})
        print(f"  refusal {n + 1}: exits {codes}, {outcomes[-1]['seconds']} s, key named {named}", flush=True)
    held = sum(o["codes"] == [78, 78] and o["seconds"] <= 30 and o["named"] for o in outcomes)
    return {"runs": runs, "held": held, "outcomes": outcomes}


def run_arm(name: str, root: Path, args, victims: list[int], seed: int) -> dict:
    rng = random.Random(seed)
    ports = [free_port() for _ in range(args.hosts)]
    # The restart arm is the gang before this work: it waits for every host (min_hosts = all of them).
    min_hosts = 2 if name == "in_place" else args.hosts
    hosts = [Host(root / name, i, settings(i, args.hosts, ports, name == "in_place", min_hosts, args.peer_timeout))
             for i in range(args.hosts)]
    try:
        for h in hosts:
            h.start()
        for h in hosts:
            wait(f"host {h.index} training", lambda h=h: h.first_step_after(0) and h.records("step")[-1]["step"] >= 5,
                 300)
        drills = []
        for n, victim in enumerate(victims, 1):
            try:
                drills.append(drill(hosts, hosts[victim], rng, blank=True) if name == "in_place"
                              else waiting_drill(hosts, hosts[victim], rng))
            except TimeoutError:
                dump_stacks(hosts)
                raise
            d = drills[-1]
            if "back_error" in d:  # the gang cannot go on: this arm ends here
                print(f"  {name} drill {n}: host {d['victim']}: recovery {d['recovery_s']:.2f} s, pids unchanged "
                      f"{d['pids_unchanged']}, committed lost {d['committed_lost']}; the host never came back: "
                      f"{d['back_error']}", flush=True)
                break
            print(f"  {name} drill {n}: host {d['victim']}: recovery {d['recovery_s']:.2f} s, pids unchanged "
                  f"{d['pids_unchanged']}, committed lost {d['committed_lost']}, back {d['back_s']:.2f} s from "
                  f"{d['from']}", flush=True)
        # Only an elastic gang can shrink: the restart arm's waits for every host.
        shrink = shrink_drill(hosts, args.peer_timeout, blank=True) if name == "in_place" else None
        print(f"  {name} shrink drill: {shrink}", flush=True)
        time.sleep(2)
        mismatches = sum(1 for h in hosts for r in h.tail.records
                         if str(r.get("event", "")).startswith("replica mismatch")
                         or (r.get("event") == "worker exited" and r.get("status") == 79))
    finally:
        end(hosts)
    final = final_states(hosts, root / name)
    recovery = [d["recovery_s"] for d in drills]
    back = [d["back_s"] for d in drills if "back_s" in d] or [float("nan")]
    return {"victims_blank": name == "in_place", "drills": drills, "shrink": shrink, "replica_mismatches": mismatches, "final": final,
            "recovery_s": {"median": statistics.median(recovery), "max": max(recovery)},
            "back_s": {"median": statistics.median(back), "max": max(back)},
            "pids_unchanged": sum(d["pids_unchanged"] for d in drills),
            "committed_lost": sum(d["committed_lost"] for d in drills),
            "from_peer": sum(d.get("from") == "peer" for d in drills),
            "peer_bytes_per_s_median": statistics.median([d["peer_bytes_per_s"] for d in drills
                                                          if d.get("peer_bytes_per_s")] or [0]),
            "came_back": sum("back_s" in d for d in drills)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--drills", type=int, default=20)
    parser.add_argument("--arms", default="in_place,restart")
    parser.add_argument("--peer-timeout", type=float, default=3.0, help="gang.peer_timeout_seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--curve-steps", type=int, default=400, help="the loss-curve run's length; 0: no such run")
    parser.add_argument("--pause", type=float, default=60.0, help="the split-brain drill's SIGSTOP; 0: no such drill")
    parser.add_argument("--refusals", type=int, default=20, help="runs of the refusal race; 0: none")
    parser.add_argument("--workdir", type=Path, help="keep every host's home here (default: a temporary directory)")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "elastic.json")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    victims = [0] + [rng.randrange(args.hosts) for _ in range(args.drills - 1)]
    print(f"victims: {victims}", flush=True)
    arms = {}
    with tempfile.TemporaryDirectory(prefix="tpud-elastic-") as tmp:
        for name in filter(None, args.arms.split(",")):  # --arms '': the loss curve alone
            print(f"{name} arm: {args.drills} drills on {args.hosts} hosts", flush=True)
            try:
                arms[name] = run_arm(name, args.workdir or Path(tmp), args, victims, args.seed)
            except TimeoutError as e:  # reported, and the other phases still run
                print(f"  {name} arm failed: {e}", flush=True)
                arms[name] = {"error": str(e)}
        curve = loss_curve(args.workdir or Path(tmp), args) if args.curve_steps else None
        brain = split_brain(args.workdir or Path(tmp), args) if args.pause else None
        if brain is not None:
            print(f"  split brain: {brain}", flush=True)
        refused = refusals(args.workdir or Path(tmp), args.refusals) if args.refusals else None
    checks = []
    failed = {name: a["error"] for name, a in arms.items() if "error" in a}
    arms_done = {name: a for name, a in arms.items() if "error" not in a}
    checks += [(f"{name} arm ran to its end", False) for name in failed]
    if (a := arms_done.get("in_place")) is not None:
        n = len(a["drills"])
        checks += [("in place: survivors train within 5 s of the kill (max over the drills)", a["recovery_s"]["max"] <= 5),
                   ("in place: survivors' worker PIDs unchanged in every drill", a["pids_unchanged"] == n),
                   ("in place: 0 committed steps lost", a["committed_lost"] == 0),
                   ("in place: the victim is a member again within 10 s of its start (max)", a["back_s"]["max"] <= 10),
                   ("in place: the victim's state from a peer in every drill", a["from_peer"] == n),
                   ("in place: a second loss (down to 2) goes on, and under min_hosts it waits and says so",
                    a["shrink"]["goes_on_with_2"] and a["shrink"]["under_min_hosts_waits"]),
                   ("in place: no replica mismatch, the newest common commit bitwise alike",
                    a["replica_mismatches"] == 0 and a["final"]["equal"] is True)]
    for name, a in arms_done.items():
        if name != "in_place":
            checks.append((f"{name}: 0 committed steps lost", a["committed_lost"] == 0))
    if brain is not None:
        checks.append(("split brain: the paused host committed nothing for the generation it lost, rejoined, and "
                       "every host's newest common commit is bitwise alike",
                       not brain["commits_for_the_lost_generation"] and brain["final"]["equal"] is True))
    if refused is not None:
        checks.append((f"a refusal seen by both hosts (exit 78, key named, within 30 s) in every run",
                       refused["held"] == refused["runs"]))
    if curve is not None:
        checks.append(("loss curve across two shrinks and a grow within 1 % of the uninterrupted run's",
                       curve["max_relative_difference"] <= 0.01))
    missed = [what for what, held in checks if not held]
    print(f"\n{'arm':<10}{'recovery s med':>15}{'max':>7}{'pids kept':>10}{'lost':>6}{'back s med':>11}{'max':>7}"
          f"{'from peer':>10}{'peer MB/s':>10}{'mismatch':>9}{'equal':>7}")
    for name, a in arms_done.items():
        print(f"{name:<10}{a['recovery_s']['median']:>15.2f}{a['recovery_s']['max']:>7.2f}"
              f"{a['pids_unchanged']:>7}/{len(a['drills']):<2}{a['committed_lost']:>6}{a['back_s']['median']:>11.2f}"
              f"{a['back_s']['max']:>7.2f}{a['from_peer']:>7}/{len(a['drills']):<2}"
              f"{a['peer_bytes_per_s_median'] / 1e6:>10.1f}{a['replica_mismatches']:>9}{str(a['final']['equal']):>7}")
    if "in_place" in arms_done and "restart" in arms_done:
        ratio = arms["restart"]["recovery_s"]["median"] / arms["in_place"]["recovery_s"]["median"]
        print(f"\nrecovery restart / in place (medians): {ratio:.2f}x")
    if curve is not None:
        print(f"loss curve, {curve['steps_compared']} steps: largest relative difference "
              f"{curve['max_relative_difference']:.2e} (gangs {curve['members']})")
    print("targets missed: " + "; ".join(missed) if missed else "targets met")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k not in ("out", "workdir")},
                                    "victims": victims, "arms": arms, "loss_curve": curve,
                                    "split_brain": brain, "refusals": refused,
                                    "checks": [{"target": what, "held": held} for what, held in checks],
                                    "missed": missed, "machine": describe()}, indent=2, default=str))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
