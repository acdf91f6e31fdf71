"""device.compile on the cpu backend: each block and the loss through torch.compile (Inductor),
and every guarantee of eager training kept: bitwise resume from disk and from the memory tier,
a partial-step checkpoint that resumes exactly, and the persistent cache a restart reads."""

import shutil

import pytest
import torch

from engine import events
from engine.checkpoint import manifest as mf
from engine.hooks import Boundary
from engine.requests import Action, Request
from engine.train import Trainer
from testkit.recorders import Recorder
from tests.test_checkpoint import assert_same_training_state, job_dir

pytestmark = [pytest.mark.slow, pytest.mark.in_process]
# Two small blocks and token-chunked loss (a chunk budget of 0 MiB forces it), so both kinds of
# compiled code run; every step saved to memory.
QUICK = ("device.compile=true", "train.max_steps=12", "train.log_interval=1", "scheduler.warmup_steps=1",
         "data.micro_batch_size=2", "data.seq_len=32", "train.grad_accum_steps=3", "checkpoint.interval_steps=4",
         "checkpoint.memory.interval_steps=1", "checkpoint.memory.max_overhead=1", "model.n_layers=2",
         "loss.name=chunked", "loss.chunk_tokens=24")


def test_compiled_training_resumes_bitwise_from_disk_memory_and_a_partial_step(tiny_spec, tmp_path, memory, runtime):
    from torch._dynamo.utils import counters

    spec = tiny_spec(*QUICK)
    counters.clear()
    whole = Trainer(spec, tmp_path / "whole", hooks := Recorder(), runtime=runtime)
    assert whole.run() == 0
    assert counters["frames"]["ok"] >= 2  # a block's forward and the loss's chunk were compiled
    # Each step event says how many graphs this process compiled and in how long: all of them in
    # the first steps, then no more (tpud_job_compilations, the status's device line).
    compiled = [(e.compilations, e.compile_seconds) for e in hooks.of(events.Step)]
    assert compiled[0][0] >= 2 and compiled[0][1] > 0 and compiled[-4:] == [compiled[-1]] * 4
    assert list((tmp_path / "whole" / "jobs" / "tiny-cpu" / "inductor_cache").iterdir())
    eager = Trainer(tiny_spec(*QUICK, "device.compile=false"), tmp_path / "eager", Recorder(), runtime=runtime)
    eager.run()
    # Compiled kernels may round differently from eager ones, but train the same model.
    for a, b in zip(whole.model.parameters(), eager.model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-3)

    # A stop at step 7 resumes from memory; a partial step (5, 1) from its memory copy.
    shutil.rmtree(memory)
    stop_at_7 = Recorder({Boundary(7, 0): Request(Action.STOP)})
    assert Trainer(spec, tmp_path / "cut", stop_at_7, runtime=runtime).run() == 75
    resumed = Trainer(spec, tmp_path / "cut", hooks := Recorder(), runtime=runtime)
    assert resumed.progress.step == 7 and hooks.of(events.CheckpointRestored)[0].path.startswith(str(memory))
    assert resumed.run() == 0
    assert_same_training_state(whole, resumed)

    shutil.rmtree(memory)
    stop = {Boundary(5, 1): Request(Action.CHECKPOINT_AND_EXIT, deadline_s=0)}
    assert Trainer(spec, tmp_path / "partial", Recorder(stop), runtime=runtime).run() == 75
    shutil.rmtree(memory)  # from disk this time
    assert (5, 1) in [(s, m.micro_step) for s, _, m in mf.committed_steps(job_dir(tmp_path / "partial"))]
    resumed = Trainer(spec, tmp_path / "partial", Recorder(), runtime=runtime)
    assert (resumed.progress.step, resumed.progress.micro_step) == (5, 1)
    resumed.run()
    assert_same_training_state(whole, resumed)
