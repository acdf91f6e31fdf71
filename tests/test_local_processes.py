"""Several worker processes of one job on one host (device.processes_per_host): the daemon starts
them with torchrun's variables, they shard the model (FSDP2 over gloo) and live and die together:
one killed or hung restarts them all, and the run resumes bit for bit. In a gang each host's
processes shard its state and the hosts are its replicas (HSDP)."""

import json
import os
import random
import signal
import subprocess
import time

import pytest

from engine.spec.schema import DeviceConfig
from tests.conftest import PYTHON, TINY_JOB, python_env
from testkit.states import assert_same_state, checkpoint_state
from tests.test_distributed import torchrun
from testkit.helpers import exited, free_port, read_records, wait_until
from tpud.children import ranks

ARGS = ["data.corpus_bytes=400000", "data.micro_batch_size=2", "data.seq_len=64", "train.max_steps=8",
        "train.log_interval=1", "scheduler.warmup_steps=1", "checkpoint.interval_steps=2", "device.backend=cpu",
        "device.processes_per_host=2", "health.heartbeat_timeout_seconds=3", "health.hang_step_multiple=2",
        "health.startup_steps=1", "health.checkpoint_timeout_seconds=5", "restart.backoff_initial_seconds=0.2"]


def test_processes_per_host_auto_is_one_per_visible_gpu(tmp_path):
    gpus = tmp_path / "gpus"
    for bus in ("0000:01:00.0", "0000:02:00.0", "0000:03:00.0"):
        (gpus / bus).mkdir(parents=True)
    auto = DeviceConfig()
    assert ranks.processes_per_host(auto, {}, gpus) == 3
    assert ranks.processes_per_host(auto, {"CUDA_VISIBLE_DEVICES": "1,2"}, gpus) == 2
    assert ranks.processes_per_host(auto, {"CUDA_VISIBLE_DEVICES": ""}, gpus) == 1
    assert ranks.processes_per_host(auto, {}, tmp_path / "no-driver") == 1
    assert ranks.processes_per_host(DeviceConfig(backend="cpu"), {}, gpus) == 1
    assert ranks.processes_per_host(DeviceConfig(backend="xla"), {}, gpus) == 1
    assert ranks.processes_per_host(DeviceConfig(backend="cpu", processes_per_host=4), {}, gpus) == 4
    assert ranks.too_many(DeviceConfig(backend="cuda", processes_per_host=4), 4, {}, gpus) == (
        "4 processes but 3 GPUs visible (one a GPU)")
    assert ranks.too_many(DeviceConfig(processes_per_host=3), 3, {}, gpus) is None
    assert ranks.too_many(DeviceConfig(processes_per_host=2), 2, {"CUDA_VISIBLE_DEVICES": ""}, gpus) is None  # cpu
    cores = os.cpu_count()
    assert ranks.too_many(DeviceConfig(backend="cpu"), cores + 1, {}, gpus) == (
        f"{cores + 1} processes but this host has {cores} cores (one a core)")
    env = ranks.local_env(1, 2, 29500)
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")} == {
        "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    assert ranks.local_env(0, 1, None) == {}


def run(home, *overrides):
    return subprocess.Popen([PYTHON, "-m", "tpud", "run", str(TINY_JOB), "--home", str(home), *ARGS, *overrides],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=python_env())


def finish(proc, records):
    records += [json.loads(line) for line in proc.stdout if line.startswith("{")]
    assert proc.wait(timeout=300) == 0, records[-5:]
    return records


def losses(records):
    return {r["step"]: r["loss"] for r in records if r["event"] == "step"}


