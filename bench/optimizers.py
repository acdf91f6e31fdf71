"""AdamW vs Lion vs Muon on the CPU demo: the same tokens, each optimizer at its documented defaults.

Each run is a real `engine.train.Trainer` on configs/jobs/tiny-cpu.yaml (the tiny preset,
~0.8 M parameters, byte-level stdlib corpus, 16 x 256 tokens per step, warmup 20 steps then
cosine to 0.1x), with only `optimizer.name` and `train.max_steps` overridden, so every run sees
the identical batches and initial weights. Defaults, from the job's optimizer.lr = 3e-3 and
weight_decay = 0.1 (engine/spec/schema.py, OptimizerConfig):

- adamw: lr 3e-3, betas (0.9, 0.95), wd 0.1 (not on norms, biases, embeddings).
- lion:  lr = lr/3 = 1e-3, wd = 3 x 0.1 = 0.3, betas (0.9, 0.99).
- muon:  Muon on the blocks' matrices with adjust_lr_fn=match_rms_adamw, so AdamW's lr 3e-3
         and wd 0.1, momentum 0.95, nesterov, 5 Newton-Schulz steps; AdamW as above on the
         embedding (tied head) and norms.

Per-step losses come through a Hooks subclass (the "step" event). Reported: the final loss
(mean of the last 10 steps), the best step's loss, and the seconds per step (wall time of
the run / steps, corpus loading excluded; only indicative on a shared machine).

    .venv/bin/python bench/optimizers.py                 # 200 steps each, ~2 min on 2 idle cores
    .venv/bin/python bench/optimizers.py --steps 100 --optimizers adamw,muon

Results: a table on stdout, bench/results/optimizers.json (per-step losses included) and the
loss curves in bench/results/optimizers.png (needs matplotlib).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from engine import events, logs
from engine.hooks import Hooks
from engine.spec.loader import load_spec
from engine.train import Trainer
from machine import describe

REPO = Path(__file__).resolve().parents[1]
JOB = REPO / "configs" / "jobs" / "tiny-cpu.yaml"
OPTIMIZERS = ("adamw", "lion", "muon")
LAST = 10  # the final loss is the mean over this many last steps


class StepLosses(Hooks):
    def __init__(self):
        self.losses: dict[int, float] = {}

    def emit(self, event: events.Event) -> None:
        if isinstance(event, events.Step):
            self.losses[event.step] = event.loss


def run(name: str, steps: int) -> dict:
    spec = load_spec(JOB, [f"optimizer.name={name}", f"train.max_steps={steps}", "train.log_interval=10"])
    hooks = StepLosses()
    with tempfile.TemporaryDirectory() as state_dir:
        trainer = Trainer(spec, Path(state_dir), hooks)
        groups = [{"optimizer": g.get("optimizer", name), "params": len(g["params"]), "lr": g["base_lr"],
                   "weight_decay": g["weight_decay"]} for g in trainer.optimizer.param_groups]
        start = time.perf_counter()
        try:
            code = trainer.run()
        finally:
            trainer.backend.close()
        seconds = time.perf_counter() - start
    losses = [hooks.losses[s] for s in sorted(hooks.losses)]
    assert code == 0 and len(losses) == steps, (name, code, len(losses))
    return {"optimizer": name, "groups": groups, "losses": losses, "seconds": seconds,
            "step_s": seconds / steps, "final_loss": statistics.fmean(losses[-LAST:]), "best_loss": min(losses),
            "tokens_per_step": spec.data.micro_batch_size * spec.data.seq_len * spec.train.grad_accum_steps}


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in results:
        steps = range(1, len(r["losses"]) + 1)
        label = f"{r['optimizer']} (final {r['final_loss']:.3f})"
        for ax in axes:
            ax.plot(steps, r["losses"], label=label, linewidth=1.2)
    n = len(results[0]["losses"])
    tail = [x for r in results for x in r["losses"][n // 2:]]
    axes[0].set_title("training loss, all steps")
    axes[1].set_title("second half (zoomed)")
    axes[1].set_xlim(n // 2, n)
    axes[1].set_ylim(min(tail) - 0.05, max(tail) + 0.05)
    for ax in axes:
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats/byte)")
        ax.grid(alpha=0.3)
        ax.legend()
    tokens = results[0]["tokens_per_step"]
    fig.suptitle(f"tiny-cpu demo: {n} steps x {tokens:,} tokens, each optimizer at its defaults")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps per run (default 200)")
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS), help="comma-separated subset of adamw,lion,muon")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "optimizers.json")
    args = parser.parse_args()
    names = [n.strip() for n in args.optimizers.split(",") if n.strip()]
    if unknown := [n for n in names if n not in OPTIMIZERS]:
        parser.error(f"unknown optimizer(s) {unknown}; known: {', '.join(OPTIMIZERS)}")
    if args.steps <= max(20, LAST):
        parser.error("--steps must exceed the job's 20 warmup steps")

    logs.configure("warning")
    torch.set_num_threads(os.cpu_count() or 1)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.processor() or platform.machine()}")
    t_start = time.perf_counter()
    results = []
    for name in names:
        print(f"running {name}: {args.steps} steps", flush=True)
        results.append(run(name, args.steps))
    wall_s = time.perf_counter() - t_start

    header = f"{'optimizer':<9} {'peak lr (groups)':<24} {'final loss':>10} {'best loss':>9} {'s/step':>7}"
    print()
    print(header)
    print("-" * len(header))
    for r in results:
        lrs = "/".join(f"{lr:g}" for lr in dict.fromkeys(g["lr"] for g in r["groups"]))
        print(f"{r['optimizer']:<9} {lrs:<24} {r['final_loss']:>10.4f} {r['best_loss']:>9.4f} {r['step_s']:>7.3f}")
    print(f"final loss = mean of the last {LAST} steps; {args.steps} steps x {results[0]['tokens_per_step']:,} tokens")
    print(f"wall time {wall_s:.1f} s")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "benchmark": "optimizers",
        "machine": describe(),
        "job": str(JOB.relative_to(REPO)), "steps": args.steps, "final_loss_over_last": LAST,
        "wall_s": wall_s, "runs": results,
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    try:
        png = args.out.with_suffix(".png")
        plot(results, png)
        print(f"wrote {png}")
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
