"""engine/resume.py: the live state a gang's newest holder sends to the others, over a real gloo group."""

from __future__ import annotations

import torch
import torch.distributed as dist

from engine.checkpoint.checkpointer import Progress
from engine.resume import take_live_state


def _rank(rank: int, rendezvous: str, results) -> None:
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2)
    try:
        torch.manual_seed(rank)  # another model on each rank
        model = torch.nn.Linear(4, 3)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
        mine = (Progress(7, 0, 700), [(3, 1)]) if rank == 0 else (Progress(5, 2, 500), [(9, 2)])
        progress, theirs = take_live_state(rank, 0, model, optimizer, *mine)
        results[rank] = (progress, theirs, [p.detach().clone() for p in model.parameters()],
                         optimizer.state_dict()["state"][0]["exp_avg"].clone(),
                         [p.grad for p in model.parameters()])
    finally:
        dist.destroy_process_group()


def test_a_peer_takes_the_sources_model_optimizer_progress_and_skips(tmp_path):
    import torch.multiprocessing as mp

    results = mp.Manager().dict()
    mp.spawn(_rank, args=(str(tmp_path / "rendezvous"), results), nprocs=2)
    source, peer = results[0], results[1]
    assert source[:2] == (Progress(7, 0, 700), [(3, 1)])  # the source's own, unchanged
    # The peer's step in flight is redone from the source's: progress at a step boundary.
    assert peer[:2] == (Progress(7, 0, 700), [(3, 1)])
    assert all(torch.equal(a, b) for a, b in zip(source[2], peer[2])) and torch.equal(source[3], peer[3])
    assert peer[4] == [None, None]  # its own gradients dropped with its step
