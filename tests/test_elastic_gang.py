"""The elastic gang end to end: `tpud run` hosts on loopback, each running its own coordinator
(gang.coordinators), so losing any host, host 0 included, leaves the others a place to meet; with
gang.min_hosts below the host count they go on without it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time

import pytest

from engine.checkpoint.manifest import committed_steps
from testkit.helpers import free_port, wait_until
from tests.test_multihost import STARTED, Host, replace_vm, wait_step

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _end_supervisors():
    yield
    while STARTED:
        proc = STARTED.pop()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def elastic(root, count: int, min_hosts: int | None = None) -> list[Host]:
    ports = [free_port() for _ in range(count)]
    hosts = [Host(root, i, count, ports[0]) for i in range(count)]
    listed = ", ".join(f"'127.0.0.1:{p}'" for p in ports)
    for h in hosts:
        h.coordinator = f"127.0.0.1:{ports[h.index]}"
        (h.home / "tpud.yaml").write_text(
            f"gang: {{host_index: {h.index}, host_count: {count}, coordinators: [{listed}]"
            + (f", min_hosts: {min_hosts}" if min_hosts else "") + "}\n")
    return hosts


def final_state(h: Host, steps: int, tmp_path) -> dict:
    """The newest global commit's whole state, flat, less the data loader's rank (each host's own)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    _, path, manifest = committed_steps(h.home / "state" / "checkpoints" / "tiny-cpu")[-1]
    assert manifest.step == steps and (path / "global.json").exists()
    dcp_to_torch_save(path, tmp_path / f"host{h.index}.pt")
    flat = {}

    def walk(tree, prefix=""):
        for key, value in tree.items():
            walk(value, f"{prefix}{key}.") if isinstance(value, dict) else flat.__setitem__(prefix + key, value)

    walk(torch.load(tmp_path / f"host{h.index}.pt", weights_only=False))
    del flat["loader.rank"]
    return {k: v.numpy().tobytes() if isinstance(v, torch.Tensor) else v for k, v in flat.items()}


def test_a_gang_of_three_whose_host_0_vanishes_finishes_on_the_other_two(tmp_path):
    """Host 0's daemon, worker and coordinator killed at once (its VM gone): hosts 1 and 2 meet in
    host 1's coordinator, form without host 0 and finish the job (exit 0), bitwise alike. Before
    gang.coordinators they lost their only coordinator and waited for host 0 for ever."""
    steps = 24
    hosts = elastic(tmp_path, 3, min_hosts=2)
    for h in hosts:
        h.start(f"train.max_steps={steps}")
    wait_step(hosts[1], 6)
    os.kill(hosts[0].worker(), signal.SIGKILL)
    hosts[0].proc.kill()  # its coordinator dies with it (parent-death signal)
    killed = time.monotonic()
    assert [hosts[1].wait(), hosts[2].wait()] == [0, 0]
    for h in hosts[1:]:
        formed = h.records("gang formed")[-1]
        assert (formed["members"], formed["coordinator"]) == ([1, 2], hosts[1].coordinator)
    assert final_state(hosts[1], steps, tmp_path) == final_state(hosts[2], steps, tmp_path)  # bitwise
    assert time.monotonic() - killed < 120


def test_survivors_back_blank_go_on_without_the_host_lost_before_them(tmp_path, gcs_server):
    """chaos-13's stall, in small: host 2 lost for good, hosts 0 and 1 go on as a gang of two, then
    both VMs are replaced (their coordinators gone with them). Back blank, they fetch the newest
    commit from GCS and form again without host 2, whom the gang that made it had left out. Before,
    their fresh coordinators knew of no gang, and they waited for host 2 for good."""
    hosts = elastic(tmp_path, 3, min_hosts=2)
    run = ("train.max_steps=100000", "checkpoint.remote=gs://tpud-test/elastic")  # stopped by the test
    for h in hosts:
        h.start(*run)
    wait_step(hosts[0], 4)
    replace_vm(hosts[2])

    def committed_by_two() -> bool:  # what a user reads in the bucket: a commit made by hosts 0 and 1
        for blob in gcs_server.client().list_blobs("tpud-test", prefix="elastic/"):
            if blob.name.endswith("/manifest.json") and json.loads(blob.download_as_bytes()).get("members") == [0, 1]:
                return True
        return False

    wait_until(committed_by_two, "a commit of the gang of two on GCS", timeout=180)
    for h in hosts[:2]:
        replace_vm(h)
    for h in hosts[:2]:
        h.start(*run)
    for h in hosts[:2]:
        wait_until(lambda h=h: h.records("gang formed", every_run=False), f"host {h.index} in a gang", timeout=120)
        assert h.records("gang formed", every_run=False)[-1]["members"] == [0, 1]
        assert h.records("gcs download committed", every_run=False)  # its state came from GCS
    back = hosts[0].step()
    wait_until(lambda: hosts[0].step() >= back + 3, "the two training again", timeout=60)
    for h in hosts[:2]:
        h.proc.send_signal(signal.SIGTERM)
    assert [h.wait() for h in hosts[:2]] == [75, 75]


def test_hosts_whose_job_files_differ_both_refuse_under_tpud_run(tmp_path):
    """`tpud run` on two hosts whose optimizer.lr differ: both exit 78 naming the key, every time.
    Before, host 0's refusal ended its `tpud run` and the coordinator with it, and host 1 could be
    left waiting for a coordinator for ever."""
    for attempt in range(2):
        hosts = [Host(tmp_path / str(attempt), i, 2, port) for port in [free_port()] for i in range(2)]
        started = time.monotonic()
        for h, lr in zip(hosts, ("0.001", "0.01")):
            h.start(f"optimizer.lr={lr}")
        assert [h.wait(timeout=60) for h in hosts] == [78, 78], attempt
        assert time.monotonic() - started < 30
        for h in hosts:
            (refusal,) = h.records("job cannot run here")
            assert refusal["key"] == "optimizer.lr"


def test_survivors_keep_their_processes_and_a_blank_host_0_comes_back_from_a_peer(tmp_path):
    """Host 0 vanishes (daemon, worker, coordinator): hosts 1 and 2 go on in place (their worker
    PIDs unchanged) without restoring anything; host 0 comes back with a blank disk and takes the
    newest state from a peer (no checkpoint read), the gang is three again; stopped together, all
    hold bitwise the same state."""
    hosts = elastic(tmp_path, 3, min_hosts=2)
    run = ("train.max_steps=100000", "checkpoint.interval_steps=50")  # stopped by the test, not by the end
    for h in hosts:
        h.start(*run)
    wait_step(hosts[1], 20)
    workers = [hosts[1].worker(), hosts[2].worker()]
    os.kill(hosts[0].worker(), signal.SIGKILL)
    hosts[0].proc.kill()
    hosts[0].wait()
    shutil.rmtree(hosts[0].home / "state")  # a replacement VM: its disk is blank
    for h in hosts[1:]:
        wait_until(lambda h=h: [r for r in h.records("gang formed") if r["members"] == [1, 2]], "the gang of two",
                   timeout=60)
    hosts[0].start(*run)
    wait_until(lambda: [r for r in hosts[0].records("gang formed", every_run=False) if r["members"] == [0, 1, 2]],
               "host 0 back in the gang", timeout=120)
    back = hosts[0].step()
    wait_until(lambda: hosts[0].step() >= back + 5, "the three training together", timeout=60)
    for h in hosts:
        h.proc.send_signal(signal.SIGTERM)  # checkpoint and stop: the gang agrees on the step
    assert [h.wait() for h in hosts] == [75, 75, 75]
    assert [hosts[1].worker(), hosts[2].worker()] == workers  # in place: never restarted
    for h in hosts[1:]:
        formed = [(r["members"], r["path"]) for r in h.records("gang formed")]
        assert formed[0] == ([0, 1, 2], "restart") and ([1, 2], "in_place") in formed, formed
        assert formed[-1] == ([0, 1, 2], "in_place"), formed
        assert not h.records("checkpoint restored")  # nothing read back: the survivors kept their state
    (taken,) = hosts[0].records("state taken from a peer", every_run=False)
    assert taken["step"] > 20 and taken["bytes"] > 0 and taken["bytes_per_s"] > 0
    assert not hosts[0].records("checkpoint restored", every_run=False)
    step = hosts[1].records("checkpoint committed")[-1]["step"]
    assert final_state(hosts[0], step, tmp_path) == final_state(hosts[1], step, tmp_path) == final_state(
        hosts[2], step, tmp_path)


def test_a_paused_host_0_commits_nothing_for_the_generation_it_lost_and_rejoins(tmp_path):
    """Split brain: host 0's daemon and worker SIGSTOPped (its coordinator runs on) for longer than
    the others take to go on without it (min_hosts 2): they form a gang of two; SIGCONT: host 0
    wakes with its old view, commits nothing for the generation it lost (the fence), rejoins, and
    all three finish with the same weights."""
    hosts = elastic(tmp_path, 3, min_hosts=2)
    for h in hosts:
        h.start("train.max_steps=100000", "checkpoint.interval_steps=10")  # stopped by the test
    wait_step(hosts[0], 15)
    paused = [hosts[0].worker(), hosts[0].proc.pid]
    for pid in paused:
        os.kill(pid, signal.SIGSTOP)
    stopped = time.time()
    for h in hosts[1:]:
        wait_until(lambda h=h: [r for r in h.records("gang formed") if r["members"] == [1, 2]], "a gang of two",
                   timeout=60)
    wait_until(lambda: hosts[1].step() >= 15 + 20, "the two training on", timeout=60)
    time.sleep(max(0.0, stopped + 12 - time.time()))
    resumed = time.time()
    for pid in reversed(paused):
        os.kill(pid, signal.SIGCONT)
    rejoined = wait_until(lambda: [r for r in hosts[0].records("gang formed") if r["members"] == [0, 1, 2]
                                   and stamp(r) > resumed], "host 0 rejoining", timeout=120)[0]
    rejoined_at = stamp(rejoined)
    wait_until(lambda: [r for r in hosts[0].records("step") if stamp(r) > rejoined_at + 1], "the three training",
               timeout=60)
    for h in hosts:
        h.proc.send_signal(signal.SIGTERM)  # checkpoint and stop: the gang agrees on the step
    assert [h.wait() for h in hosts] == [75, 75, 75]
    # Between waking and rejoining, host 0 committed nothing: its old generation was over.
    assert not [r for r in hosts[0].records("checkpoint committed") if resumed < stamp(r) < rejoined_at]
    step = hosts[1].records("checkpoint committed")[-1]["step"]
    assert final_state(hosts[0], step, tmp_path) == final_state(hosts[1], step, tmp_path) == final_state(
        hosts[2], step, tmp_path)


def stamp(record: dict) -> float:
    from datetime import datetime

    return datetime.fromisoformat(record["timestamp"]).timestamp()
