"""One job on three hosts: three `tpud run` supervisors, each with its own home, settings and local
checkpoints, on the loopback interface; their workers meet in host 0's coordinator and train
with gloo. Each scenario ends with the final global commit on every host and the loss of every step equal
(as logged, to 5 significant digits) to an uninterrupted three-host run's; across host counts,
to within the float error of summing in another order.

Not asserted: bitwise equal final weights after a gang restart. With three ranks the order in
which gloo sums a gradient element depends on DDP's bucket layout, which DDP rebuilds after the
first step of every worker generation, so a restarted gang rounds differently from then on."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from engine.checkpoint.manifest import committed_steps
from tests.conftest import PYTHON, TINY_JOB, python_env
from tests.helpers import wait_until

pytestmark = pytest.mark.slow
MAX_STEPS = 16
JOB = ["data.corpus_bytes=200000", "data.seq_len=32", "data.micro_batch_size=2", "train.global_batch_size=12",
       "scheduler.warmup_steps=1", "train.log_interval=1", f"train.max_steps={MAX_STEPS}",
       "checkpoint.interval_steps=3", "restart.standby=false", "model.dim=64", "model.n_layers=2",
       "model.ffn_dim=128"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


STARTED: list[subprocess.Popen] = []  # every supervisor a test started, ended however the test ends


@pytest.fixture(autouse=True)
def _end_supervisors():
    yield
    while STARTED:
        proc = STARTED.pop()
        if proc.poll() is None:  # its worker and coordinator die with it (parent-death signal)
            proc.kill()
            proc.wait()


class Host:
    """One host: a home with tpud.yaml's gang section, and its `tpud run` process."""

    def __init__(self, root: Path, index: int, count: int, port: int, env: dict[str, str] | None = None):
        self.index, self.home, self.env = index, root / f"host{index}", env or {}
        self.home.mkdir(parents=True, exist_ok=True)
        self.place(count, port)
        self.proc: subprocess.Popen | None = None
        self.runs = 0

    def place(self, count: int, port: int) -> None:
        (self.home / "tpud.yaml").write_text(
            f"gang: {{host_index: {self.index}, host_count: {count}, coordinator: '127.0.0.1:{port}'}}\n")

    @property
    def log(self) -> Path:
        return self.home / f"run{self.runs}.log"

    def start(self, *overrides: str) -> Host:
        self.runs += 1
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                [PYTHON, "-m", "tpud", "run", str(TINY_JOB), *JOB, *overrides, "--home", str(self.home)],
                stdout=out, stderr=subprocess.STDOUT, env=python_env(OMP_NUM_THREADS="1", **self.env))
        STARTED.append(self.proc)
        return self

    def records(self, event: str | None = None, every_run: bool = True) -> list[dict]:
        found = []
        for run in range(1, self.runs + 1) if every_run else [self.runs]:
            for line in (self.home / f"run{run}.log").read_text().splitlines():
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if event is None or record.get("event") == event:
                    found.append(record)
        return found

    def step(self) -> int:
        return max((r["step"] for r in self.records("step", every_run=False)), default=0)

    def worker(self) -> int:
        return self.records("worker started", every_run=False)[-1]["pid"]

    def wait(self, timeout: float = 240) -> int:
        return self.proc.wait(timeout)

    def losses(self) -> dict[int, float]:
        return {r["step"]: r["loss"] for r in self.records("step")}

    def final(self) -> dict[str, str]:
        """CRC32C of the DCP files of the newest committed step: the trained state, bitwise."""
        _, path, manifest = committed_steps(self.home / "state" / "checkpoints" / "tiny-cpu")[-1]
        assert manifest.step == MAX_STEPS and (path / "global.json").exists()
        return {f.path: f.crc32c for f in manifest.files if f.path.endswith(".distcp")}


def gang(root: Path, count: int = 3, envs: dict[int, dict] | None = None) -> list[Host]:
    port = free_port()
    return [Host(root, i, count, port, (envs or {}).get(i)) for i in range(count)]


def assert_like_reference(hosts: list[Host], reference) -> None:
    for h in hosts:
        h.final()  # the last step is globally committed on every host
        assert h.losses() == reference[1], h.index


def wait_step(host: Host, step: int, timeout: float = 180) -> None:
    wait_until(lambda: host.step() >= step, f"host {host.index} at step {step}", timeout=timeout, interval=0.1)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[list[dict[str, str]], dict[int, float]]:
    """Scenario 1: an uninterrupted three-host run."""
    hosts = [h.start() for h in gang(tmp_path_factory.mktemp("reference"))]
    try:
        assert [h.wait() for h in hosts] == [0, 0, 0]
    finally:
        for h in hosts:
            h.proc.kill()
    finals = [h.final() for h in hosts]  # each host's part: the replicated state, and its own data rank
    losses = hosts[0].losses()
    assert sorted(losses) == list(range(1, MAX_STEPS + 1)) and hosts[1].losses() == losses
    assert losses[MAX_STEPS] < losses[1]
    return finals, losses


def test_a_killed_worker_restarts_the_whole_gang_which_resumes(tmp_path, reference):
    hosts = [h.start() for h in gang(tmp_path)]
    victim = hosts[1]
    kills = sorted(random.Random(15).sample(range(4, MAX_STEPS - 3), 2))
    for n, at in enumerate(kills, 1):
        wait_step(victim, at)
        # The step before is committed (checkpoints every 3 steps): the restart has something to resume.
        wait_until(lambda: max(r["step"] for r in victim.records("checkpoint committed") or [{"step": 0}]) >= at - 3,
                   "a commit before the kill", timeout=60, interval=0.05)
        worker = victim.worker()
        killed_at = time.monotonic()
        os.kill(worker, signal.SIGKILL)
        # Every other host's worker learns of it and exits 77 within the bound (5 s), not a collective timeout.
        for other in (hosts[0], hosts[2]):
            wait_until(lambda: [r["status"] for r in other.records("worker exited")].count(77) == n,
                       f"host {other.index}'s worker leaving", timeout=8, interval=0.05)
        assert time.monotonic() - killed_at < 8
        wait_until(lambda: victim.worker() != worker and victim.records("checkpoint restored")[n - 1:],
                   "the gang restored", timeout=120, interval=0.1)
    assert [h.wait() for h in hosts] == [0, 0, 0]
    assert_like_reference(hosts, reference)
    # Each new generation resumed, on every host, from the same committed step: not from scratch.
    restored = [[r["step"] for r in h.records("checkpoint restored")] for h in hosts]
    assert restored[0] == restored[1] == restored[2] and len(restored[0]) == 2 and min(restored[0]) > 0
    statuses = {h.index: [r["status"] for r in h.records("worker exited")] for h in hosts}
    assert statuses[1] == [137, 137, 0] and statuses[0] == statuses[2] == [77, 77, 0]
    # The peers' restarts spent no budget of theirs: no backoff on hosts 0 and 2.
    assert not [r for h in (hosts[0], hosts[2]) for r in h.records("job state") if r["state"] == "BACKOFF"]
    generations = [r["generation"] for r in hosts[0].records("gang formed")]
    assert generations == sorted(generations) and len(set(generations)) == 3
