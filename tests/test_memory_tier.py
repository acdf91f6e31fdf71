"""The memory tier: states in shared memory that outlive the worker (engine.checkpoint.memory),
their budget in the daemon (tpud.job.memory), and a worker killed under the daemon resuming
from memory."""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import structlog
import structlog.testing
import torch

from engine import events
from engine.checkpoint import manifest as mf
from engine.hooks import Boundary
from engine.requests import Action, Request
from engine.spec.schema import JobSpec
from engine.runtime import Runtime
from engine.train import Trainer
from tests.conftest import tiny
from testkit.helpers import Daemon, metric, wait_until, write
from testkit.recorders import Recorder
from tests.test_checkpoint import assert_same_training_state, job_dir
from tpud.job.memory import JobMemory, MemoryBudget, state_bytes
from tpud.paths import Paths

# Every step saved (not auto): no overhead budget (max_overhead 1), and on a CPU the tier commits in line.
QUICK = ("train.max_steps=12", "train.log_interval=1", "scheduler.warmup_steps=1", "data.micro_batch_size=2",
         "data.seq_len=32", "train.grad_accum_steps=3", "checkpoint.interval_steps=4",
         "checkpoint.memory.interval_steps=1", "checkpoint.memory.max_overhead=1")


def memory_steps(root: Path) -> list[tuple[int, int]]:
    return [(step, m.micro_step) for step, _, m in mf.parts(root)]


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """The QUICK run uninterrupted, its memory tier dropped: the trainer that tests compare with."""
    home = tmp_path_factory.mktemp("whole")
    run = Trainer(tiny(*QUICK), home, Recorder(), runtime=Runtime(memory_dir=home / "shm"))
    assert run.run() == 0
    shutil.rmtree(home / "shm")
    return run


@pytest.mark.slow
def test_a_stopped_run_resumes_from_memory_bitwise_and_a_corrupt_state_is_skipped(tiny_spec, tmp_path, memory, runtime,
                                                                                   whole):
    spec = tiny_spec(*QUICK)
    # STOP takes no checkpoint: disk has step 4, memory the two newest states it saved, every step
    # but while the step-4 disk write still read a slot (under load it can outlast a step).
    stop_at_7 = Recorder({Boundary(7, 0): Request(Action.STOP)})
    assert Trainer(spec, tmp_path / "cut", stop_at_7, runtime=runtime).run() == 75
    assert [s for s, _, _ in mf.committed_steps(job_dir(tmp_path / "cut"))] == [4]
    (older, _), (latest, _) = held = memory_steps(memory)
    assert 4 < older < latest <= 7, held
    newest = memory / mf.step_dir_name(latest)
    with open(newest / "state.bin", "r+b") as f:  # one flipped byte: never trusted
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    resumed = Trainer(spec, tmp_path / "cut", hooks := Recorder(), runtime=runtime)
    assert resumed.progress.step == older
    assert hooks.of(events.CheckpointRestored)[0].path == str(memory / mf.step_dir_name(older))
    assert not newest.exists()
    assert resumed.run() == 0
    assert_same_training_state(whole, resumed)


def test_memory_saves_keep_the_log_interval_and_never_hold_a_non_finite_step(tiny_spec, tmp_path, memory, runtime):
    spec = tiny_spec("train.max_steps=12", "train.log_interval=4", "scheduler.warmup_steps=1", "data.seq_len=32",
                     "data.micro_batch_size=2", "checkpoint.interval_steps=0", "checkpoint.memory.interval_steps=1",
                     "checkpoint.memory.max_overhead=1", "debug.inject.nan_at_step=6", "health.nonfinite=stop")
    with structlog.testing.capture_logs() as logged:
        assert Trainer(spec, tmp_path, hooks := Recorder(), runtime=runtime).run() == 76
    # Every step saved to memory, one report of steps 1-4 (their events, and one log line).
    assert [r["step"] for r in logged if r["event"] == "step"] == [4]
    assert [e.step for e in hooks.of(events.Step)] == [1, 2, 3, 4]
    assert [c.step for c in hooks.of(events.CheckpointCommitted)] == [1, 2, 3, 4, 5]
    assert max(memory_steps(memory)) == (5, 0)  # step 6 trained on a NaN: never saved


