"""Run under PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 by tests/test_xla.py; prints one JSON line.

Trains the tiny job on the xla backend, optionally stopping with a checkpoint at a given
boundary (step, micro-step); when it reaches max_steps it writes the final parameters
and optimizer state, on the host, to HOME/final.pt. It reports the sharding of the first
layer's wq, its optimizer state, and its gradient as a partial-step checkpoint restored it.
"""

import json
import sys
from pathlib import Path

import torch

from engine.requests import Action, Request
from engine.spec.loader import load_spec
from engine.train import Trainer
from testkit.recorders import Recorder


def main(job: str, home: str, stop: str, *overrides: str) -> None:
    step, micro = (int(x) for x in stop.split(","))
    script = Recorder({(step, micro): Request(Action.CHECKPOINT_AND_EXIT, deadline_s=0)} if step >= 0 else {})
    import torch_xla

    trainer = Trainer(load_spec(job, list(overrides)), Path(home), script)
    resumed_at = (trainer.progress.step, trainer.progress.micro_step)
    wq = trainer.model.layers[0].attention.wq.weight
    restored_grad = None if wq.grad is None else torch_xla._XLAC._get_xla_sharding_spec(wq.grad)  # a partial step's
    code = trainer.run()
    state_sharding = {k: torch_xla._XLAC._get_xla_sharding_spec(v) for k, v in trainer.optimizer.state[wq].items()
                      if torch.is_tensor(v) and v.shape == wq.shape}
    if code == 0:
        state = {"params": {n: p.detach().cpu() for n, p in trainer.model.named_parameters()},
                 "optim": {k: {f: v.cpu() if torch.is_tensor(v) else v for f, v in s.items()}
                           for k, s in trainer.optimizer.state_dict()["state"].items()}}
        torch.save(state, Path(home) / "final.pt")
    print(json.dumps({"exit": code, "resumed_at": resumed_at, "losses": script.losses,
                      "param_sharding": torch_xla._XLAC._get_xla_sharding_spec(wq), "state_sharding": state_sharding,
                      "restored_grad_sharding": restored_grad}))


if __name__ == "__main__":
    main(*sys.argv[1:])
