"""Silent data corruption across replicas (health.replicas): the fingerprint, the majority, and
real data-parallel processes in which one bit of one replica flips."""

from __future__ import annotations

import json

import pytest
import torch

from engine.health.faults import flip_bit
from engine.health.replicas import fingerprint, odd_ones
from engine.spec.schema import BitFlip
from tests.helpers import committed, data_parallel


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


def test_a_gradient_flip_changes_that_ranks_gradient_once_before_its_update(tmp_path):
    from engine.data.loader import AccumSchedule
    from engine.health.faults import Faults
    from engine.spec.schema import InjectConfig

    model, _ = model_and_optimizer()
    model(torch.randn(3, 8)).sum().backward()
    weights, grads = [p.detach().clone() for p in model.parameters()], [p.grad.clone() for p in model.parameters()]
    faults = Faults(InjectConfig(bit_flips=[{"step": 4, "rank": 1, "tensor": "1.weight", "element": 2,
                                             "gradient": True}]), tmp_path, AccumSchedule(1))
    faults.before_update(4, model, rank=0)  # another rank's
    faults.before_update(3, model, rank=1)  # another step
    faults.at_step_boundary(4, model, rank=1)  # a gradient flip is not a weight flip
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    faults.before_update(4, model, rank=1)
    changed = [n for (n, p), g in zip(model.named_parameters(), grads) if not torch.equal(p.grad, g)]
    assert changed == ["1.weight"] and (model[1].weight.grad != grads[2]).sum() == 1
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))  # the weights are untouched
    Faults(faults.cfg, tmp_path, AccumSchedule(1)).before_update(4, model, rank=1)  # fired once per job
    assert (model[1].weight.grad != grads[2]).sum() == 1


def test_the_odd_replicas_are_those_outside_a_majority():
    assert odd_ones([7, 7, 7]) == [] and odd_ones([7, 9, 7]) == [1] and odd_ones([3, 7, 7, 7, 5]) == [0, 4]
    assert odd_ones([7, 9]) == [] and odd_ones([1, 1, 2, 2]) == []  # no majority: none can be named


@pytest.mark.slow
def test_a_bit_flipped_in_one_of_three_replicas_is_found_and_that_replica_quarantined(tmp_path):
    # Step 5: rank 1 flips a mantissa bit. The comparison after step 6 finds it; the last agreed
    # state is step 4's (compared before its save).
    ranks = data_parallel(tmp_path, 3, "debug.inject.bit_flips=[{step: 5, rank: 1}]")
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
    ranks = data_parallel(tmp_path, 2, "debug.inject.bit_flips=[{step: 3, rank: 0}]")
    assert [r["exit"] for r in ranks] == [77, 77]
    assert [(r["mismatches"][0]["step"], r["mismatches"][0]["odd"]) for r in ranks] == [(4, []), (4, [])]
    assert committed(tmp_path / "checkpoints" / "tiny-cpu") == []  # the save at 4 came after the comparison
