"""The gang's control plane at scale, without training: 64 and 256 members on loopback.

Each member is a tpud.worker.gang.member.GangMember (the real join, formation rule, watcher and store
keys), run as a thread; --procs processes hold them, all meeting in one real coordinator
(`python -m tpud.worker.gang.coordinator`, a TCPStore). No process group is formed (as under xla) and
nothing trains: what is measured is the protocol. A member's disruption is recorded instead of
ending its process, and it then joins the next generation as a worker kept in place does.

Per size: seconds to form (from the first member starting to join until every member is in
the gang); the coordinator's CPU share of one core and its bytes per second (read + written,
/proc/PID/io) over a steady window while every watcher beats; seconds to detect and exclude
one lost member (its watcher and beats stop: from then until every other member is in the next
gang without it; gang.peer_timeout_seconds is the floor). Targets: form within 10 s, exclude
within peer timeout + 5 s, the coordinator under half a core at 256 members.

    .venv/bin/python bench/gang_scale.py                       # ~2 min: 64 and 256 members
    .venv/bin/python bench/gang_scale.py --sizes 64 --out /tmp/gang_scale.json
Results: a table on stdout and bench/results/gang_scale.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from machine import describe  # noqa: E402
from testkit.helpers import free_port  # noqa: E402

SPEC = {"name": "scale", "train.seed": 0}


def member_process(address: str, hosts: int, first: int, count: int, peer_timeout: float, work: Path) -> None:
    """`count` members (hosts first..first+count-1) as threads; their times as JSON lines in work/."""
    from tpud.worker.gang.member import GangMember

    out = open(work / f"members-{first}.jsonl", "a", buffering=1)
    lock = threading.Lock()

    def note(**record) -> None:
        with lock:
            out.write(json.dumps(record) + "\n")

    class Simulated(GangMember):
        def _disrupted(self, reason: str, reachable: bool = True, bump: bool = True) -> None:
            if self._leaving or self.regrouping.is_set():
                return
            note(host=self.host, event="disrupted", t=time.time(), reason=reason[:120])
            self.regrouping.set()  # its thread leaves the generation, as a worker kept in place does

    def run(host: int) -> None:
        member = Simulated("scale", host, hosts, address, peer_timeout, lambda event: None, min_hosts=2)
        member.regrouping = threading.Event()
        note(host=host, event="joining", t=time.time())
        member.join("xla", lambda: (work / "stop").exists(), SPEC)
        note(host=host, event="formed", t=time.time(), generation=member.generation, members=len(member.members))
        while not (work / "stop").exists():
            if (work / f"kill-{host}").exists():
                member._leaving = True  # it stops beating and never joins again: a lost host
                member._stop.set()
                note(host=host, event="killed", t=time.time())
                return
            if member.regrouping.wait(0.1):
                member.leave_generation()
                member.regrouping.clear()
                member.join("xla", lambda: (work / "stop").exists(), SPEC)
                note(host=host, event="formed", t=time.time(), generation=member.generation,
                     members=len(member.members), without=sorted(set(range(hosts)) - set(member.members)))

    threads = [threading.Thread(target=run, args=(h,), daemon=True) for h in range(first, first + count)]
    (work / f"ready-{first}").touch()  # imported: the members start together, on the bench's word
    while not (work / "go").exists():
        time.sleep(0.01)
    for t in threads:
        t.start()
    while not (work / "stop").exists():
        time.sleep(0.2)


def records(work: Path) -> list[dict]:
    found = []
    for path in work.glob("members-*.jsonl"):
        for line in path.read_text().splitlines():
            try:
                found.append(json.loads(line))
            except ValueError:
                pass
    return found


def wait(what: str, probe, timeout: float):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (got := probe()):
            return got
        time.sleep(0.1)
    raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")


def usage(pid: int) -> tuple[float, int]:
    """The process's CPU seconds and bytes read + written so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    io = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
    return cpu, int(io["rchar"]) + int(io["wchar"])