def test_a_rollback_in_place_restores_the_memory_tiers_state_from_just_before_the_bad_step(
        tiny_spec, tmp_path, memory, runtime):
    spec = tiny_spec("train.max_steps=12", "train.log_interval=4", "scheduler.warmup_steps=1", "data.seq_len=32",
                     "data.micro_batch_size=2", "checkpoint.interval_steps=0", "checkpoint.memory.interval_steps=1",
                     "checkpoint.memory.max_overhead=1", "debug.inject.nan_at_step=6")
    assert Trainer(spec, tmp_path, hooks := Recorder(), runtime=runtime).run() == 0
    (rolled,) = hooks.of(events.RolledBack)
    assert (rolled.step, rolled.restored_step, rolled.verdict, rolled.redone_steps) == (6, 5, "data", 1)
    # Restored twice (the replay, then the skip), both times from memory: the disk has nothing yet.
    restored = hooks.of(events.CheckpointRestored)
    assert [r.step for r in restored] == [5, 5] and all(r.path.startswith(str(memory)) for r in restored)


@pytest.mark.slow
def test_a_partial_step_goes_through_memory_and_resumes_from_it(tiny_spec, tmp_path, memory, runtime, whole):
    spec = tiny_spec(*QUICK)
    stop = {Boundary(5, 1): Request(Action.CHECKPOINT_AND_EXIT, deadline_s=0)}
    assert Trainer(spec, tmp_path / "cut", Recorder(stop), runtime=runtime).run() == 75
    assert (5, 1) in memory_steps(memory)
    on_disk = [(s, m.micro_step) for s, _, m in mf.committed_steps(job_dir(tmp_path / "cut"))]
    assert (5, 1) in on_disk  # written from the memory copy
    resumed = Trainer(spec, tmp_path / "cut", hooks := Recorder(), runtime=runtime)
    assert (resumed.progress.step, resumed.progress.micro_step) == (5, 1)
    assert hooks.of(events.CheckpointRestored)[0].path.startswith(str(memory))
    resumed.run()
    assert_same_training_state(whole, resumed)


@pytest.mark.slow
def test_a_request_between_boundaries_writes_the_newest_memory_state_to_disk(tiny_spec, tmp_path, memory, runtime):
    spec = tiny_spec(*QUICK, "train.max_steps=30", "checkpoint.interval_steps=100")
    promoted = []

    def promote():  # what the worker's channel thread does when a request arrives mid-step
        promoted.append(trainer._between_boundaries(Request(Action.CHECKPOINT)))

    hooks = Recorder({Boundary(9, 1): promote})
    trainer = Trainer(spec, tmp_path, hooks, runtime=runtime)
    assert trainer.run() == 0
    assert promoted == [True]  # answered: the loop never saw the request
    committed = [e for e in hooks.of(events.CheckpointCommitted) if e.tier == "local"]
    assert [(e.step, e.reason) for e in committed][:1] == [(9, "request")]
    memory_commits = [e.step for e in hooks.of(events.CheckpointCommitted) if e.tier == "memory"]
    assert memory_commits == list(range(1, 31))  # every step; the final save goes through memory too


def test_the_budget_refuses_what_does_not_fit_and_counts_every_job(tmp_path):
    spec = JobSpec.model_validate({"name": "a", "checkpoint": {"memory": {"interval_steps": 1}}})
    one = 2 * state_bytes(spec)
    budget = MemoryBudget(share=0.5, total=int(3.5 * one))  # room for one job's tier, not two
    first, second = JobMemory("a", tmp_path, budget), JobMemory("b", tmp_path, budget)
    assert first.worker_env(spec) == {"TPUD_MEMORY_DIR": str(tmp_path)}
    assert first.worker_env(spec) is not None  # a restart keeps its own reservation
    assert second.worker_env(spec) is None
    assert "needs" in second.refused and "memory_tier_max_share 0.5" in second.refused
    assert "other jobs hold" in second.refused and "a " in second.refused
    # By default (not in the job file) it runs without the tier instead.
    default = JobSpec.model_validate({"name": "b"})
    assert second.worker_env(default) == {} and second.refused is None
    first.discard()
    assert second.worker_env(spec) == {"TPUD_MEMORY_DIR": str(tmp_path)}


