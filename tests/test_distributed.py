"""Several CPU processes under torch.distributed (gloo + DDP) train like one big batch."""

import json
import subprocess

import pytest

from engine.checkpoint import manifest as mf
from engine.checkpoint.manifest import read_manifest
from engine.train import Trainer
from tests.conftest import PYTHON, REPO, TINY_JOB, python_env
from tests.recorders import StepLosses

pytestmark = pytest.mark.slow
COMMON = ["train.max_steps=4", "train.log_interval=2", "scheduler.warmup_steps=1", "data.seq_len=64",
          "data.corpus_bytes=400000", "device.backend=cpu"]


def test_two_ddp_ranks_match_one_process_with_the_same_global_batch(tiny_spec, tmp_path):
    out = subprocess.run(
        [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         str(REPO / "tests" / "ddp_probe.py"), str(TINY_JOB), str(tmp_path / "ddp"), *COMMON,
         "data.micro_batch_size=2"],
        env=python_env(OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    ddp = json.loads((tmp_path / "ddp" / "probe.json").read_text())

    recorded = StepLosses()
    single = Trainer(tiny_spec(*COMMON, "data.micro_batch_size=4"), tmp_path / "one", recorded)
    single.run()
    assert ddp["world"] == 2
    # Rank r loads the r-th half of each global batch; DDP averages the gradients, and the
    # logged loss is averaged over ranks: the same numbers up to summation order.
    assert ddp["losses"] == pytest.approx(recorded.losses, rel=1e-5)
    weights = [p.detach().sum().item() for p in single.model.parameters()]
    assert ddp["weights"] == pytest.approx(weights, rel=1e-4, abs=1e-5)


def test_a_request_reaching_one_rank_is_carried_out_by_all(tmp_path):
    out = subprocess.run(
        [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         str(REPO / "tests" / "ddp_probe.py"), str(TINY_JOB), str(tmp_path), *COMMON, "data.micro_batch_size=2"],
        env=python_env(OMP_NUM_THREADS="1", PROBE_RANK0_CHECKPOINT_AT="2,0"), capture_output=True, text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]  # no rank hung in a checkpoint the other skipped
    step = tmp_path / "checkpoints" / "tiny-cpu" / "step_000000002"
    manifest = read_manifest(step)
    assert manifest is not None and manifest.reason == "request" and manifest.world_size == 2
    assert {"__0_0.distcp", "__1_0.distcp"} <= {f.path for f in manifest.files}  # both ranks wrote


def test_time_based_checkpoints_are_agreed_by_all_ranks(tmp_path):
    """Each rank reads its own clock for checkpoint.interval_seconds; without agreement one
    rank enters a save's collectives alone and the job hangs."""
    out = subprocess.run(
        [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         str(REPO / "tests" / "ddp_probe.py"), str(TINY_JOB), str(tmp_path), *COMMON, "data.micro_batch_size=2",
         "train.max_steps=30", "checkpoint.interval_seconds=0.1", "checkpoint.interval_steps=0"],
        env=python_env(OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    steps = mf.committed_steps(tmp_path / "checkpoints" / "tiny-cpu")
    assert len(steps) >= 2 and all(m.world_size == 2 for _, _, m in steps)
