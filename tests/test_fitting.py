"""A micro-batch that fits itself (engine.fitting): the geometry, the record, the refit decision,
the supervisor's restart and status, and end to end a real allocation failure under an
address-space limit."""

import json
import subprocess

import pytest
import torch

from engine import exit_codes, fitting
from engine.data.loader import AccumSchedule, batch_geometry
from engine.data.skips import regeometry
from engine.errors import ConfigError
from engine.health.ledger import SkipLedger
from engine.spec.loader import SpecError
from engine.spec.schema import TrainConfig
from engine.runtime import Runtime
from engine.train import Trainer
from engine.requests import Action, Request
from testkit.recorders import Recorder, StepLosses
from tests.conftest import PYTHON, TINY_JOB, python_env, tiny
from tpud.job.report import WorkerReport
from tpud.view.status import lines


def real_allocation_failure() -> RuntimeError:
    """The error torch's CPU allocator raises when the kernel refuses memory."""
    with pytest.raises(RuntimeError) as failed:
        torch.empty(1 << 60, dtype=torch.uint8)
    return failed.value


def test_a_cap_makes_the_micro_batch_smaller_and_the_step_the_same_size():
    fixed = TrainConfig(grad_accum_steps=2, max_steps=100, batch_ramp=[{"until_step": 10, "grad_accum_steps": 1}])
    assert batch_geometry(fixed, 64, 1) == (64, AccumSchedule(2, ((10, 1),)))
    assert batch_geometry(fixed, 64, 1, cap=16) == (16, AccumSchedule(8, ((10, 4),)))
    assert batch_geometry(fixed, 24, 1, cap=10) == (8, AccumSchedule(6, ((10, 3),)))  # a divisor of 24
    assert batch_geometry(fixed, 64, 1, cap=100) == (64, AccumSchedule(2, ((10, 1),)))
    shared = TrainConfig(global_batch_size=96)
    assert batch_geometry(shared, "auto", 2) == (48, AccumSchedule(1))  # auto starts at the whole per-rank batch
    assert batch_geometry(shared, "auto", 2, cap=20) == (16, AccumSchedule(3))
    assert batch_geometry(shared, 8, 2, cap=20) == (8, AccumSchedule(6))


def test_auto_needs_a_global_batch_to_fit():
    with pytest.raises(SpecError, match="data.micro_batch_size: auto needs train.global_batch_size"):
        tiny("data.micro_batch_size=auto")
    assert tiny("data.micro_batch_size=auto", "train.global_batch_size=32").data.micro_batch_size == "auto"