@pytest.mark.parametrize("overrides", [[], ["model.moe={num_experts: 4, top_k: 2, expert_ffn_dim: 96}"],
                                       ["model.qk_norm=true", "model.head_size=64", "model.n_kv_heads=2"]])
def test_the_state_estimate_covers_the_real_state(tiny_spec, overrides):
    spec = tiny_spec(*overrides)
    from engine.models.llama import Transformer

    with torch.device("meta"):
        model = Transformer(spec.model, None, None)
    weights = sum(p.numel() for p in model.parameters()) * 4
    assert weights * 4 <= state_bytes(spec) <= weights * 4 * 1.01  # weights, two moments, gradients


@pytest.mark.slow
def test_a_killed_worker_resumes_from_memory_under_the_daemon(tmp_path):
    jobs = tmp_path / "jobs.d"
    write(jobs, "mem.yaml", """\
name: mem
include: {repo}/configs/jobs/tiny-cpu.yaml
data: {{seq_len: 32, micro_batch_size: 2}}
train: {{max_steps: 100000, log_interval: 1}}
scheduler: {{warmup_steps: 1}}
checkpoint: {{interval_steps: 100000, memory: {{interval_steps: 1, max_overhead: 1}}}}
""".format(repo=Path(__file__).resolve().parents[1]))
    memory = Paths.resolve(tmp_path).memory / "mem"
    daemon = Daemon(tmp_path)
    try:
        status = daemon.wait_for(lambda s: (s.get("mem", {}).get("memory_checkpoint") or {}).get("step", 0) >= 5,
                                 "memory checkpoints")
        assert metric(tmp_path, "tpud_checkpoint_last_committed_step", job="mem", tier="memory") >= 5
        pid = status["mem"]["pid"]
        os.kill(pid, signal.SIGSTOP)  # a step boundary reached while it stands still: nothing moves on
        # The newest memory commit the daemon heard of; on a loaded machine the copy of a later step
        # may still have been in flight (the loop does not wait for it).
        heard = daemon.status()["mem"]["memory_checkpoint"]["step"]
        killed_at = max(s for s, _ in memory_steps(memory))
        os.kill(pid, signal.SIGKILL)
        daemon.wait_for(lambda s: s["mem"]["pid"] not in (None, pid) and s["mem"]["state"] == "RUNNING",
                        "a new worker")
        restored = wait_until(lambda: daemon.events("checkpoint restored"), "the restore")[-1]
        assert restored["path"].startswith(str(memory))
        assert restored["step"] == killed_at >= heard  # the newest one held: no commit lost
        out = daemon.cli("checkpoints", str(jobs / "mem.yaml"))
        assert out.returncode == 0 and "memory" in out.stdout
    finally:
        daemon.proc.send_signal(signal.SIGTERM)
        assert daemon.proc.wait(timeout=60) == 0
    shutil.rmtree(memory.parent, ignore_errors=True)


