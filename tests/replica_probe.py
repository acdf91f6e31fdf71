"""One rank of tests/test_replicas.py's data-parallel runs (spawned with RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT): trains the job, writes STATE_DIR/rank<R>.json with its exit code and
the replica_mismatch and straggler events it emitted, and exits with the trainer's exit code."""

import json
import sys
from pathlib import Path

import torch.distributed as dist

from engine import events
from engine.runtime import Runtime
from engine.spec.loader import load_spec
from engine.train import Trainer
from tpud.worker.entry import run_and_exit
from testkit.recorders import Recorder


def main(job: str, state_dir: str, *overrides: str) -> int:
    hooks = Recorder()
    # Runtime.from_env: TPUD_MEMORY_DIR gives the ranks a memory tier, as the supervisor would.
    trainer = Trainer(load_spec(job, list(overrides)), Path(state_dir), hooks, runtime=Runtime.from_env())
    code = trainer.run()
    rank = dist.get_rank()
    mismatches = [dict(e.to_json()) for e in hooks.of(events.ReplicaMismatch)]
    stragglers = [dict(e.to_json()) for e in hooks.of(events.Straggler)]
    (Path(state_dir) / f"rank{rank}.json").write_text(json.dumps({"exit": code, "mismatches": mismatches,
                                                                   "stragglers": stragglers,
                                                                   "steps": sorted(hooks.losses),
                                                                   "losses": hooks.losses}))
    return code


if __name__ == "__main__":
    run_and_exit(lambda: main(*sys.argv[1:]))  # as the worker ends: no interpreter finalisation to abort in
