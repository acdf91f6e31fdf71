"""Supervision's cost for several processes of one job on one host (device.processes_per_host).

The same job, two worker processes sharding the tiny model (FSDP2 over gloo on CPU), run in
turns: under `tpud run` (the daemon starts both, relays their output, watches each one's
heartbeats over its channel) and under torchrun (`python -m torch.distributed.run
--nproc-per-node=2 -m engine.train`, no supervisor). Each arm's step time is the worker's own
(`step_time_s` of the step lines, both ranks), after a warm-up; the arms alternate for
--rounds rounds so drift lands on both. Both run without the memory tier (torchrun's workers have
no daemon to keep it); a third arm runs supervised with it (each process keeping its own shards at
the tier's auto interval), reported beside. Reported: each arm's median step time, and supervised
/ torchrun (target <= 1.02), and the memory arm / torchrun.

    .venv/bin/python bench/local_processes.py        # ~4 min on 2 idle cores

Results: a table on stdout and bench/results/local_processes.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from testkit import TINY_JOB, python_env  # noqa: E402

TARGET = 1.02
NO_MEMORY = ("checkpoint.memory=null",)  # torchrun's workers have no daemon to keep a memory tier


def job_args(steps: int, memory: tuple[str, ...] = NO_MEMORY) -> list[str]:
    return ["data.corpus_bytes=400000", "data.micro_batch_size=8", "data.seq_len=256", f"train.max_steps={steps}",
            "train.log_interval=5", "scheduler.warmup_steps=1", "checkpoint.interval_steps=0", "device.backend=cpu",
            "device.processes_per_host=2", *memory]


def step_times(stdout: str, warmup: int) -> list[float]:
    """The step lines' step_time_s; torchrun passes both ranks' output through as it comes, so a
    line spliced from two is skipped."""
    records = []
    for line in stdout.splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return [r["step_time_s"] for r in records if r.get("event") == "step" and r["step"] > warmup]


def supervised(steps: int, warmup: int, memory: tuple[str, ...] = NO_MEMORY) -> tuple[list[float], float]:
    with tempfile.TemporaryDirectory() as home:
        started = time.monotonic()
        out = subprocess.run([sys.executable, "-m", "tpud", "run", str(TINY_JOB), "--home", home,
                              *job_args(steps, memory)],
                             capture_output=True, text=True, env=python_env(), timeout=1800, check=True)
        return step_times(out.stdout, warmup), time.monotonic() - started


def torchrun(steps: int, warmup: int) -> tuple[list[float], float]:
    with tempfile.TemporaryDirectory() as state:
        started = time.monotonic()
        # As the daemon sets it for two processes on these cores (tpud/children/ranks.py).
        env = python_env(TPUD_LOG_FORMAT="json", OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // 2)))
        out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                              "-m", "engine.train", str(TINY_JOB), *job_args(steps), "--state-dir", state],
                             capture_output=True, text=True, env=env, timeout=1800, check=True)
        return step_times(out.stdout, warmup), time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "local_processes.json")
    args = parser.parse_args()
    runs = {"torchrun": torchrun, "supervised": supervised,
            "supervised+memory": lambda steps, warmup: supervised(steps, warmup, memory=())}
    arms: dict[str, dict[str, list[float]]] = {name: {"steps": [], "wall": []} for name in runs}
    for _ in range(args.rounds):
        for name, run in runs.items():
            times, wall = run(args.steps, args.warmup)
            arms[name]["steps"] += times
            arms[name]["wall"].append(round(wall, 2))
    medians = {name: statistics.median(arm["steps"]) for name, arm in arms.items()}
    ratio = medians["supervised"] / medians["torchrun"]
    memory_ratio = medians["supervised+memory"] / medians["torchrun"]
    import torch

    result = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__},
              "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds,
              "median_step_s": medians, "ratio": ratio, "target": TARGET, "met": ratio <= TARGET,
              "memory_ratio": memory_ratio, "arms": arms}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"{'arm':<18} {'median step (s)':>16} {'steps timed':>12} {'wall per run (s)':>22}")
    for name, arm in arms.items():
        print(f"{name:<18} {medians[name]:>16.4f} {len(arm['steps']):>12} {str(arm['wall']):>22}")
    print(f"supervised / torchrun: {ratio:.4f} (target <= {TARGET}){'' if ratio <= TARGET else '  MISSED'}")
    print(f"supervised with the memory tier / torchrun: {memory_ratio:.4f}")


if __name__ == "__main__":
    main()
