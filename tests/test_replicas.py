"""Silent data corruption across replicas (health.replicas): the fingerprint, the majority, the
replay that names one of two, and real data-parallel processes in which one bit of one replica flips."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.backends.base import Backend, DataPosition
from engine.errors import WorkerExit
from engine.health.faults import flip_bit
from engine.health.replicas import (NEVER, Mismatch, ReplicaCheck, departure, fingerprint, first_to_depart,
                                    odd_ones, where)
from engine.spec.schema import BitFlip
from testkit.helpers import committed, data_parallel


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
    # HSDP, three hosts of two processes: ranks 0, 2, 4 hold one shard, 1, 3, 5 the other.
    by_shard = lambda rank: rank % 2  # noqa: E731
    assert odd_ones([7, 5, 7, 5, 7, 5], by_shard) == [] and odd_ones([7, 5, 7, 6, 7, 5], by_shard) == [3]
    assert odd_ones([7, 5, 8, 6, 7, 5], by_shard) == [2, 3] and odd_ones([7, 5, 8, 5, 9, 5], by_shard) == []


def test_a_replay_names_the_replica_whose_own_values_departed_first():
    same = [1234567, 2.5, 0.75]  # [its output's print, its loss, the gradient norm after the all-reduce]
    assert departure(6, same, list(same)) == NEVER
    output = departure(6, same, [1234568, 2.5, 0.75])
    loss = departure(6, same, [1234567, 2.5000002, 0.75])
    norm = departure(6, same, [1234567, 2.5, 0.7500001])
    assert output < loss < norm < departure(7, same, [1234568, 2.5, 0.75])  # in the order a step computes them
    assert departure(6, [1, -0.0, 1.0], [1, 0.0, 1.0]) != NEVER  # bitwise: a sign of zero counts
    assert first_to_depart([output, norm]) == [0] and first_to_depart([norm, loss, norm]) == [1]
    assert first_to_depart([NEVER, NEVER]) == [] and first_to_depart([norm, norm]) == []  # none, or all at once
    assert first_to_depart([NEVER, 6 * 4 + 3]) == [1]  # only its fingerprint differs: a flip after the last step
    assert where([NEVER, 6 * 4 + 3, output]) == [None, "step 6 fingerprint", "step 6 output"]


def process(rank: int = 0, per_host: int = 1) -> Backend:
    """A backend as the replica check sees it: this process's rank, and its host's processes."""
    backend = Backend()
    backend.data, backend.processes_per_host = DataPosition(rank, 1), per_host
    return backend


def test_a_step_begun_before_a_partial_step_restore_has_no_output_print_to_compare():
    from engine.checkpoint.state import Progress
    from engine.spec.schema import ReplicaConfig

    model, optimizer = model_and_optimizer()
    check = ReplicaCheck(ReplicaConfig(), process(), model, optimizer, Path("unused"))
    output = torch.randn(4, 8)
    check.restored(Progress(step=3, micro_step=1))  # step 4's first micro-batch ran before this state
    check._print_output(None, (), output)
    check.step_done()
    assert check.output_print is None and check._values([2.0, 1.0])[0] is None
    check._print_output(None, (), output)  # step 5: all of it here
    check.step_done()
    assert int(check.output_print) == int(output.view(torch.int32).sum(dtype=torch.int64))
    assert departure(4, [None, 2.5, 0.75], [123, 2.5, 0.75]) == NEVER  # a print either lacks is not compared


def test_a_mismatch_that_cannot_be_recorded_still_quarantines_and_restarts(tmp_path):
    from engine.spec.schema import ReplicaConfig

    (tmp_path / "job").write_text("a file where the job's directory should be")  # replicas.json cannot be written
    emitted = []
    for rank, code in ((0, 79), (1, 77)):
        check = ReplicaCheck(ReplicaConfig(), process(rank), *model_and_optimizer(), tmp_path / "job")
        with pytest.raises(WorkerExit) as exited:
            check.settle(Mismatch(6, [1, 2], [0], "replay"), emitted.append)
        assert exited.value.code == code
    assert [e.odd for e in emitted] == [[0], [0]]


def test_every_process_of_a_host_with_an_odd_shard_is_quarantined_and_the_other_hosts_restart(tmp_path):
    """Two hosts of two processes: rank 3's shard differs, so host 1 (ranks 2 and 3) leaves the gang."""
    from engine.spec.schema import ReplicaConfig

    codes = []
    for rank in range(4):
        check = ReplicaCheck(ReplicaConfig(), process(rank, per_host=2), *model_and_optimizer(), tmp_path)
        with pytest.raises(WorkerExit) as exited:
            check.settle(Mismatch(6, [7, 5, 7, 6], [3], "majority", replicas=2), lambda event: None)
        codes.append(exited.value.code)
    assert codes == [77, 77, 79, 79]
    assert "(2 replicas: ranks [3] differ" in Mismatch(6, [7, 5, 7, 6], [3], "majority", replicas=2).describe()


