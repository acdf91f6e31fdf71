"""Checkpoints in-process on CPU: commit protocol, verification, retention, exact resume."""

import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

from engine.checkpoint import manifest as mf
from engine import events
from engine.hooks import Boundary
from engine.requests import Action, Request
from engine.train import Trainer
from tests.conftest import tiny
from testkit.recorders import Recorder

# Each test trains and checkpoints for real, a few seconds each: with the end-to-end tests, not the unit tests.
pytestmark = [pytest.mark.slow, pytest.mark.in_process]

QUICK = ("train.max_steps=12", "train.log_interval=1", "scheduler.warmup_steps=1", "data.micro_batch_size=2",
         "data.seq_len=32", "train.grad_accum_steps=3", "checkpoint.interval_steps=4")


def trainer(spec, home, hooks=None):
    return Trainer(spec, home, hooks or Recorder())


def job_dir(home):
    return home / "checkpoints" / "tiny-cpu"


def assert_same_training_state(a: Trainer, b: Trainer):
    for (name, pa), pb in zip(a.model.named_parameters(), b.model.parameters()):
        assert torch.equal(pa, pb), name
    sa, sb = a.optimizer.state_dict(), b.optimizer.state_dict()
    assert sa["state"].keys() == sb["state"].keys()
    for key in sa["state"]:
        for field, value in sa["state"][key].items():
            assert torch.equal(value, sb["state"][key][field]), (key, field)


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """One uninterrupted QUICK run, which the tests only read: its trainer, events and home."""
    home = tmp_path_factory.mktemp("whole")
    run = trainer(tiny(*QUICK), home, hooks := Recorder())
    assert run.run() == 0
    return run, hooks, home


def test_periodic_and_final_checkpoints_are_committed_with_a_manifest(whole):
    committed = mf.committed_steps(job_dir(whole[2]))
    assert [step for step, _, _ in committed][-2:] == [8, 12]  # keep=3: 4 was retired
    step, path, manifest = committed[-1]
    assert manifest.reason == "final" and manifest.micro_step == 0 and manifest.world_size == 1
    assert {f.path for f in manifest.files} == {p.name for p in path.iterdir()} - {mf.MANIFEST}
    assert mf.problems(path, manifest, checksums=True) == []


def test_resume_from_a_partial_step_checkpoint_is_bitwise_identical(tiny_spec, tmp_path, whole):
    spec = tiny_spec(*QUICK)
    whole, hooks, _ = whole
    # Stop inside step 6's accumulation (one micro-batch done), checkpointing first.
    stop = {Boundary(5, 1): Request(Action.CHECKPOINT_AND_EXIT, deadline_s=0)}
    first = trainer(spec, tmp_path / "cut", Recorder(stop))
    assert first.run() == 75
    assert mf.committed_steps(job_dir(tmp_path / "cut"))[-1][2].micro_step == 1
    second = trainer(spec, tmp_path / "cut", resumed := Recorder())
    assert (second.progress.step, second.progress.micro_step) == (5, 1)
    assert second.run() == 0
    assert_same_training_state(whole, second)
    assert {s: resumed.losses[s] for s in range(6, 13)} == {s: hooks.losses[s] for s in range(6, 13)}


def test_a_request_without_deadline_waits_for_the_step_boundary(tiny_spec, tmp_path):
    script = Recorder({Boundary(2, 1): Request(Action.CHECKPOINT)})
    trainer(tiny_spec(*QUICK, "checkpoint.interval_steps=0"), tmp_path, script).run()
    started = script.of(events.CheckpointStarted)
    assert (started[0].step, started[0].micro_step, started[0].reason) == (3, 0, "request")


class Killed(BaseException):
    """Stands for SIGKILL: nothing in the process handles it."""


