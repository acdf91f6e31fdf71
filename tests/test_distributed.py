"""Several CPU processes under torch.distributed (gloo; DDP or FSDP2) train like one big batch."""

import json
import shutil
import subprocess

import pytest

from engine.checkpoint import manifest as mf
from engine.checkpoint.manifest import read_manifest
from engine.train import Trainer
from tests.conftest import PYTHON, REPO, TINY_JOB, python_env
from testkit.recorders import StepLosses

pytestmark = pytest.mark.slow
COMMON = ["train.max_steps=4", "train.log_interval=2", "scheduler.warmup_steps=1", "data.seq_len=64",
          "data.corpus_bytes=400000", "device.backend=cpu"]


def torchrun(state_dir, *overrides, timeout=300, nproc=2, **env) -> dict:
    """`nproc` ranks train under tests/ddp_probe.py; rank 0's result."""
    out = subprocess.run(
        [PYTHON, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
         str(REPO / "tests" / "ddp_probe.py"), str(TINY_JOB), str(state_dir), *COMMON, *overrides],
        env=python_env(OMP_NUM_THREADS="1", **env), capture_output=True, text=True, timeout=timeout,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads((state_dir / "probe.json").read_text())


def test_two_ddp_ranks_match_one_process_with_the_same_global_batch(tiny_spec, tmp_path):
    ddp = torchrun(tmp_path / "ddp", "data.micro_batch_size=2", "device.mesh.data=-1", "device.mesh.fsdp=1")
    assert ddp["parallel"] == "ddp" and ddp["held"] == 1.0

    recorded = StepLosses()
    single = Trainer(tiny_spec(*COMMON, "data.micro_batch_size=4"), tmp_path / "one", recorded)
    single.run()
    assert ddp["world"] == 2
    # Rank r loads the r-th half of each global batch; DDP averages the gradients, and the
    # logged loss is averaged over ranks: the same numbers up to summation order.
    assert ddp["losses"] == pytest.approx(recorded.losses, rel=1e-5)
    weights = [p.detach().sum().item() for p in single.model.parameters()]
    # Adam divides each gradient by its own running scale: where a gradient is near zero, the two
    # summation orders' last-bit difference moves that weight by a visible fraction of lr (torch
    # 2.15: up to 8e-5 in a parameter's sum, against 1e-5 on 2.9).
    assert ddp["weights"] == pytest.approx(weights, rel=1e-4, abs=2e-4)


def test_two_ddp_ranks_weigh_uneven_document_masked_targets_like_one_process(tiny_spec, tmp_path):
    """Short documents: each rank's slice holds its own number of targets; the gradients' average
    over ranks must still be the loss over every target of the global batch."""
    from engine.prepare.pipeline import prepare
    from engine.prepare.command import Options
    from testkit import corpus

    source = corpus.write(tmp_path / "docs.jsonl", corpus.docstrings(300), "jsonl")
    prepare(Options(inputs=(str(source),), tokenizer="bytes", out=str(tmp_path / "docs"), workers=1, progress=False))
    masked = [f"data.dataset={tmp_path / 'docs'}", "model.vocab_size=264", "data.document_mask=true",
              "train.mixed_precision=fp32", "train.grad_accum_steps=2", "data.seq_len=32"]
    ddp = torchrun(tmp_path / "ddp", *masked, "data.micro_batch_size=2", "device.mesh.data=-1", "device.mesh.fsdp=1")
    recorded = StepLosses()
    single = Trainer(tiny_spec(*COMMON, *masked, "data.micro_batch_size=4"), tmp_path / "one", recorded)
    single.run()
    counts = [single.loader._target_counts(step) for step in range(4)]
    assert len({int(c.sum()) for c in counts}) > 1  # the steps' target counts differ
    assert ddp["losses"] == pytest.approx(recorded.losses, rel=1e-5)
    weights = [p.detach().sum().item() for p in single.model.parameters()]
    # Adam divides each gradient by its own running scale: where a gradient is near zero, the two
    # summation orders' last-bit difference moves that weight by a visible fraction of lr (torch
    # 2.15: up to 8e-5 in a parameter's sum, against 1e-5 on 2.9).
    assert ddp["weights"] == pytest.approx(weights, rel=1e-4, abs=2e-4)


def test_a_request_reaching_one_rank_is_carried_out_by_all(tmp_path):
    # Under the default mesh (FSDP over both ranks); no rank hangs in a checkpoint the other skipped.
    torchrun(tmp_path, "data.micro_batch_size=2", PROBE_RANK0_CHECKPOINT_AT="2,0")
    step = tmp_path / "checkpoints" / "tiny-cpu" / "step_000000002"
    manifest = read_manifest(step)
    assert manifest is not None and manifest.reason == "request" and manifest.world_size == 2
    assert {"__0_0.distcp", "__1_0.distcp"} <= {f.path for f in manifest.files}  # both ranks wrote


def test_time_based_checkpoints_are_agreed_by_all_ranks(tmp_path):
    """Each rank reads its own clock for checkpoint.interval_seconds; without agreement one
    rank enters a save's collectives alone and the job hangs."""
    torchrun(tmp_path, "data.micro_batch_size=2", "train.max_steps=30", "checkpoint.interval_seconds=0.1",
             "checkpoint.interval_steps=0", timeout=240)
    steps = mf.committed_steps(tmp_path / "checkpoints" / "tiny-cpu")
    assert len(steps) >= 2 and all(m.world_size == 2 for _, _, m in steps)


FSDP = ("train.global_batch_size=4", "data.micro_batch_size=1", "checkpoint.interval_steps=2")


def test_fsdp_shards_trains_like_one_process_and_resumes_on_any_process_count(tiny_spec, tmp_path):
    """The default mesh shards over both ranks (FSDP2). A partial-step checkpoint resumes bitwise
    on the same ranks; a sharded checkpoint resumes in one process, gathered by the reader."""
    fsdp = torchrun(tmp_path / "fsdp", *FSDP, PROBE_RANK0_CHECKPOINT_AT="3,1")
    assert fsdp["parallel"] == "fsdp" and fsdp["exit"] == 0
    assert fsdp["held"] < 0.6  # each rank holds about half the weights (norms are split too)
    job = tmp_path / "fsdp" / "checkpoints" / "tiny-cpu"
    saved = [(m.step, m.micro_step) for _, _, m in mf.committed_steps(job)]
    assert saved == [(2, 0), (3, 1), (4, 0)]

    single = Trainer(tiny_spec(*COMMON, *FSDP), tmp_path / "one", StepLosses())
    single.run()
    assert fsdp["losses"] == pytest.approx(single.hooks.losses, rel=1e-5)
    assert fsdp["weights"] == pytest.approx([p.detach().sum().item() for p in single.model.parameters()],
                                            rel=1e-4, abs=1e-5)

    def resumable_from(name: str, keep: tuple[int, int]):
        state = tmp_path / name
        shutil.copytree(tmp_path / "fsdp" / "checkpoints", state / "checkpoints")
        for _, path, m in mf.committed_steps(state / "checkpoints" / "tiny-cpu"):
            if (m.step, m.micro_step) > keep:
                shutil.rmtree(path)
        return state

    again = torchrun(resumable_from("again", (3, 1)), *FSDP)
    assert again["digest"] == fsdp["digest"]  # every weight bitwise that of the run never stopped

    alone = Trainer(tiny_spec(*COMMON, *FSDP), resumable_from("alone", (2, 0)), StepLosses())
    assert alone.step == 2
    alone.run()
    assert alone.hooks.losses == pytest.approx(single.hooks.losses[2:], rel=1e-5)
    assert [p.detach().sum().item() for p in alone.model.parameters()] == pytest.approx(
        [p.detach().sum().item() for p in single.model.parameters()], rel=1e-4, abs=1e-5)
