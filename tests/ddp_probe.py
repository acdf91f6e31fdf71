"""Run by tests/test_distributed.py under torchrun; rank 0 prints one JSON line."""

import json
import sys
from pathlib import Path

import torch.distributed as dist

from engine.specfile import load_spec
from engine.train import Trainer
from tests.recorders import StepLosses


def main(job: str, state_dir: str, *overrides: str) -> None:
    hooks = StepLosses()
    trainer = Trainer(load_spec(job, list(overrides)), Path(state_dir), hooks)
    trainer.run()
    if dist.get_rank() == 0:
        weights = [p.detach().sum().item() for p in trainer.model.parameters()]
        print(json.dumps({"world": dist.get_world_size(), "losses": hooks.losses, "weights": weights}))
    trainer.backend.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