def test_a_save_killed_before_its_manifest_never_commits(tiny_spec, tmp_path, monkeypatch):
    spec = tiny_spec(*QUICK, "train.max_steps=4", "checkpoint.interval_steps=2")

    def killed(directory, manifest):
        raise Killed

    monkeypatch.setattr(mf, "write_manifest", killed)
    with pytest.raises(Killed):
        trainer(spec, tmp_path).run()
    assert mf.committed_steps(job_dir(tmp_path)) == []
    assert list(job_dir(tmp_path).glob(".tmp-step_*"))  # the debris is there...
    monkeypatch.undo()
    resumed = trainer(spec, tmp_path)
    assert resumed.progress.step == 0  # ...but never used,
    assert not list(job_dir(tmp_path).glob(".tmp-step_*"))  # and cleared at start-up


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_a_damaged_checkpoint_is_moved_aside_and_the_previous_one_used(tiny_spec, tmp_path, damage):
    spec = tiny_spec(*QUICK, "train.max_steps=8")
    trainer(spec, tmp_path).run()
    newest = job_dir(tmp_path) / "step_000000008"
    data = next(newest.glob("*.distcp"))
    if damage == "flip":
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        data.write_bytes(bytes(raw))
    elif damage == "truncate":
        data.write_bytes(data.read_bytes()[:-100])
    else:
        data.unlink()
    resumed = trainer(spec, tmp_path)
    assert resumed.progress.step == 4
    aside = list((job_dir(tmp_path) / "corrupt").iterdir())
    assert len(aside) == 1 and aside[0].name.startswith("step_000000008.")  # kept for a human, not deleted


def test_retention_keeps_the_newest_and_pinned_steps(tiny_spec, tmp_path):
    spec = tiny_spec(*QUICK, "train.max_steps=10", "checkpoint.interval_steps=1", "checkpoint.keep=2")
    mf.pin(job_dir(tmp_path), 2)  # the supervisor is still uploading step 2
    trainer(spec, tmp_path).run()
    assert [s for s, _, _ in mf.committed_steps(job_dir(tmp_path))] == [2, 9, 10]
    mf.unpin(job_dir(tmp_path), 2)
    assert mf.pinned_steps(job_dir(tmp_path)) == set()


def test_checkpoint_holds_rng_progress_and_loader_geometry(tiny_spec, tmp_path):
    trainer(tiny_spec(*QUICK, "train.max_steps=4"), tmp_path).run()
    path = job_dir(tmp_path) / "step_000000004"
    metadata = dcp.FileSystemReader(path).read_metadata()
    keys = set(metadata.state_dict_metadata)
    assert {"progress.step", "progress.micro_step", "progress.tokens_seen", "rng.torch", "loader.seed"} <= keys
    assert any(k.startswith("optim.state.") for k in keys) and "model.tok_embeddings.weight" in keys
    shutil.rmtree(path)  # not committed any more: a fresh trainer starts from the newest left
    assert trainer(tiny_spec(*QUICK, "train.max_steps=4"), tmp_path).progress.step == 0


@pytest.mark.parametrize("mode", ["true", "false"])
def test_interval_seconds_triggers_saves_sync_or_async(tiny_spec, tmp_path, mode):
    script = Recorder()
    spec = tiny_spec(*QUICK, "train.max_steps=5", "checkpoint.interval_steps=0", "checkpoint.interval_seconds=1e-6",
                     "checkpoint.keep=10", f"checkpoint.async={mode}")
    assert spec.checkpoint.async_ is (mode == "true")
    trainer(spec, tmp_path, script).run()
    assert [s for s, _, _ in mf.committed_steps(job_dir(tmp_path))] == [1, 2, 3, 4, 5]
    started = [e.reason for e in script.of(events.CheckpointStarted)]
    assert started == ["interval"] * 4 + ["final"]