def test_tpud_checkpoints_lists_the_memory_tier(tmp_path):
    home = tmp_path / "home"
    job = write(tmp_path, "mem.yaml", "name: mem\n")
    root = Paths.resolve(home).memory / "mem" / mf.step_dir_name(3)
    try:
        root.mkdir(parents=True)
        (root / "state.bin").write_bytes(b"x" * 10)
        mf.write_manifest(root, mf.Manifest.describe(root, job="mem", step=3, micro_step=0, world_size=1,
                                                     spec_hash="h", version="v", reason="interval"))
        out = subprocess.run([sys.executable, "-m", "tpud", "--home", str(home), "checkpoints", str(job)],
                             capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        row = next(line for line in out.stdout.splitlines() if line.startswith("memory"))
        assert row.split()[1] == "3" and row.rstrip().endswith("ok")
    finally:
        shutil.rmtree(root.parent.parent, ignore_errors=True)


def test_flatten_keeps_the_structure_and_leaf_order():
    from engine.checkpoint.leaves import flatten, unflatten

    state = {"model": {"w": torch.ones(2), 3: [1, (2.5, None)]}, "empty": {}, "l": [], "t": (), "s": "x"}
    leaves, structure = flatten(state)
    assert leaves[0] is state["model"]["w"] and leaves[1:] == [1, 2.5, None, "x"]
    assert json.loads(json.dumps(structure)) == structure  # it is written to tree.json as is
    rebuilt = unflatten(leaves, structure)
    assert rebuilt == state and isinstance(rebuilt["model"][3][1], tuple) and list(rebuilt) == list(state)


def test_a_slot_whose_state_was_discarded_takes_the_next_saves(tmp_path):
    """A rollback (or a gang's restore of an older step) discards a memory state: the slot that held
    it goes on taking saves. Before, every later save failed on the discarded directory's name."""
    from engine.checkpoint.memory import MemoryTier, load

    failures, commits = [], []

    def describe(path, step, micro_step, reason, files):
        return mf.Manifest(job="m", step=step, micro_step=micro_step, world_size=1, spec_hash="-", version="-",
                           reason=reason, files=files)

    tier = MemoryTier(tmp_path / "mem", describe, lambda key, path, m, t: commits.append(key),
                      lambda key, error: failures.append(error), background=False)
    state = {"w": torch.arange(6.0)}
    for step in (5, 10):
        tier.save(state, (step, 0), "interval", 0.0).release()
    tier.discard(tmp_path / "mem" / mf.step_dir_name(10), ["a rollback to step 5 undid it"])
    for step in (15, 20, 25):
        state["w"] += 1
        tier.save(state, (step, 0), "interval", 0.0).release()
    assert failures == [] and commits == [(5, 0), (10, 0), (15, 0), (20, 0), (25, 0)]
    assert memory_steps(tmp_path / "mem") == [(20, 0), (25, 0)]
    newest = tmp_path / "mem" / mf.step_dir_name(25)
    assert mf.problems(newest, mf.read_manifest(newest), checksums=True) == []
    assert torch.equal(load(newest, {"w": torch.zeros(6)})["w"], torch.arange(6.0) + 3)


def test_a_peers_copy_of_a_step_replaces_this_hosts_damaged_copy_and_saves_go_on(tmp_path):
    """A worker restarted over its memory tier adopts its two newest states, one of them damaged
    (restore passed it over); a peer sends the same step (engine/checkpoint/restore.py). The peer's
    copy takes its place, verified, and both slots go on taking saves. Before, the slot that had
    adopted the damaged copy kept its step, both slots seemed to hold the newest state, and no
    memory save found a free slot again."""
    from engine.checkpoint.memory import STATE, TREE, MemoryTier, load

    def describe(path, step, micro_step, reason, files):
        return mf.Manifest(job="m", step=step, micro_step=micro_step, world_size=1, spec_hash="-", version="-",
                           reason=reason, files=files)

    def tier(path, commits):
        return MemoryTier(path, describe, lambda key, p, m, t: commits.append(key),
                          lambda key, error: pytest.fail(error), background=False)

    mine, peers = tmp_path / "mem", tmp_path / "peer"
    first = tier(mine, [])
    for step in (5, 10):
        first.save({"w": torch.full((6,), float(step))}, (step, 0), "interval", 0.0).release()
    first.close()
    damaged = mine / mf.step_dir_name(10) / STATE
    raw = bytearray(damaged.read_bytes())
    raw[3] ^= 0x40
    damaged.write_bytes(bytes(raw))
    peer = tier(peers, [])
    peer.save({"w": torch.full((6,), 10.0)}, (10, 0), "interval", 0.0).release()
    sent = peers / mf.step_dir_name(10)

    commits = []
    again = tier(mine, commits)  # the restarted worker's: steps 5 and 10 (damaged) adopted
    assert again._receive((10, 0), torch.frombuffer(bytearray((sent / STATE).read_bytes()), dtype=torch.uint8),
                          (sent / TREE).read_text(), mf.read_manifest(sent), me=0)
    received = mine / mf.step_dir_name(10)
    assert mf.problems(received, mf.read_manifest(received), checksums=True) == []
    assert torch.equal(load(received, {"w": torch.zeros(6)})["w"], torch.full((6,), 10.0))
    for step in (15, 20):
        held = again.save({"w": torch.full((6,), float(step))}, (step, 0), "interval", 0.0)
        assert held is not None, f"no slot free for step {step}"
        held.release()
    assert commits == [(15, 0), (20, 0)] and memory_steps(mine) == [(15, 0), (20, 0)]
