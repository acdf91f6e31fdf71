"""The campaign's cluster: N `tpud daemon`s on loopback, one per simulated host, each with its own
GCE metadata server, its state directory on a small tmpfs of its own (as root; a plain directory
otherwise, and no full-disk faults), its coordinator (gang.coordinators), and one fake-gcs-server
for all of them. A host's processes are its daemon and everything descended from it: SIGKILLed
or SIGSTOPped together, as a VM's are."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from testkit import PYTHON, REPO, python_env
from testkit.gcs_server import GcsServer
from testkit.helpers import free_port
from testkit.logs import Tail
from testkit.metadata_server import MetadataServer
from tpud.control import ControlClient, ControlError, DaemonUnreachable
from tpud.paths import Paths

JOB = "chaos"
BUCKET = "chaos"
REMOTE = f"gs://{BUCKET}/ckpt"
TMPFS_BYTES = 256 << 20


class Host:
    def __init__(self, root: Path, index: int, settings: str, env: dict[str, str], tmpfs: bool):
        self.index, self.home = index, root / f"host{index}"
        self.paths = Paths.resolve(self.home)
        (self.home / "jobs.d").mkdir(parents=True, exist_ok=True)
        (self.home / "tpud.yaml").write_text(settings)
        self.paths.state.mkdir(parents=True, exist_ok=True)
        self.tmpfs = tmpfs and _mount_tmpfs(self.paths.state)
        self.metadata = MetadataServer()
        self.env = {**env, "GCE_METADATA_HOST": self.metadata.host}
        # Steps go to the checker as they are read; kept here they would fill memory in a soak.
        self.log = Tail(self.home / "daemon.log", keep=lambda r: r.get("event") != "step")
        (self.home / "daemon.log").touch()
        self.proc: subprocess.Popen | None = None
        self.stopped = False  # SIGSTOPped by a fault
        self.started_at = 0.0

    # --- its life ---

    def start(self) -> None:
        with open(self.home / "daemon.log", "ab") as out:
            self.proc = subprocess.Popen(
                [PYTHON, "-m", "tpud", "daemon", "--home", str(self.home), "--metrics-addr", "127.0.0.1:0"],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                env=python_env(**self.env))
        self.stopped, self.started_at = False, time.time()

    @property
    def up(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def processes(self) -> list[int]:
        """The daemon and every process descended from it."""
        if not self.up:
            return []
        tree, parents = [self.proc.pid], _parents()
        for pid in tree:
            tree += [child for child, parent in parents.items() if parent == pid]
        return tree

    def signal(self, signum: int) -> None:
        for pid in self.processes():
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        """Everything on the host at once (a VM gone); a stopped host too."""
        pids = self.processes()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc is not None:
            self.proc.wait()
        _wait_gone(pids)
        self.stopped = False

    def wipe(self) -> None:
        """A new VM: its disk and memory blank (the tmpfs stays mounted, emptied). The injected
        faults' markers stay: they are the campaign's record that a transient fault struck, which
        a new VM replaying the step must not meet again."""
        markers = self.paths.state / "jobs" / JOB / "faults"
        kept = {p.name: p.read_bytes() for p in markers.iterdir()} if markers.is_dir() else {}
        for entry in self.paths.state.iterdir():
            shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)
        if kept:
            markers.mkdir(parents=True)
            for name, data in kept.items():
                (markers / name).write_bytes(data)
        shutil.rmtree(self.paths.memory, ignore_errors=True)
        self.metadata.set("instance/preempted", "FALSE")
        self.metadata.set("instance/maintenance-event", "NONE")

    def close(self) -> None:
        self.kill()
        shutil.rmtree(self.paths.memory, ignore_errors=True)
        self.metadata.close()
        if self.tmpfs:
            subprocess.run(["umount", "-l", str(self.paths.state)], check=False)

    # --- what a user can read ---

    def status(self, timeout: float = 5.0) -> tuple[dict | None, float]:
        """The chaos job's `tpud status` row over the control socket, and how long the answer took
        (None: no answer)."""
        asked = time.monotonic()
        try:
            result = ControlClient(self.paths.runtime / "control.sock", timeout=timeout).call("status")
        except (DaemonUnreachable, ControlError, OSError, ValueError):
            return None, time.monotonic() - asked
        row = next((job for job in result.get("jobs", []) if job.get("name") == JOB), {})
        return row, time.monotonic() - asked

    def start_job(self) -> str:
        """`tpud start` of the chaos job, as an operator types it: what it printed."""
        try:
            done = subprocess.run([PYTHON, "-m", "tpud", "start", JOB, "--home", str(self.home)], capture_output=True,
                                  text=True, timeout=60, env=python_env(**self.env))
        except subprocess.TimeoutExpired:  # a daemon stopped by a fault meanwhile: the operator looks again later
            return "no answer within 60 s"
        return (done.stdout.strip() or done.stderr.strip() or f"exit {done.returncode}").splitlines()[-1]

    def worker(self) -> int | None:
        started = [r for r in self.log.records if r.get("event") == "worker started" and r.get("job") == JOB]
        pid = started[-1]["pid"] if started else None
        return pid if pid in self.processes() else None

    def checkpoints(self) -> Path:
        return self.paths.state / "checkpoints" / JOB

    def rss_bytes(self) -> int | None:
        try:
            return int(Path(f"/proc/{self.proc.pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, AttributeError, IndexError, ValueError):
            return None


class Cluster:
    def __init__(self, root: Path, hosts: int, min_hosts: int, tmpfs: bool):
        self.root = root
        self.gcs = GcsServer(root / "gcs")
        self.gcs.start()
        self.gcs.client().create_bucket(BUCKET)
        ports = [free_port() for _ in range(hosts)]
        listed = ", ".join(f"'127.0.0.1:{p}'" for p in ports)
        env = {**self.gcs.env(), "OMP_NUM_THREADS": "1"}
        # allow_fault_injection: the job's debug.inject strikes the faults that happen at a step.
        self.hosts = [Host(root, i, f"allow_fault_injection: true\ngang: {{host_index: {i}, host_count: {hosts}, "
                                    f"coordinators: [{listed}], min_hosts: {min_hosts}}}\n", env, tmpfs)
                      for i in range(hosts)]
        self.gcs_frozen = False

    def write_job(self, text: str, host: Host | None = None, *, replace: bool = False) -> None:
        """The job file on every host (or one), edited in place or replaced by a rename."""
        for h in [host] if host else self.hosts:
            path = h.home / "jobs.d" / f"{JOB}.yaml"
            if replace:
                tmp = path.with_name(f".{JOB}.yaml.new")
                tmp.write_text(text)
                os.replace(tmp, path)
            else:
                with open(path, "r+" if path.exists() else "w") as f:
                    f.truncate(0)
                    f.write(text)

    def read(self) -> None:
        for h in self.hosts:
            h.log.read()

    def close(self) -> None:
        if self.gcs_frozen and self.gcs.proc is not None:
            self.gcs.proc.send_signal(signal.SIGCONT)
        for h in self.hosts:
            h.close()
        self.gcs.close()


def job_text(inject: dict, max_steps: int = 100_000_000, interval_steps: int = 20, remote: str | None = REMOTE,
             skip: list[list[int]] | None = None) -> str:
    """The campaign's job: the tiny model, every tier (memory, local, GCS), replica checks and
    spike rollback on, the global batch fixed so that every membership trains the same batches.
    `skip`: data.skip's sample ranges (the reference run's: the campaign's skip ledger)."""
    lines = [
        f"name: {JOB}",
        f"include: [{REPO}/configs/models/tiny.yaml, {REPO}/configs/attention/auto.yaml]",
        "device: {backend: cpu}",
        "optimizer: {lr: 3.0e-3, weight_decay: 0.1}",
        f"data: {{corpus_bytes: 400000, seq_len: 32, micro_batch_size: 2, skip: {json.dumps(skip or [])}}}",
        "model: {dim: 64, n_layers: 2, ffn_dim: 128}",
        f"train: {{max_steps: {max_steps}, log_interval: 1, global_batch_size: 12, seed: 0}}",
        # Constant: the lr is a function of the step and max_steps, and max_steps is set only when
        # the campaign ends; the reference run must see the lr the campaign's steps saw.
        "scheduler: {name: constant, warmup_steps: 1}",
        f"checkpoint: {{interval_steps: {interval_steps}, remote: {json.dumps(remote)}, memory: {{interval_steps: 5, "
        "max_overhead: 1}}",
        "health: {replicas: {interval_steps: 10}, heartbeat_timeout_seconds: 20, checkpoint_timeout_seconds: 60}",
    ]
    if inject:
        lines.append(f"debug: {{inject: {json.dumps(inject)}}}")
    return "\n".join(lines) + "\n"


def _mount_tmpfs(path: Path) -> bool:
    if os.geteuid() != 0:
        return False
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_BYTES}", "tmpfs", str(path)],
                          capture_output=True, check=False)
    return done.returncode == 0


def _parents() -> dict[int, int]:
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                found[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    return found


def _wait_gone(pids: list[int], timeout: float = 10.0) -> None:
    """SIGKILLed processes reaped by their parents (or init): none holds a port or file after."""
    deadline = time.monotonic() + timeout
    for pid in pids:
        while time.monotonic() < deadline:
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                break
            if state == "Z" and pid != os.getpid():
                break
            time.sleep(0.02)