def test_when_the_only_checkpoint_is_damaged_the_process_refuses_to_train_on_it(tiny_spec, tmp_path):
    spec = tiny_spec(*QUICK, "train.max_steps=4", "checkpoint.interval_steps=0")
    trainer(spec, tmp_path).run()
    data = next((job_dir(tmp_path) / "step_000000004").glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[-10] ^= 0x01
    data.write_bytes(bytes(raw))
    with pytest.raises(RuntimeError, match="failed verification"):
        trainer(spec, tmp_path)
    assert trainer(spec, tmp_path).progress.step == 0  # the restart begins afresh
    assert len(list((job_dir(tmp_path) / "corrupt").iterdir())) == 1


FIRST_STEPS = (*QUICK, "train.max_steps=3", "checkpoint.interval_steps=0")


@pytest.fixture(scope="module")
def first_steps(tmp_path_factory):
    """The FIRST_STEPS run uninterrupted: its trainer and events, which the tests only read."""
    run = trainer(tiny(*FIRST_STEPS), tmp_path_factory.mktemp("first-steps"), hooks := Recorder())
    assert run.run() == 0
    return run, hooks


@pytest.mark.parametrize("stop_at", [Boundary(0, 0), Boundary(0, 1), Boundary(0, 2)])
def test_a_checkpoint_before_the_first_update_resumes_exactly(tiny_spec, tmp_path, first_steps, stop_at):
    spec = tiny_spec(*FIRST_STEPS)
    whole, hooks = first_steps
    assert trainer(spec, tmp_path / "cut", Recorder({stop_at: Request(Action.CHECKPOINT_AND_EXIT, 0)})).run() == 75
    resumed = trainer(spec, tmp_path / "cut", again := Recorder())
    assert resumed.run() == 0
    assert_same_training_state(whole, resumed)
    assert again.losses == hooks.losses


def test_a_later_checkpoint_request_does_not_cancel_a_pending_exit(tiny_spec, tmp_path):
    requests = {Boundary(1, 1): Request(Action.CHECKPOINT_AND_EXIT),  # waits for the step boundary
                Boundary(1, 2): Request(Action.CHECKPOINT, deadline_s=0)}
    t = trainer(tiny_spec(*QUICK, "checkpoint.interval_steps=0"), tmp_path, Recorder(requests))
    assert t.run() == 75
    # Merged: exit (the stronger action) at the next boundary (the tighter deadline).
    assert (t.progress.step, t.progress.micro_step) == (1, 2)


def test_a_step_directory_without_a_manifest_is_moved_aside_and_the_save_commits(tiny_spec, tmp_path):
    spec = tiny_spec(*QUICK, "train.max_steps=4", "checkpoint.interval_steps=0")
    leftover = job_dir(tmp_path) / mf.step_dir_name(4)  # e.g. a deletion interrupted after its manifest
    leftover.mkdir(parents=True)
    (leftover / "__0_0.distcp").write_bytes(b"half of something")
    hooks = Recorder()
    assert trainer(spec, tmp_path, hooks).run() == 0
    assert [e.TYPE for e in hooks.events if e.TYPE.startswith("checkpoint_")] == ["checkpoint_started",
                                                                                       "checkpoint_committed"]
    assert [step for step, _, _ in mf.committed_steps(job_dir(tmp_path))] == [4]
    assert [p.name.split(".")[0] for p in (job_dir(tmp_path) / "corrupt").iterdir()] == [leftover.name]


def test_the_threads_beside_the_loop_run_torch_single_threaded(tmp_path, memory, runtime):
    """A big copy on the checkpoint writer's thread (DCP copying the memory tier's views) once started
    an OpenMP team of its own beside the loop's, and the loop's CPU steps stayed ~1.7x slower for
    the rest of the run (engine/side_threads.py)."""
    trainer = Trainer(tiny(), tmp_path, Recorder(), runtime=runtime)
    before = torch.get_num_threads()
    for pool in (trainer.checkpointer.writer.pool, trainer.batches._pool):
        assert pool.submit(torch.get_num_threads).result() == 1
        pool.submit(lambda: torch.ones(1 << 22).clone()).result()  # big enough to go parallel
    assert torch.get_num_threads() == before  # the loop keeps its own
    trainer.batches.close()
    trainer.checkpointer.close()