@pytest.mark.slow
def test_two_local_processes_train_like_torchrun_and_one_killed_or_hung_restarts_both_bit_for_bit(tmp_path):
    cut = run(tmp_path / "cut")
    records = read_records(cut, lambda r: r["event"] == "checkpoint committed" and r["step"] >= 2, timeout=300)
    assert [r["local_rank"] for r in records if r["event"] == "worker started"] == [0, 1]
    pids = {r["local_rank"]: r["pid"] for r in records if r["event"] == "worker started"}
    os.kill(pids[1], signal.SIGKILL)
    records += read_records(cut, lambda r: r["event"] == "step" and r["step"] >= 5, timeout=300)
    assert exited(pids[0])  # the other process went down with it
    backoff = [r for r in records if r["event"] == "job state" and r["state"] == "BACKOFF"]
    assert backoff[0]["reason"].startswith("killed")
    # From the memory tier, where each process kept its own shards: a step at least as new as the disk's.
    restored = next(r for r in records if r["event"] == "checkpoint restored")
    assert "/tiny-cpu/rank-" in restored["path"] and restored["step"] >= 2
    # One process stopped (SIGSTOP): silent, it is the job's hang, and both start again.
    pids = {r["local_rank"]: r["pid"] for r in records if r["event"] == "worker started"}
    os.kill(pids[1], signal.SIGSTOP)
    records = finish(cut, records)
    hung = next(r for r in records if r["event"] == "worker hung; terminating it")
    assert hung["bound_s"] <= 10 and exited(pids[0]) and exited(pids[1])
    backoff = [r for r in records if r["event"] == "job state" and r["state"] == "BACKOFF"]
    assert [r["reason"].split(";")[0] for r in backoff] == ["killed", "hang"]

    # The same two ranks under torchrun, never stopped: the same losses (the log prints 6 significant
    # digits) and the same final state, bit for bit.
    reference = torchrun(tmp_path / "torchrun", "data.micro_batch_size=2", "train.max_steps=8", "train.log_interval=1")
    assert [losses(records)[step] for step in range(1, 9)] == pytest.approx(reference["losses"], abs=5e-6)
    final = "checkpoints/tiny-cpu/step_000000008"
    assert_same_state(checkpoint_state(tmp_path / "cut" / "state" / final, tmp_path),
                      checkpoint_state(tmp_path / "torchrun" / final, tmp_path))


@pytest.mark.slow
def test_a_stop_mid_step_takes_a_partial_step_checkpoint_of_both_that_resumes_bit_for_bit(tmp_path):
    """SIGTERM with a deadline shorter than a step: both processes agree on the next micro-batch
    boundary, each saves its shards of the weights and of the gradients accumulated so far."""
    longer = ("train.grad_accum_steps=6", "train.max_steps=7")
    home = tmp_path / "cut"
    home.mkdir()
    (home / "tpud.yaml").write_text("preemption_deadline_seconds: 0.05\n")
    rng = random.Random(5)
    # First at the boundary of step 2, whose interval save is in flight: every rank must agree that it
    # committed (each looks once its own writer is done, and rank 0 writes the manifest last) or one
    # saves alone and hangs. A stop on a boundary rightly takes a whole step: then mid-step.
    for attempt in range(5):
        proc = run(home, *longer)
        step = read_records(proc, lambda r: r["event"] == "step" and r["step"] >= 2 + attempt, timeout=300)[-1]
        time.sleep(0 if attempt == 0 else rng.uniform(0.2, 0.7) * step["step_time_s"])
        proc.send_signal(signal.SIGTERM)
        records = [json.loads(line) for line in proc.stdout if line.startswith("{")]
        assert proc.wait(timeout=120) == 75
        saved = [r for r in records if r["event"] == "checkpoint committed" and r.get("tier") == "local"][-1]
        if saved["micro_step"]:
            break
    else:
        pytest.fail("every stop landed on a step boundary")
    resumed = finish(run(home, *longer), [])
    restored = next(r for r in resumed if r["event"] == "checkpoint restored")
    assert (restored["step"], restored["micro_step"]) == (saved["step"], saved["micro_step"])
    # Bitwise the same two ranks never stopped, under torchrun.
    torchrun(tmp_path / "torchrun", "data.micro_batch_size=2", *longer)
    final = "checkpoints/tiny-cpu/step_000000007"
    assert_same_state(checkpoint_state(home / "state" / final, tmp_path),
                      checkpoint_state(tmp_path / "torchrun" / final, tmp_path))


class GangHost:
    """One host of a two-host gang on loopback: its home, and its `tpud run`, whose output goes to a
    file (two pipes read in turn could fill, and stall a daemon)."""

    def __init__(self, root, index: int, port: int):
        self.index, self.home, self.runs = index, root / f"host{index}", 0
        self.home.mkdir(parents=True)
        (self.home / "tpud.yaml").write_text(f"gang: {{host_index: {index}, host_count: 2, "
                                             f"coordinator: '127.0.0.1:{port}'}}\npreemption_deadline_seconds: 0.05\n")

    def start(self):
        self.runs += 1
        self.log = open(self.home / f"run{self.runs}.log", "w")
        self.proc = subprocess.Popen([PYTHON, "-m", "tpud", "run", str(TINY_JOB), "--home", str(self.home), *ARGS,
                                      *GANG], stdout=self.log, stderr=subprocess.STDOUT,
                                     env=python_env(OMP_NUM_THREADS="1"))
        return self

    def records(self, event=None, runs=None):
        found = []
        for run in runs or range(1, self.runs + 1):
            for line in (self.home / f"run{run}.log").read_text().splitlines():
                if line.startswith("{"):
                    record = json.loads(line)
                    if event is None or record.get("event") == event:
                        found.append(record)
        return found

    def first_step(self) -> dict | None:
        """The newest workers' first step, once they trained one."""
        records = self.records(runs=[self.runs])
        start = max((i for i, r in enumerate(records) if r["event"] == "worker started"), default=len(records))
        return next((r for r in records[start:] if r["event"] == "step"), None)

    def workers(self) -> dict[int, int]:
        """The newest start's processes: local rank -> pid."""
        return {r["local_rank"]: r["pid"] for r in self.records("worker started")}

    def wait(self, timeout=300) -> int:
        code = self.proc.wait(timeout)
        self.log.close()
        return code

    def final(self, step: int):
        return checkpoint_state(self.home / "state" / "checkpoints" / "tiny-cpu" / f"step_{step:09d}", self.home)