def test_out_of_memory_errors_are_told_from_others():
    assert fitting.is_out_of_memory(real_allocation_failure())
    assert fitting.is_out_of_memory(MemoryError())
    assert fitting.is_out_of_memory(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has"))
    assert fitting.is_out_of_memory(RuntimeError("RESOURCE_EXHAUSTED: Attempting to allocate 1.50G. That was"))
    assert not fitting.is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not fitting.is_out_of_memory(ValueError("out of memory"))  # not an error a runtime raises


def test_sizes_halve_to_divisors_and_one_sequence_fails_naming_the_memory(tmp_path):
    fit = fitting.MicroBatchFit(tmp_path, 64, enabled=True)
    error = real_allocation_failure()
    assert fit.applies(error, step=5, started_at=4) and not fit.applies(error, step=6, started_at=4)
    assert not fitting.MicroBatchFit(tmp_path, 64, enabled=False).applies(error, 0, 0)
    memory = {"in_use": 3 << 30, "available": 4 << 30, "of": "the worker's address-space limit (RLIMIT_AS)"}
    fit.refit(error, 0, 64, 64, memory)
    assert fit.cap == 32 and fitting.MicroBatchFit(tmp_path, 64, enabled=True).cap == 32  # recorded
    assert fitting.MicroBatchFit(tmp_path, 48, enabled=True).cap is None  # another job file starts over
    assert fitting.MicroBatchFit(tmp_path, 64, enabled=False).cap is None  # fitting off: the size as written
    fit.refit(error, 0, 12, 24, memory)
    assert fit.cap == 6  # the largest divisor of the batch not above half
    with pytest.raises(ValueError) as failed:
        fit.refit(error, 3, 1, 24, memory)
    message = str(failed.value)
    assert "one sequence does not fit in memory at step 3" in message
    assert "needed at least 1048576.0 TiB" in message and "4.0 GiB available (the worker's address-space limit" in message


def test_a_damaged_record_starts_over(tmp_path):
    (tmp_path / fitting.RECORD).write_text("{not json")
    assert fitting.MicroBatchFit(tmp_path, 64, enabled=True).cap is None
    (tmp_path / fitting.RECORD).write_text(json.dumps({"size": 0, "configured": 64, "reason": "x"}))
    assert fitting.MicroBatchFit(tmp_path, 64, enabled=True).cap is None


def test_a_recorded_size_trains_like_that_geometry_configured(tmp_path, runtime):
    """64 x 1 capped at 16 is 16 x 4: the same samples per step, the same losses up to summation order."""
    quick = ["data.seq_len=64", "train.max_steps=3", "train.log_interval=1", "scheduler.warmup_steps=1"]
    reference = StepLosses()
    assert Trainer(tiny(*quick, "data.micro_batch_size=16", "train.grad_accum_steps=4"), tmp_path / "a", reference,
                   runtime=runtime).run() == exit_codes.OK
    spec = tiny(*quick, "data.micro_batch_size=64")
    fitting.write(tmp_path / "b" / "jobs" / spec.name / fitting.RECORD, fitting.Fitted(16, 64, "out of memory"))
    fitted = StepLosses()
    trainer = Trainer(spec, tmp_path / "b", fitted, runtime=Runtime(memory_dir=tmp_path / "b-memory"))
    assert (trainer.loader.micro_batch_size, trainer.loader.accum.final) == (16, 4)
    assert trainer.run() == exit_codes.OK
    assert fitted.losses == pytest.approx(reference.losses, abs=1e-6)


def test_status_shows_the_fitted_micro_batch(tmp_path):
    record = tmp_path / fitting.RECORD
    report = WorkerReport("llm", metrics=None, clock=lambda: 0.0, fitted=record)
    assert report.snapshot(10, 64)["micro_batch"] is None
    fitting.write(record, fitting.Fitted(16, 64, "out of memory at 32 at step 0: needed at least 2.0 GiB", 0))
    fitted = report.snapshot(10, 64)["micro_batch"]
    assert fitted == {"size": 16, "configured": 64, "reason": "out of memory at 32 at step 0: needed at least 2.0 GiB",
                      "step": 0}
    assert report.snapshot(10, 32)["micro_batch"] is None  # the job file changed since
    text = "\n".join(lines([{"name": "llm", "state": "RUNNING", "micro_batch": fitted}]))
    assert "llm: micro-batch 16 (data.micro_batch_size 64): out of memory at 32 at step 0" in text


# A tiny model at 512 tokens: a worker training 16 sequences a micro-batch (checkpointing every
# step) peaked at 0.94 GiB more address space than at its start, 32 at 1.48 GiB (measured): a
# limit between the two fits 16 and fails 64 and 32 in their first steps.
FIT = ["data.seq_len=512", "data.micro_batch_size=64", "data.corpus_bytes=400000", "train.max_steps=2",
       "train.log_interval=1", "scheduler.warmup_steps=1", "checkpoint.interval_steps=1"]
LIMIT = "debug.inject={address_space_mib: 1200}"


@pytest.mark.slow
def test_a_micro_batch_too_large_for_memory_is_fitted_and_a_restart_starts_there(tmp_path, runtime):
    (tmp_path / "tpud.yaml").write_text("allow_fault_injection: true\n")
    # After step 2 (past the refits: 32 fails by its second step) the worker crashes once: its restart must
    # begin at the size that fitted, no allocation failing.
    inject = LIMIT.replace("}", ", crash_at_step: [2]}")
    out = subprocess.run([PYTHON, "-m", "tpud", "run", str(TINY_JOB), "--home", str(tmp_path), *FIT, inject,
                          "train.max_steps=3", "restart.backoff_initial_seconds=0.1"], capture_output=True, text=True, env=python_env(),
                         timeout=300)
    assert out.returncode == exit_codes.OK, out.stderr[-3000:]
    records = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    exits = [r["status"] for r in records if r["event"] == "worker exited"]
    assert exits == [exit_codes.REFIT, exit_codes.REFIT, 1, exit_codes.OK]  # 64, then 32 failed a real allocation
    assert [r["micro_batch_size"] for r in records if r["event"] == "trainer ready"] == [64, 32, 16, 16]
    record = fitting.read(tmp_path / "state" / "jobs" / "tiny-cpu" / fitting.RECORD)
    assert record.size == 16 and record.configured == 64 and "out of memory at 32 at step " in record.reason
    restarts = [r for r in records if r["event"] == "job state" and r["state"] == "BACKOFF"]
    assert len(restarts) == 1 and restarts[0]["reason"].startswith("exception")  # the refits waited for nothing

    reference = StepLosses()
    spec = tiny(*FIT[:1], *FIT[3:], "data.micro_batch_size=16", "train.grad_accum_steps=4", "train.max_steps=3")
    assert Trainer(spec, tmp_path / "reference", reference, runtime=runtime).run() == exit_codes.OK
    # The log prints 6 significant digits; test_a_recorded_size_trains_like_that_geometry_configured
    # compares the full values (1e-6).
    losses = {r["step"]: r["loss"] for r in records if r["event"] == "step"}
    assert [losses[1], losses[2], losses[3]] == pytest.approx(reference.losses, abs=5e-6)


def test_a_micro_batch_of_one_that_does_not_fit_fails_the_job_naming_the_memory(tmp_path, runtime):
    spec = tiny("data.seq_len=64", "data.micro_batch_size=1", "train.max_steps=2", "scheduler.warmup_steps=1")
    trainer = Trainer(spec, tmp_path, runtime=runtime)
    with pytest.raises(ConfigError, match=r"data.micro_batch_size: a micro-batch of one sequence does not fit in "
                       r"memory at step 0: needed at least .* asked for\), .* available \(host memory\)"):
        trainer._refit(real_allocation_failure())
    assert trainer.fit.cap is None  # nothing smaller was recorded


def test_skips_recorded_before_a_smaller_micro_batch_skip_the_same_samples(tmp_path):
    """A ledger and a checkpoint's skips are in micro-batches of the geometry that wrote them."""
    path = tmp_path / "data_skips.json"
    before = SkipLedger(path, per_micro_batch=64)
    before.entries.append(before._entry(3, 2, "spike", step=1, loss=9.0))  # samples 192 .. 319
    before._write()
    now = SkipLedger(path, per_micro_batch=16)
    assert now.ranges == ((12, 8),) and now.entries[0].samples == (192, 128)
    assert now.summary()["samples"] == 128
    assert regeometry([(3, 2)], 64, 16) == ((12, 8),)
    assert regeometry([(3, 2)], 64, 48) == ((4, 3),)  # micro-batches 4..6 hold samples 192..319
    assert regeometry([(3, 2)], 16, 16) == ((3, 2),)


def test_a_gang_changed_in_place_keeps_skipping_the_same_samples_at_its_new_size():
    """A survivor's loader skips are in micro-batches of the old gang (4 hosts x 1 sequence: 4
    samples each); the gang of 3 hosts (2 sequences each: 6) must skip the same samples, not the
    micro-batches of the same numbers (what the chaos campaign found: the hosts' ledgers parted)."""
    from engine.checkpoint.checkpointer import Progress
    from engine.resume import Warm

    warm = Warm(model=None, optimizer=None, progress=Progress(), skips=[(5457, 3)], per_micro_batch=4)
    assert warm.skips_for(6) == ((3638, 2),)  # samples 21828 .. 21839: step 1820 of 12 sequences
    assert warm.skips_for(4) == ((5457, 3),)
    assert warm.skips_for(2) == ((10914, 6),)  # one process alone


def test_a_partial_step_saved_at_another_micro_batch_is_trained_again_from_its_start(tmp_path, runtime):
    """Its gradients were summed over micro-batches of 8 and scaled for 2 of them: a worker that now runs
    4 x 4 cannot add to them, so it trains the step again on the same weights, and the run goes on as
    one never cut (up to summation order)."""
    spec = tiny("train.max_steps=4", "train.log_interval=1", "scheduler.warmup_steps=1", "data.seq_len=32",
                "checkpoint.interval_steps=0", "data.micro_batch_size=8", "train.grad_accum_steps=2")
    reference = StepLosses()
    assert Trainer(spec, tmp_path / "whole", reference, runtime=Runtime(memory_dir=tmp_path / "m0")).run() == 0
    stop = Recorder({(2, 1): Request(Action.CHECKPOINT_AND_EXIT, deadline_s=0)})
    assert Trainer(spec, tmp_path / "cut", stop, runtime=runtime).run() == exit_codes.STOPPED
    fitting.write(tmp_path / "cut" / "jobs" / spec.name / fitting.RECORD, fitting.Fitted(4, 8, "out of memory"))
    resumed = Trainer(spec, tmp_path / "cut", losses := StepLosses(), runtime=runtime)
    assert (resumed.loader.micro_batch_size, resumed.progress.step, resumed.progress.micro_step) == (4, 2, 0)
    assert resumed.run() == 0
    assert losses.losses == pytest.approx(reference.losses[2:], abs=1e-5)
