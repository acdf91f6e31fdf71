"""A scripted end-to-end run whose normalised output must not change when the code is only reshaped.

Scenarios, each a real `tpud` process on the tiny job: a run to its end (0); a crash restarted
and resumed, then a spike rolled back (0); a hang killed and resumed (0); a NaN with
health.nonfinite stop (76); an invalid job (78); a stop by SIGINT and a preemption's SIGTERM (75);
uploads to GCS (fake-gcs-server) and a second host's run resumed from them; a gang of two hosts
on loopback (0 on both); `tpud validate`, `tpud checkpoints` (table and JSON keys), `tpud --help`. Recorded per scenario: the exit status, the ordered log event names (each run of
repeats kept once), and the CLI outputs with numbers, paths and times masked.

    python testkit/transcript.py REPO OUT.txt    # before and after a reshaping: the two files must not differ
"""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's testkit, whichever REPO runs

from testkit.gcs_server import GcsServer  # noqa: E402
from testkit.helpers import free_port  # noqa: E402

REPO = Path(sys.argv[1]).resolve()
OUT = Path(sys.argv[2])
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_WAIT_POLICY": "PASSIVE", "TPUD_LOG_FORMAT": "json"}
JOB = [f"data.corpus_bytes=400000", "model.dim=64", "model.n_layers=2", "model.ffn_dim=128", "data.seq_len=32",
       "data.micro_batch_size=2", "scheduler.warmup_steps=1", "train.log_interval=1", "checkpoint.interval_steps=5"]
lines: list[str] = []


def mask(text: str, home: Path) -> str:
    text = text.replace(str(home), "HOME").replace(str(REPO), "REPO")
    text = re.sub(r"\d{4}-\d\d-\d\dT[\d:.]+Z?", "T", text)
    text = re.sub(r"\d+(\.\d+)?(e-?\d+)?", "N", text)
    return re.sub(r"[ \t]+", " ", text)


def events(output: str) -> list[str]:
    """Every event name the run logged (sorted: steps and async saves interleave by timing), and the
    job's states in order."""
    names, states = set(), []
    for line in output.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        names.add(re.sub(r"\d+", "N", str(record.get("event", ""))))
        if record.get("event") == "job state":
            states.append(f"{record.get('previous')} -> {record.get('state')}")
    return sorted(names) + ["states: " + ", ".join(states)]


def tpud(home: Path, *args: str, stop_after: float | None = None, timeout: float = 300, env: dict | None = None,
         stop_with: int = signal.SIGINT) -> tuple[int, str]:
    proc = subprocess.Popen([sys.executable, "-m", "tpud", *args, "--home", str(home)], cwd=REPO,
                            env={**ENV, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if stop_after is not None:
        deadline = time.monotonic() + stop_after
        seen = ""
        for line in proc.stdout:
            seen += line
            if '"event": "step"' in line and '"step": 12' in line:
                proc.send_signal(stop_with)
                break
            if time.monotonic() > deadline:
                break
        seen += proc.stdout.read()
        return proc.wait(timeout), seen
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def scenario(name: str, home: Path, *args: str, **kw) -> str:
    code, out = tpud(home, *args, **kw)
    lines.append(f"== {name}: exit {code}")
    if code == 78:
        lines.extend("   " + mask(line, home) for line in out.splitlines() if not line.startswith("{"))
    lines.extend("   " + e for e in events(out))
    return out


@contextlib.contextmanager
def gcs(root: Path):
    """fake-gcs-server with the bucket `transcript`: its STORAGE_EMULATOR_HOST."""
    with GcsServer(root) as server:
        server.client().create_bucket("transcript")
        yield server.env()


def gang(root: Path, job: str) -> None:
    """Two hosts' `tpud run` of one job on loopback, each running a coordinator."""
    ports = [free_port() for _ in range(2)]
    listed = ", ".join(f"'127.0.0.1:{p}'" for p in ports)
    procs = []
    for host in range(2):
        home = root / f"gang{host}"
        home.mkdir()
        (home / "tpud.yaml").write_text(f"gang: {{host_index: {host}, host_count: 2, coordinators: [{listed}]}}\n")
        procs.append(subprocess.Popen([sys.executable, "-m", "tpud", "run", job, *JOB, "train.max_steps=12",
                                       "--home", str(home)], cwd=REPO, env=ENV, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    for host, proc in enumerate(procs):
        out, _ = proc.communicate(timeout=300)
        lines.append(f"== gang host {host}: exit {proc.returncode}")
        lines.extend("   " + e for e in events(out))


def main() -> None:
    job = str(REPO / "configs/jobs/tiny-cpu.yaml")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for home in ("faults", "nan", "hang"):
            (root / home).mkdir()
            (root / home / "tpud.yaml").write_text("allow_fault_injection: true\n")
        scenario("run to the end", root / "plain", "run", job, *JOB, "train.max_steps=20")
        scenario("crash, resume, spike", root / "faults", "run", job, *JOB, "train.max_steps=30",
                 "debug.inject.crash_at_step=[8]", "debug.inject.spike_at_step=[22]",
                 "health.spikes.window_steps=10", "health.spikes.warmup_steps=10")
        scenario("hang, killed, resumed", root / "hang", "run", job, *JOB, "train.max_steps=16",
                 "debug.inject.hang_at_step=[9]", "health.heartbeat_timeout_seconds=3", "health.startup_steps=1",
                 "health.kill_grace_seconds=1", "restart.backoff_initial_seconds=0.5", "checkpoint.memory=null")
        scenario("nan, stop", root / "nan", "run", job, *JOB, "train.max_steps=20",
                 "debug.inject.nan_at_step=[6]", "health.nonfinite=stop")
        bad = root / "bad.yaml"
        bad.write_text("name: bad\ntrain: {max_steps: -3}\n")
        code, out = tpud(root / "bad", "run", str(bad))
        lines.append(f"== invalid job: exit {code}")
        lines.extend("   " + mask(line, root) for line in out.splitlines() if "{" not in line[:1])
        scenario("stopped", root / "stop", "run", job, *JOB, "train.max_steps=100000", stop_after=120)
        scenario("preempted", root / "preempt", "run", job, *JOB, "train.max_steps=100000", stop_after=120,
                 stop_with=signal.SIGTERM)
        with gcs(root / "gcs") as url:
            remote = ["checkpoint.remote=gs://transcript/runs", "checkpoint.interval_steps=4"]
            scenario("uploads", root / "up-a", "run", job, *JOB, "train.max_steps=8", *remote, env=url)
            scenario("resumed from GCS", root / "up-b", "run", job, *JOB, "train.max_steps=10", *remote, env=url)
        gang(root, job)
        for name, args in (("validate", ("validate", str(bad), job)), ("checkpoints", ("checkpoints", job)),
                           ("help", ("--help",))):
            code, out = tpud(root / "plain", *args)
            lines.append(f"== tpud {name}: exit {code}")
            lines.extend("   " + mask(line, root) for line in out.splitlines())
        code, out = tpud(root / "plain", "checkpoints", job, "-o", "json")
        tiers = json.loads(out)["tiers"]
        lines.append(f"== tpud checkpoints -o json: exit {code}: tiers {sorted(tiers)}, keys "
                     f"{sorted(tiers['local'][0]) if tiers.get('local') else None}")
    OUT.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