def measure(size: int, procs: int, peer_timeout: float, steady_s: float) -> dict:
    address = f"127.0.0.1:{free_port()}"
    with tempfile.TemporaryDirectory(prefix="tpud-gang-scale-") as tmp:
        work = Path(os.environ.get("GANG_SCALE_KEEP") or tmp)
        coordinator = subprocess.Popen([sys.executable, "-m", "tpud.worker.gang.coordinator", address],
                                       stdout=subprocess.DEVNULL, cwd=REPO)
        children = []
        try:
            time.sleep(2)  # its torch import
            per = -(-size // procs)
            for first in range(0, size, per):
                children.append(subprocess.Popen([sys.executable, __file__, "--member-proc", address, str(size),
                                                  str(first), str(min(per, size - first)), str(peer_timeout),
                                                  str(work)], cwd=REPO))
            wait("every member process ready", lambda: len(list(work.glob("ready-*"))) == len(children), 120)
            (work / "go").touch()
            formed = wait("every member formed", lambda: (len([r for r in records(work) if r["event"] == "formed"])
                                                          >= size) and records(work), 300)
            joining = min(r["t"] for r in formed if r["event"] == "joining")
            form_s = max(r["t"] for r in formed if r["event"] == "formed") - joining
            cpu0, bytes0 = usage(coordinator.pid)
            t0 = time.monotonic()
            time.sleep(steady_s)
            cpu1, bytes1 = usage(coordinator.pid)
            window = time.monotonic() - t0
            victim = size - 1
            (work / f"kill-{victim}").touch()
            killed = wait("the victim stopping", lambda: [r for r in records(work)
                                                         if r["event"] == "killed" and r["host"] == victim], 30)[0]["t"]
            regrouped = wait("every other member in a gang without it", lambda: (
                len({r["host"] for r in records(work) if r["event"] == "formed" and r.get("without") == [victim]})
                >= size - 1) and records(work), 120)
            exclude_s = max(r["t"] for r in regrouped if r["event"] == "formed" and r.get("without") == [victim]) - killed
        finally:
            (work / "stop").touch()
            for child in children:
                try:
                    child.wait(20)
                except subprocess.TimeoutExpired:
                    child.kill()
            coordinator.terminate()
            coordinator.wait()
    return {"members": size, "processes": procs, "form_s": round(form_s, 2),
            "coordinator_cpu_share": round((cpu1 - cpu0) / window, 4),
            "coordinator_bytes_per_s": round((bytes1 - bytes0) / window), "exclude_s": round(exclude_s, 2),
            "peer_timeout_s": peer_timeout}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--member-proc":
        address, hosts, first, count, timeout, work = sys.argv[2:8]
        member_process(address, int(hosts), int(first), int(count), float(timeout), Path(work))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="64,256")
    parser.add_argument("--procs", type=int, default=8, help="processes holding the member threads")
    parser.add_argument("--peer-timeout", type=float, default=3.0)
    parser.add_argument("--steady", type=float, default=10.0, help="seconds of the steady window")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "gang_scale.json")
    args = parser.parse_args()
    results = []
    for size in (int(s) for s in args.sizes.split(",")):
        print(f"{size} members ...", flush=True)
        results.append(measure(size, args.procs, args.peer_timeout, args.steady))
    checks = []
    for r in results:
        checks += [(f"{r['members']} members form within 10 s", r["form_s"] <= 10),
                   (f"{r['members']} members exclude a lost one within the peer timeout + 5 s",
                    r["exclude_s"] <= r["peer_timeout_s"] + 5)]
        if r["members"] >= 256:
            checks.append((f"{r['members']} members: the coordinator under half a core",
                           r["coordinator_cpu_share"] < 0.5))
    missed = [what for what, held in checks if not held]
    print(f"\n{'members':>8}{'form s':>8}{'exclude s':>10}{'coord CPU':>10}{'coord KB/s':>11}")
    for r in results:
        print(f"{r['members']:>8}{r['form_s']:>8.2f}{r['exclude_s']:>10.2f}{r['coordinator_cpu_share']:>10.1%}"
              f"{r['coordinator_bytes_per_s'] / 1e3:>11.1f}")
    print("targets missed: " + "; ".join(missed) if missed else "targets met")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": vars(args) | {"out": None}, "results": results,
                                    "checks": [{"target": w, "held": h} for w, h in checks], "missed": missed,
                                    "machine": describe()}, indent=2, default=str))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
