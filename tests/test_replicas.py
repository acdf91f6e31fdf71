"""Silent data corruption across replicas (health.replicas): the fingerprint, the majority, and
real data-parallel processes in which one bit of one replica flips."""

from __future__ import annotations

import json
import socket
import subprocess

import pytest
import torch

from engine.health.faults import flip_bit
from engine.health.replicas import fingerprint, odd_ones
from engine.spec.schema import BitFlip
from tests.conftest import PYTHON, REPO, TINY_JOB, python_env
from tests.helpers import committed


def model_and_optimizer(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 8)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_one_flipped_bit_anywhere_changes_the_fingerprint_and_equal_states_agree():
    a, b = model_and_optimizer(), model_and_optimizer()
    assert fingerprint(*a) == fingerprint(*b)
    for flip in (BitFlip(step=1, tensor="0.weight", element=5, bit=0), BitFlip(step=1, tensor="1.bias", bit=31)):
        model, optimizer = model_and_optimizer()
        flip_bit(model, flip)
        assert fingerprint(model, optimizer) != fingerprint(*a)
    model, optimizer = model_and_optimizer()
    state = next(iter(optimizer.state.values()))["exp_avg_sq"]
    state.view(-1)[3:4].view(torch.int32).__ixor__(1 << 7)  # the optimizer's state counts too
    assert fingerprint(model, optimizer) != fingerprint(*a)


def test_the_odd_replicas_are_those_outside_a_majority():
    assert odd_ones([7, 7, 7]) == [] and odd_ones([7, 9, 7]) == [1] and odd_ones([3, 7, 7, 7, 5]) == [0, 4]
    assert odd_ones([7, 9]) == [] and odd_ones([1, 1, 2, 2]) == []  # no majority: none can be named


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def replicas(state_dir, world: int, *overrides: str) -> list[dict]:
    """`world` data-parallel processes (gloo, DDP) training the tiny job; each rank's report."""
    port = free_port()
    args = [PYTHON, str(REPO / "tests" / "replica_probe.py"), str(TINY_JOB), str(state_dir),
            "train.max_steps=12", "train.log_interval=1", "scheduler.warmup_steps=1", "data.seq_len=32",
            "data.micro_batch_size=2", "data.corpus_bytes=400000", "device.mesh.data=-1", "device.mesh.fsdp=1",
            "checkpoint.interval_steps=4", "health.replicas.interval_steps=2", *overrides]
    procs = [subprocess.Popen(args, env=python_env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world),
                                                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                                                   OMP_NUM_THREADS="1"),
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for r in range(world)]
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode in (0, 77, 79), err[-3000:]
    return [json.loads((state_dir / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.slow
def test_a_bit_flipped_in_one_of_three_replicas_is_found_and_that_replica_quarantined(tmp_path):
    # Step 5: rank 1 flips a mantissa bit. The comparison after step 6 finds it; the last agreed
    # state is step 4's (compared before its save).
    ranks = replicas(tmp_path, 3, "debug.inject.bit_flips=[{step: 5, rank: 1}]")
    assert [r["exit"] for r in ranks] == [77, 79, 77]
    for rank, report in enumerate(ranks):
        (mismatch,) = report["mismatches"]
        assert (mismatch["step"], mismatch["agreed_step"], mismatch["odd"], mismatch["rank"]) == (6, 4, [1], rank)
        assert len(set(mismatch["fingerprints"])) == 2 and mismatch["fingerprints"][0] == mismatch["fingerprints"][2]
        assert report["steps"][-1] == 6
    assert json.loads((tmp_path / "jobs" / "tiny-cpu" / "replicas.json").read_text())["odd"] == [1]
    assert committed(tmp_path / "checkpoints" / "tiny-cpu") == [(4, 0)]  # nothing after the agreed step


@pytest.mark.slow
def test_two_replicas_that_differ_name_neither_and_start_again_from_the_agreed_state(tmp_path):
    ranks = replicas(tmp_path, 2, "debug.inject.bit_flips=[{step: 3, rank: 0}]")
    assert [r["exit"] for r in ranks] == [77, 77]
    assert [(r["mismatches"][0]["step"], r["mismatches"][0]["odd"]) for r in ranks] == [(4, []), (4, [])]
    assert committed(tmp_path / "checkpoints" / "tiny-cpu") == []  # the save at 4 came after the comparison
