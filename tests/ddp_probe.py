"""Run by tests/test_distributed.py under torchrun; rank 0 prints one JSON line."""

import json
import sys
from pathlib import Path

import torch.distributed as dist

from engine.hooks import Hooks
from engine.specfile import load_spec
from engine.train import Trainer


class Losses(Hooks):
    def __init__(self):
        self.losses = []

    def emit(self, event, **fields):
        if event == "step":
            self.losses.append(fields["loss"])


def main(job: str, state_dir: str, *overrides: str) -> None:
    hooks = Losses()
    trainer = Trainer(load_spec(job, list(overrides)), Path(state_dir), hooks)
    trainer.run()
    if dist.get_rank() == 0:
        weights = [p.detach().sum().item() for p in trainer.model.parameters()]
        print(json.dumps({"world": dist.get_world_size(), "losses": hooks.losses, "weights": weights}))
    trainer.backend.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
