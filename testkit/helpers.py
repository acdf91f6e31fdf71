"""What many tests share: a real daemon to drive, waiting on conditions, reading checkpoints,
writing job files."""

from __future__ import annotations

import json
import os
import random
import re
import socket
import subprocess
import textwrap
import time
import urllib.request
from datetime import datetime
from pathlib import Path

from engine.checkpoint import manifest as mf
from testkit import PYTHON, REPO, TINY_JOB, python_env
from tpud.control import ControlClient, ControlError, DaemonUnreachable
from tpud.paths import Paths


def wait_until(predicate, what: str = "the condition", timeout: float = 60.0, interval: float = 0.05):
    """Poll `predicate` until it returns something true, and return that."""
    deadline = time.monotonic() + timeout
    while True:
        if (value := predicate()):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(interval)


def committed(checkpoints: Path) -> list[tuple[int, int]]:
    """(step, micro_step) of every committed checkpoint in a job's local tier, oldest first."""
    return [(step, m.micro_step) for step, _, m in mf.committed_steps(checkpoints)]


def write(root: Path, name: str, text: str) -> Path:
    """A job (or included) file, dedented; its directory is created."""
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text).lstrip("\n"))
    return path


JOB = """\
name: {name}
include: {repo}/configs/jobs/tiny-cpu.yaml
data: {{corpus_bytes: 400000, seq_len: 64, micro_batch_size: 4}}
train: {{max_steps: {max_steps}, log_interval: 1}}
scheduler: {{warmup_steps: 1}}
checkpoint: {{interval_steps: 0}}
"""


def job_text(name: str, max_steps: int = 100000) -> str:
    return JOB.format(name=name, repo=REPO, max_steps=max_steps)