GANG = ["train.grad_accum_steps=4", "checkpoint.interval_steps=3"]


@pytest.mark.slow
def test_a_gang_of_two_hosts_of_two_processes_trains_as_four_under_torchrun_and_resumes_bit_for_bit(tmp_path):
    """Each host's two processes shard its state, the hosts replicate it (HSDP over gloo): the same
    ranks as torchrun's four with that mesh, so the same bits. One local process SIGKILLed restarts
    its host from the memory tier (each process its own shards) and the other host with it; one
    SIGSTOPped is its host's hang; a preemption mid-step takes a partial-step checkpoint of both
    hosts; the run ends bitwise as torchrun's uninterrupted one."""
    port = free_port()
    cut = [GangHost(tmp_path, i, port).start() for i in range(2)]
    wait_until(lambda: any(r["step"] >= 3 and r.get("tier") == "local" for r in cut[0].records("checkpoint committed")),
               "a global commit", timeout=240)
    assert cut[0].records("trainer ready")[0]["mesh"] == {"data": 2, "expert": 1, "fsdp": 2, "tensor": 1}
    os.kill(cut[1].workers()[1], signal.SIGKILL)
    wait_until(lambda: len(cut[1].records("worker started")) == 4 and cut[1].records("step")[-1]["step"] >= 5,
               "training again after the kill", timeout=240)
    restored = cut[1].records("checkpoint restored")[-1]
    assert "/tiny-cpu/rank-" in restored["path"] and restored["step"] >= 3  # each process's shards, from memory
    hung = cut[0].workers()
    os.kill(hung[1], signal.SIGSTOP)
    wait_until(lambda: cut[0].records("worker hung; terminating it"), "the hang", timeout=120)
    wait_until(lambda: exited(hung[0]) and exited(hung[1]), "both processes of the hung host")
    wait_until(lambda: len(cut[0].records("worker started")) == 6, "the hung host's processes started again")
    rng = random.Random(5)
    for attempt in range(3):  # a preemption of both: at the next boundary, mid-step unless at a step's end
        step = wait_until(lambda: cut[0].first_step(), "a step of the newest workers", timeout=240)
        time.sleep(rng.uniform(0, 0.3) * step["step_time_s"])  # the step's last micro-batch ends it
        for host in cut:
            host.proc.send_signal(signal.SIGTERM)
        assert [host.wait() for host in cut] == [75, 75]
        saved = [r for r in cut[0].records("checkpoint committed") if r.get("tier") == "local"][-1]
        for host in cut:
            host.start()
        if saved["micro_step"]:
            break
    else:
        pytest.fail("every stop landed on a step boundary")
    assert [host.wait() for host in cut] == [0, 0]
    restored = cut[0].records("checkpoint restored")[-1]
    assert (restored["step"], restored["micro_step"]) == (saved["step"], saved["micro_step"])
    backoff = [r["reason"].split(";")[0] for r in cut[0].records("job state") if r["state"] == "BACKOFF"]
    assert "hang" in backoff

    reference = torchrun(tmp_path / "torchrun", "data.micro_batch_size=2", "train.max_steps=8", "train.log_interval=1",
                         "device.mesh.data=2", *GANG, nproc=4)
    assert [losses(cut[0].records())[step] for step in range(1, 9)] == pytest.approx(reference["losses"], abs=5e-6)
    whole = checkpoint_state(tmp_path / "torchrun" / "checkpoints" / "tiny-cpu" / "step_000000008", tmp_path)
    assert_same_state(cut[0].final(8), whole)
    second = cut[1].final(8)
    assert second["loader"].pop("rank") in (2, 3) and whole["loader"].pop("rank") in range(4)  # a slice of its own
    assert_same_state(second, whole)