def test_status_says_how_the_odd_replica_was_found_and_a_healed_mismatch_goes_back_nowhere():
    from tpud.view.status import lines

    def status(mismatch: Mismatch, agreed: int, quarantined: bool) -> str:
        return "\n".join(lines([{"name": "j", "replicas": {"agreed_step": agreed, "quarantined": quarantined,
                                                           "healed": mismatch.healed, "reason": mismatch.describe()}}]))

    named = status(Mismatch(6, [1, 2], [1], "replay"), 4, True)
    assert ("j: replicas: the replicas' states differ after step 6 (2 replicas: ranks [1] departed first from their "
            "own values when the steps were replayed); back to step 4; this host is quarantined") in named
    healed = status(Mismatch(6, [1, 2], [], healed=True), 6, False)
    assert "transient fault, healed in place)" in healed and "back to step" not in healed
    assert "ranks [2] differ from the majority" in Mismatch(6, [1, 1, 2], [2], "majority").describe()
    assert "a replay named none" in Mismatch(6, [1, 2], [], replayed=True).describe()
    assert "no state to replay from" in Mismatch(6, [1, 2], []).describe()


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
def test_a_flip_that_makes_the_loss_non_finite_before_any_comparison_quarantines_its_replica(tmp_path):
    """Found by the chaos campaign. After step 5 rank 2 flips an exponent bit of the (tied) embedding
    and its memory state of step 5 holds the flip; step 6's loss is NaN on every rank (the all-reduce
    carries it), long before the comparison of step 10. The rollback restores step 5 everywhere:
    compared, rank 2's differs, so it is quarantined (79) and the others restart (77). Before, every
    rank rolled back to the same poisoned state until health.max_rollbacks failed the job (76)."""
    ranks = data_parallel(tmp_path, 3, "debug.inject.bit_flips=[{step: 5, rank: 2, element: 100, bit: 30}]",
                          "checkpoint.memory.interval_steps=1", "checkpoint.memory.max_overhead=1",
                          "health.replicas.interval_steps=10", memory=True)
    assert [r["exit"] for r in ranks] == [77, 77, 79]
    for report in ranks:
        (mismatch,) = report["mismatches"]
        assert (mismatch["step"], mismatch["odd"], mismatch["found_by"]) == (5, [2], "majority")
        assert report["steps"][-1] == 5  # step 6, poisoned, never reported


@pytest.mark.slow
@pytest.mark.parametrize("flip, named", [("{step: 5, rank: 1}", 1), ("{step: 5, rank: 0, gradient: true}", 0)])
def test_of_two_replicas_the_one_a_bit_flipped_in_is_named_by_replaying_the_steps(tmp_path, flip, named):
    # The comparison after step 6 finds the flip; the steps after step 4 (saved, agreed) are
    # replayed: the flipped replica's own values depart first, so it is quarantined.
    ranks = data_parallel(tmp_path, 2, f"debug.inject.bit_flips=[{flip}]", steps=8)
    assert [r["exit"] for r in ranks] == [79 if rank == named else 77 for rank in range(2)]
    for report in ranks:
        (mismatch,) = report["mismatches"]
        assert (mismatch["step"], mismatch["agreed_step"], mismatch["odd"]) == (6, 4, [named])
        assert (mismatch["found_by"], mismatch["healed"]) == ("replay", False)
    assert committed(tmp_path / "checkpoints" / "tiny-cpu") == [(4, 0)]