class Daemon:
    def __init__(self, home: Path, env: dict | None = None):
        self.home = home
        self.log = open(home / "daemon.log", "ab")
        self.log_start = self.log.seek(0, os.SEEK_END)  # a home's earlier daemons logged before it
        self.proc = subprocess.Popen([PYTHON, "-m", "tpud", "daemon", "--home", str(home), "--metrics-addr",
                                      "127.0.0.1:0"], stdout=self.log, stderr=subprocess.STDOUT,
                                     env=python_env(**(env or {})))

    def cli(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([PYTHON, "-m", "tpud", *args, "--home", str(self.home)], capture_output=True,
                              text=True, env=python_env(), timeout=120)

    def status(self) -> dict[str, dict]:
        """`tpud status -o json`'s jobs by name, asked over the control socket from this process:
        a `tpud status` process every poll would take a CPU from the workers on a 2-core machine."""
        try:
            result = ControlClient(Paths.resolve(self.home).runtime / "control.sock").call("status")
        except (DaemonUnreachable, ControlError, OSError):
            return {}
        return {job["name"]: job for job in result["jobs"]}

    def wait_for(self, predicate, what: str, timeout: float = 120):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            jobs = self.status()
            if jobs and predicate(jobs):
                return jobs
            time.sleep(0.3)
        raise AssertionError(f"timed out waiting for {what}; status: {self.status()}\n{self.tail()}")

    def tail(self) -> str:
        return (self.home / "daemon.log").read_text()[-4000:]

    def events(self, event: str) -> list[dict]:
        """This daemon's log records of `event` (not those of the home's earlier daemons)."""
        with open(self.home / "daemon.log", "rb") as log:
            log.seek(self.log_start)
            lines = log.read().decode(errors="replace").splitlines()
        records = []
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if record.get("event") == event:
                records.append(record)
        return records

    def logged_at(self, event: str, after: float) -> float | None:
        """The wall-clock time of this daemon's first record of `event` at or after `after`."""
        for record in self.events(event):
            at = datetime.fromisoformat(record["timestamp"].replace("Z", "+00:00")).timestamp()
            if at >= after:
                return at
        return None


def tpud_imports(*argv: str) -> tuple[subprocess.CompletedProcess, set[str]]:
    """Run `tpud ARGV` under python -X importtime: the result, and every module it imported."""
    result = subprocess.run([PYTHON, "-X", "importtime", "-m", "tpud", *argv], capture_output=True, text=True,
                            env=python_env(), timeout=120)
    lines = result.stderr.splitlines()
    return result, {line.rpartition("|")[2].strip() for line in lines if line.startswith("import time:")}


def cpu_seconds(pid: int) -> float:
    """The process's own user and system time (its children not counted)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children_of(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found



def exited(pid: int) -> bool:
    """Gone, or dead and waiting for its parent to reap it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def children_by_kind(pid: int) -> dict[str, list[int]]:
    """A daemon's live helpers and workers by what they are: forkserver, worker (forked by the fork
    server, or started cold by the daemon), reader (the job-file reader), coordinator (the gang's), or
    other (none, since the reader stopped being a multiprocessing pool). By command line."""
    found: dict[str, list[int]] = {}
    for child in children_of(pid):
        try:
            command = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if exited(child):
            continue
        kind = next((k for module, k in (("tpud.worker.forkserver", "forkserver"), ("tpud.worker", "worker"),
                                         ("tpud.jobfiles.offloop", "reader"), ("tpud.worker.gang.coordinator", "coordinator"))
                     if f"-m {module} " in command), "other")
        found.setdefault(kind, []).append(child)
        if kind == "forkserver":
            forked = [p for p in children_of(child) if not exited(p)]
            if forked:
                found.setdefault("worker", []).extend(forked)
    return found


def metric(home, name, **labels) -> float | None:
    address = (Paths.resolve(home).runtime / "metrics.addr").read_text().strip()
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    match = re.search(rf"^{name}{{{re.escape(want)}}} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else None


def exits(daemon):
    return [r["status"] for r in daemon.events("worker exited")]


def read_records(proc, done, timeout: float = 120) -> list[dict]:
    """JSON log records from proc's stdout (text) up to and including the first for which done(record);
    other lines (a traceback, say) are skipped."""
    records, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith("{"):
            records.append(json.loads(line))
            if done(records[-1]):
                return records
    raise AssertionError(f"not seen before {'the end of output' if not line else 'the timeout'}; "
                         f"last records: {records[-5:]}")


def free_port() -> int:
    """A loopback port free now, below the kernel's ephemeral range: a port-0 listener started in
    the meantime (a daemon's metrics, a client's socket) can never be given it before its owner
    binds it, as happened once to a gang's coordinator in CI."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.SystemRandom()
    for _ in range(1000):
        port = rng.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free loopback port below {low}")


def data_parallel(state_dir: Path, world: int, *overrides: str, steps: int = 12, memory: bool = False) -> list[dict]:
    """`world` data-parallel processes (gloo, DDP) training the tiny job (tests/replica_probe.py);
    each rank's report: its exit code, its replica_mismatch and straggler events, its steps. With
    `memory`, a memory tier in STATE_DIR/shm."""
    port = free_port()
    extra = {"TPUD_MEMORY_DIR": str(state_dir / "shm")} if memory else {}
    args = [PYTHON, str(REPO / "tests" / "replica_probe.py"), str(TINY_JOB), str(state_dir),
            f"train.max_steps={steps}", "train.log_interval=1", "scheduler.warmup_steps=1", "data.seq_len=32",
            "data.micro_batch_size=2", "data.corpus_bytes=400000", "device.mesh.data=-1", "device.mesh.fsdp=1",
            "checkpoint.interval_steps=4", "health.replicas.interval_steps=2", *overrides]
    procs = [subprocess.Popen(args, env=python_env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world),
                                                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                                                   OMP_NUM_THREADS="1", **extra),
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for r in range(world)]
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode in (0, 77, 79), err[-3000:]
    return [json.loads((state_dir / f"rank{r}.json").read_text()) for r in range(world)]
