"""A mixture of experts' step against a dense model of the same active parameters.

Three arms train in the same process on the same batches (the built-in corpus, one seed), each a
real `engine.train.Trainer` with the report every step:

- dense:    the tiny-moe preset's geometry with one SwiGLU of top_k x the experts' hidden size,
            so a token goes through as many weights as in the MoE (the router aside);
- dropless: the tiny-moe preset (4 experts, 2 per token), its sorted dropless expert path;
- capacity: the same with model.moe.capacity_factor (the static-shape path XLA runs).

The arms run in rounds, each round every arm in turn, so drift and cache effects land on all
of them alike; a step's time is the step event's step_time_s, the first `--warmup` steps of each
run left out. Reported: the median step time per arm and each MoE arm's ratio to the dense one
(the price of routing: the router, the sort or the seat assignment, the scatter back), the
dropped fraction of the capacity arm, and the parameters (all, and active per token).

    .venv/bin/python bench/moe.py                          # CPU, ~1 min on 2 idle cores
    .venv/bin/python bench/moe.py --backend cuda --seq-len 2048 --micro-batch-size 8 --dim 1024

Results: a table on stdout and bench/results/moe.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


from bench.machine import describe  # noqa: E402
from engine import events  # noqa: E402
from engine.hooks import Hooks  # noqa: E402
from engine.models.llama import flops_per_token  # noqa: E402
from engine.spec.loader import load_mapping, load_spec  # noqa: E402
from engine.train import Trainer  # noqa: E402

TINY_JOB = REPO / "configs" / "jobs" / "tiny-cpu.yaml"


class Steps(Hooks):
    def __init__(self):
        self.steps: list[events.Step] = []

    def emit(self, event):
        if isinstance(event, events.Step):
            self.steps.append(event)


def model_section(arm: str, args: argparse.Namespace) -> dict:
    model = load_mapping(REPO / "configs" / "models" / "tiny-moe.yaml")["model"]
    model.update(dim=args.dim, n_layers=args.layers, max_seq_len=max(args.seq_len, model["max_seq_len"]))
    moe = model.pop("moe")
    expert_dim = moe.get("expert_ffn_dim") or model["ffn_dim"]
    if arm == "dense":
        return {**model, "ffn_dim": moe["top_k"] * expert_dim}
    if arm == "capacity":
        moe["capacity_factor"] = args.capacity_factor
    return {**model, "moe": moe}


def run(arm: str, args: argparse.Namespace, work: Path) -> tuple[list[float], list[events.Step], dict]:
    spec = load_spec(TINY_JOB, [
        f"model={json.dumps(model_section(arm, args))}", f"device.backend={args.backend}",
        f"train.max_steps={args.warmup + args.steps}", "train.log_interval=1", "scheduler.warmup_steps=1",
        f"data.seq_len={args.seq_len}", f"data.micro_batch_size={args.micro_batch_size}",
        "checkpoint.interval_steps=0", "checkpoint.memory.interval_steps=0", "data.corpus_bytes=2000000",
        "train.mixed_precision=" + ("bf16" if args.backend == "cuda" else "fp32")])
    hooks = Steps()
    trainer = Trainer(spec, Path(tempfile.mkdtemp(dir=work)), hooks)
    params = sum(p.numel() for p in trainer.model.parameters())
    active = flops_per_token(spec.model, 0) / 6  # the weights a token's matmuls go through
    assert trainer.run() == 0
    trainer.backend.close()
    return [s.step_time_s for s in hooks.steps[args.warmup:]], hooks.steps, {"params": params, "active": active}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--capacity-factor", type=float, default=1.25)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "moe.json")
    args = parser.parse_args()
    arms = ("dense", "dropless", "capacity")
    times: dict[str, list[float]] = {arm: [] for arm in arms}
    dropped: list[float] = []
    sizes: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="tpud-bench-moe-") as work:
        for round_ in range(args.rounds):
            for arm in arms:
                timed, steps, sizes[arm] = run(arm, args, Path(work))
                times[arm] += timed
                if arm == "capacity":
                    dropped += [s.dropped_fraction for s in steps]
                print(f"round {round_ + 1}/{args.rounds} {arm}: median {statistics.median(timed) * 1e3:.1f} ms",
                      file=sys.stderr)
    median = {arm: statistics.median(values) for arm, values in times.items()}
    result = {
        "benchmark": "moe", "machine": describe(backend=args.backend),
        "geometry": {k: getattr(args, k) for k in ("dim", "layers", "seq_len", "micro_batch_size", "capacity_factor")},
        "arms": {arm: {"median_step_s": median[arm], "ratio_to_dense": median[arm] / median["dense"],
                       "params": sizes[arm]["params"], "active_params_per_token": sizes[arm]["active"],
                       "step_times_s": times[arm]} for arm in arms},
        "capacity_dropped_fraction_median": statistics.median(dropped),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'arm':<10} {'median step':>12} {'x dense':>8} {'params':>10} {'active/token':>13}")
    for arm in arms:
        a = result["arms"][arm]
        print(f"{arm:<10} {a['median_step_s'] * 1e3:>10.1f}ms {a['ratio_to_dense']:>8.2f} {a['params']:>10,} "
              f"{a['active_params_per_token']:>13,.0f}")
    print(f"capacity {args.capacity_factor}: median dropped fraction {result['capacity_dropped_fraction_median']:.3f}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
