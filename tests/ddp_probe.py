"""Run by tests/test_distributed.py under torchrun; rank 0 writes its result to STATE_DIR/probe.json
(not stdout: both ranks write there, and a block-buffered rank can split another's line)."""

import hashlib
import json
import os
import sys
from pathlib import Path

import torch.distributed as dist
from torch.distributed.tensor import DTensor

from engine.hooks import Boundary
from engine.requests import Action, Request
from engine.spec.loader import load_spec
from engine.train import Trainer
from tpud.worker.entry import run_and_exit
from testkit.recorders import StepLosses


class RankZeroRequest(StepLosses):
    """Asks rank 0 alone for a checkpoint at one boundary, as a signal to one process would."""

    def __init__(self, at: Boundary | None):
        super().__init__()
        self.at = at

    def poll(self, at):
        # No time to finish the step: the checkpoint is taken at this very boundary, mid-step or not.
        return Request(Action.CHECKPOINT, deadline_s=0.0) if at == self.at and dist.get_rank() == 0 else None


def main(job: str, state_dir: str, *overrides: str) -> None:
    request_at = os.environ.get("PROBE_RANK0_CHECKPOINT_AT")
    hooks = RankZeroRequest(Boundary(*map(int, request_at.split(","))) if request_at else None)
    trainer = Trainer(load_spec(job, list(overrides)), Path(state_dir), hooks)
    code = trainer.run()
    params = list(trainer.model.parameters())
    held = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in params)
    # Every rank takes part: gathering a sharded (FSDP) weight is a collective.
    whole = [p.detach().full_tensor() if isinstance(p, DTensor) else p.detach() for p in params]
    if dist.get_rank() == 0:
        digest = hashlib.sha256(b"".join(w.numpy().tobytes() for w in whole)).hexdigest()
        result = {"world": dist.get_world_size(), "losses": hooks.losses, "weights": [w.sum().item() for w in whole],
                  "digest": digest, "held": held / sum(w.numel() for w in whole), "exit": code,
                  "parallel": trainer.backend.describe().get("parallel")}
        (Path(state_dir) / "probe.json").write_text(json.dumps(result))
    trainer.backend.close()


if __name__ == "__main__":
    # Ended as the worker ends (joined threads, atexit, flushed, os._exit): finalising the interpreter
    # after a process group's use once aborted here ("terminate called without an active exception").
    run_and_exit(lambda: main(*sys.argv[1:]))