@pytest.mark.slow
def test_of_two_sharded_replicas_the_one_a_bit_flipped_in_is_named_with_both_its_processes(tmp_path):
    """HSDP, as a gang of two hosts of two processes lays it out: ranks 0 and 1 shard one replica, 2
    and 3 the other. A bit flipped in rank 1's shard reaches rank 0 through the replica's all-gather,
    so both depart first on replay and both are named."""
    ranks = data_parallel(tmp_path, 4, "debug.inject.bit_flips=[{step: 5, rank: 1}]", "device.mesh.data=2",
                          "device.mesh.fsdp=2", steps=8)
    assert [r["exit"] for r in ranks] == [79, 79, 77, 77]
    for report in ranks:
        (mismatch,) = report["mismatches"]
        assert (mismatch["step"], mismatch["agreed_step"], mismatch["odd"]) == (6, 4, [0, 1])
        assert mismatch["found_by"] == "replay" and "(2 replicas: ranks [0, 1] departed first" in mismatch["reason"]
        # Four fingerprints, two shards: each replica's shards hold the other's values but for the flip.
        assert len(mismatch["fingerprints"]) == 4
    assert committed(tmp_path / "checkpoints" / "tiny-cpu") == [(4, 0)]


@pytest.mark.slow
def test_a_spike_of_one_replica_that_its_replay_does_not_reproduce_names_that_replica(tmp_path):
    # Rank 1's loss of step 10 is 10x, once (a hardware fault): the spike is caught at its step,
    # rolled back to step 8 (saved) and replayed; the replay does not spike (verdict: hardware),
    # and rank 1's own loss of step 10 is the one that departed from its first run.
    ranks = data_parallel(tmp_path, 2, "debug.inject.host_spikes=[{step: 10, rank: 1}]",
                          "health.spikes={warmup_steps: 4, window_steps: 8}", steps=14)
    assert [r["exit"] for r in ranks] == [77, 79]
    for report in ranks:
        (mismatch,) = report["mismatches"]
        assert (mismatch["step"], mismatch["odd"], mismatch["found_by"]) == (10, [1], "replay")
        assert "spiked and its replay did not" in mismatch["reason"]


@pytest.mark.slow
def test_a_transient_fault_no_replica_can_be_named_for_heals_in_place_and_the_run_ends_as_a_clean_one(tmp_path):
    # Both replicas flip a bit of the same weight right after step 6, before its comparison: only
    # their fingerprints depart, both at once, so neither is named; replayed from step 4 (saved,
    # agreed), they agree, and training goes on from the replayed state.
    flips = "debug.inject.bit_flips=[{step: 6, rank: 0, bit: 3}, {step: 6, rank: 1, bit: 9}]"
    healed = data_parallel(tmp_path / "healed", 2, flips, steps=8)
    assert [r["exit"] for r in healed] == [0, 0]
    for report in healed:
        (mismatch,) = report["mismatches"]
        assert (mismatch["step"], mismatch["agreed_step"], mismatch["odd"], mismatch["found_by"],
                mismatch["healed"]) == (6, 4, [], "", True)
    clean = data_parallel(tmp_path / "clean", 2, steps=8)
    assert healed[0]["losses"]["8"] == clean[0]["losses"]["8"]  # bitwise: the replay undid the flips
    assert committed(tmp_path / "healed" / "checkpoints" / "tiny-cpu") == [(4, 0), (8, 0)]


@pytest.mark.slow
def test_two_replicas_that_differ_with_no_state_to_replay_from_start_again_from_the_agreed_one(tmp_path):
    ranks = data_parallel(tmp_path, 2, "debug.inject.bit_flips=[{step: 3, rank: 0}]", steps=6)
    assert [r["exit"] for r in ranks] == [77, 77]
    assert [(r["mismatches"][0]["step"], r["mismatches"][0]["odd"]) for r in ranks] == [(4, []), (4, [])]
    assert "no state to replay from" in ranks[0]["mismatches"][0]["reason"]
    assert committed(tmp_path / "checkpoints" / "tiny-cpu") == []  # the save at 4 came after the comparison
