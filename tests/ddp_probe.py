"""Run by tests/test_distributed.py under torchrun; rank 0 writes its result to STATE_DIR/probe.json
(not stdout: both ranks write there, and a block-buffered rank can split another's line)."""

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

from engine.hooks import Boundary
from engine.requests import Action, Request
from engine.spec.loader import load_spec
from engine.train import Trainer
from tests.recorders import StepLosses


class RankZeroRequest(StepLosses):
    """Asks rank 0 alone for a checkpoint at one boundary, as a signal to one process would."""

    def __init__(self, at: Boundary | None):
        super().__init__()
        self.at = at

    def poll(self, at):
        return Request(Action.CHECKPOINT) if at == self.at and dist.get_rank() == 0 else None


def main(job: str, state_dir: str, *overrides: str) -> None:
    request_at = os.environ.get("PROBE_RANK0_CHECKPOINT_AT")
    hooks = RankZeroRequest(Boundary(*map(int, request_at.split(","))) if request_at else None)
    trainer = Trainer(load_spec(job, list(overrides)), Path(state_dir), hooks)
    trainer.run()
    if dist.get_rank() == 0:
        weights = [p.detach().sum().item() for p in trainer.model.parameters()]
        result = {"world": dist.get_world_size(), "losses": hooks.losses, "weights": weights}
        (Path(state_dir) / "probe.json").write_text(json.dumps(result))
    trainer.backend.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
