"""Loss-spike detection (health.spikes) on clean runs: no false alarm, and what it costs.

For each job and seed a real run, `python -m engine.train` with the default spike settings and a
log line per step (every step's loss and gradient norm reach the host, as the detector sees them),
from scratch in a fresh state directory:

- demo: configs/jobs/tiny-cpu.yaml as `make demo` runs it (300 steps);
- 125m: the same job with configs/models/125m.yaml, at --125m-seq-len x --125m-micro-batch-size
        (short, so 300 steps fit on a CPU; its vocabulary is the byte corpus's 256 of 32768).

Reported per run: rollbacks (`rolled back` lines) and exits for a bad step (`nonfinite`): both
must be 0, the false alarms; how near the run came to one: the largest rise over the window's
median any step made, as a share of what a spike needs (the larger of the deviation and the
ratio test's, in log space: >= 1 would be a spike); and the detector's cost: its `observe` over
the run's own series, timed here, per step, against the run's median step time (target < 0.5 %).

    .venv/bin/python bench/spikes.py                    # demo and 125m, seeds 0-2: ~25 min on 2 idle cores
    .venv/bin/python bench/spikes.py --jobs demo --seeds 0 --steps 120

Results: a table on stdout and bench/results/spikes.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import yaml  # noqa: E402

from engine.health.spikes import MAD_TO_SIGMA, SpikeDetector  # noqa: E402
from engine.spec.schema import SpikeConfig  # noqa: E402
from machine import describe  # noqa: E402

JOBS = {"demo": [], "125m": [f"model.{key}={value}" for key, value in
                              yaml.safe_load((REPO / "configs/models/125m.yaml").read_text())["model"].items()]}


def run(job: str, seed: int, args: argparse.Namespace) -> dict:
    overrides = [f"train.seed={seed}", f"train.max_steps={args.steps}", "train.log_interval=1",
                 "checkpoint.interval_steps=0", *JOBS[job]]
    if job == "125m":
        overrides += [f"data.seq_len={args.seq_len_125m}", f"data.micro_batch_size={args.micro_batch_size_125m}"]
    with tempfile.TemporaryDirectory(prefix="tpud-spikes-") as state:
        started = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "engine.train", str(REPO / "configs/jobs/tiny-cpu.yaml"),
                               *overrides, "--state-dir", state], capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
        wall = time.monotonic() - started
    records = []
    for line in proc.stdout.splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    steps = [r for r in records if r.get("event") == "step"]
    if proc.returncode != 0 and not any(r.get("event") == "nonfinite" for r in records):
        raise SystemExit(f"{job} seed {seed} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    series = [(r["step"], r["loss"], r["grad_norm"]) for r in steps]
    return {"job": job, "seed": seed, "steps": len(steps), "wall_s": round(wall, 1), "exit": proc.returncode,
            "rollbacks": sum(r.get("event") == "rolled back" for r in records),
            "bad_step_exits": sum(r.get("event") == "nonfinite" for r in records),
            "median_step_s": statistics.median(r["step_time_s"] for r in steps),
            **nearest_alarm(series), **cost(series)}


def nearest_alarm(series: list[tuple[int, float, float]]) -> dict:
    """The largest share of a spike's bar any judged step reached, per signal (the detector's rules)."""
    cfg, nearest = SpikeConfig(), {"loss": 0.0, "grad_norm": 0.0}
    history: dict[str, list[float]] = {"loss": [], "grad_norm": []}
    ratios = {"loss": cfg.loss_ratio, "grad_norm": cfg.grad_norm_ratio}
    for step, loss, norm in series:
        for signal, value in (("loss", loss), ("grad_norm", norm)):
            window = history[signal][-cfg.window_steps:]
            if step > cfg.warmup_steps and len(window) >= cfg.window_steps // 4:
                centre = statistics.median(window)
                spread = MAD_TO_SIGMA * statistics.median(abs(x - centre) for x in window)
                rise = math.log(value) - centre
                bar = max(math.log(ratios[signal]), cfg.threshold * spread)
                nearest[signal] = max(nearest[signal], rise / bar)
            history[signal].append(math.log(value))
    return {"nearest_loss": round(nearest["loss"], 3), "nearest_grad_norm": round(nearest["grad_norm"], 3)}


def cost(series: list[tuple[int, float, float]], repeats: int = 20) -> dict:
    """The detector's time per step, over the run's own values."""
    started = time.perf_counter()
    for _ in range(repeats):
        detector = SpikeDetector(SpikeConfig())
        for step, loss, norm in series:
            detector.observe(step, loss, norm)
    return {"detector_us_per_step": round((time.perf_counter() - started) / (repeats * len(series)) * 1e6, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", nargs="+", default=list(JOBS), choices=list(JOBS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seq-len-125m", type=int, default=64)
    parser.add_argument("--micro-batch-size-125m", type=int, default=2)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "spikes.json")
    args = parser.parse_args()
    load_before = os.getloadavg()
    results = []
    print(f"{'job':<6} {'seed':>4} {'steps':>5} {'rollbacks':>9} {'exits':>5} {'nearest loss':>12} "
          f"{'nearest norm':>12} {'step ms':>8} {'detector us':>11} {'share':>7}")
    for job in args.jobs:
        for seed in args.seeds:
            r = run(job, seed, args)
            r["detector_share"] = r["detector_us_per_step"] * 1e-6 / r["median_step_s"]
            results.append(r)
            print(f"{job:<6} {seed:>4} {r['steps']:>5} {r['rollbacks']:>9} {r['bad_step_exits']:>5} "
                  f"{r['nearest_loss']:>12.2f} {r['nearest_grad_norm']:>12.2f} {r['median_step_s'] * 1e3:>8.1f} "
                  f"{r['detector_us_per_step']:>11.1f} {r['detector_share']:>7.3%}")
    false_alarms = sum(r["rollbacks"] + r["bad_step_exits"] for r in results)
    worst_share = max(r["detector_share"] for r in results)
    passed = false_alarms == 0 and worst_share < 0.005
    print(f"false alarms: {false_alarms} (target 0); detector cost: at most {worst_share:.3%} of a step "
          f"(target < 0.5%): {'met' if passed else 'MISSED'}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"benchmark": "spikes", "passed": passed, "false_alarms": false_alarms,
                                    "config": {k: v for k, v in vars(args).items() if k != "out"},
                                    "spike_settings": SpikeConfig().model_dump(), "runs": results,
                                    "machine": describe(load_before=load_before)}, indent=2))


if __name__ == "__main__":
    main()
