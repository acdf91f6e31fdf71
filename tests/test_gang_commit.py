"""A gang's save of a step some hosts hold committed already and others do not (a host that took a
peer's memory state of it), over a real gloo group: two processes, each a host with its own disk."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from engine.checkpoint.hosts import Hosts
from engine.checkpoint.manifest import committed_steps, read_manifest, step_dir_name

STEP = 3


def _host(rank: int, root: str, results) -> None:
    import os

    import torch.distributed as dist

    from engine import events
    from engine.backends.torch_native import TorchBackend
    from engine.checkpoint.checkpointer import Checkpointer, Progress
    from engine.spec.schema import CheckpointConfig

    os.environ.update(WORLD_SIZE="2", RANK=str(rank))
    dist.init_process_group("gloo", init_method=f"file://{root}/rendezvous", rank=rank, world_size=2)
    try:
        backend = TorchBackend("cpu", gang=True)
        torch.manual_seed(0)  # replicas: the same model on both hosts
        model = torch.nn.Linear(4, 3)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        seen: list[str] = []
        job_dir = Path(root) / f"host{rank}" / "job"
        checkpointer = Checkpointer(CheckpointConfig(memory=None), "job", job_dir, {}, backend, model, optimizer,
                                    {}, lambda e: seen.append(type(e).__name__), hosts=Hosts(rank, 2, (0, 2)))
        progress = Progress(STEP, 0, 30)
        first = checkpointer.save(progress, "interval", wait=True)
        if rank == 1:  # its state came from a peer's memory since: it lacks the part host 0 holds
            shutil.rmtree(job_dir / step_dir_name(STEP, 0))
        dist.barrier()
        seen.clear()
        final = checkpointer.save(progress, "final", wait=True)
        final_events, seen[:] = list(seen), []
        again = checkpointer.save(progress, "final", wait=True)
        results[rank] = (first, final, final_events, again, list(seen))
        checkpointer.close()
    finally:
        dist.destroy_process_group()


def test_a_host_lacking_a_step_its_peers_hold_commits_it_with_them_and_none_waits_alone(tmp_path):
    """The chaos campaign's final save hung for good: hosts holding the step skipped the save while
    the host that lacked it waited in the global commit for them."""
    import torch.multiprocessing as mp

    results = mp.Manager().dict()
    hosts = mp.start_processes(_host, args=(str(tmp_path), results), nprocs=2, join=False, start_method="spawn")
    for _ in range(120):
        if hosts.join(timeout=1):
            break
    else:
        for process in hosts.processes:
            process.kill()
        pytest.fail(f"the save of a step one host lacks never returned (results: {dict(results)})")
    held, lacked = results[0], results[1]
    assert held[:2] == lacked[:2] == (True, True)
    assert lacked[2] == ["CheckpointStarted", "CheckpointCommitted"]  # it wrote its part
    assert held[2] == ["CheckpointCommitted"]  # its part was there: it only joined the commit
    # Now every host holds it: every one skips, no write and no collective of the commit.
    assert held[3:] == lacked[3:] == (True, ["CheckpointCommitted"])
    for host in ("host0", "host1"):
        job_dir = tmp_path / host / "job"
        assert [step for step, _, _ in committed_steps(job_dir)] == [STEP], host
        manifest = read_manifest(job_dir / step_dir_name(STEP, 0))
        assert (manifest.hosts, manifest.members) == (2, (0, 2))  # a gang that shrank: hosts 0 and 2
