"""The cost of document masking (data.document_mask): training step time with and without it.

Two real `engine.train.Trainer`s of the same job (configs/jobs/tiny-cpu.yaml, the built-in
corpus, whose files are the documents; same seed, same weights, same samples) differ only in
data.document_mask. Their steps interleave, one of each in turn, so drift and other processes'
load land on both alike; each step is `micro_batch()` then `optimizer_step()`, the loop's own
work, timed from the host (after a synchronize on CUDA). The masked side pays for reading the
segment ids from the document index, the targets' weights, the mask (a dense [B, 1, T, T]
boolean for sdpa and eager, a block mask for flex) and the kernel's masked path.

    .venv/bin/python bench/document_mask.py                     # cpu, sdpa, seq 256 and 1024
    .venv/bin/python bench/document_mask.py --device cuda       # bf16, compiled: flash sdpa vs flex

Reported: each side's median step time and masked / unmasked (the baseline is the unmasked
run, measured in the same process), the share of targets trained on, and the kernels.
Results: a table on stdout and bench/results/document_mask[-cuda].json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from engine import logs
from engine.spec.loader import load_spec
from engine.train import Trainer
from machine import describe

REPO = Path(__file__).resolve().parents[1]
JOB = REPO / "configs" / "jobs" / "tiny-cpu.yaml"
CASES = {"cpu": [dict(seq_len=256, micro_batch_size=16), dict(seq_len=1024, micro_batch_size=4)],
         "cuda": [dict(seq_len=2048, micro_batch_size=16), dict(seq_len=8192, micro_batch_size=4)]}


def trainer(device: str, case: dict, masked: bool, state: Path) -> Trainer:
    overrides = [f"device.backend={device}", f"data.seq_len={case['seq_len']}", "train.max_steps=1000",
                 f"data.micro_batch_size={case['micro_batch_size']}", f"model.max_seq_len={case['seq_len']}",
                 f"data.document_mask={str(masked).lower()}", "data.corpus_bytes=20000000",
                 "train.mixed_precision=" + ("bf16" if device == "cuda" else "fp32")]
    return Trainer(load_spec(JOB, overrides), state)


def step(t: Trainer) -> float:
    sync = torch.cuda.synchronize if t.backend.device.type == "cuda" else lambda: None
    sync()
    started = time.perf_counter()
    t.micro_batch()
    t.optimizer_step()
    sync()
    return time.perf_counter() - started


def run_case(device: str, case: dict, steps: int, warmup: int) -> dict:
    with tempfile.TemporaryDirectory() as home:
        sides = {name: trainer(device, case, name == "masked", Path(home) / name) for name in ("unmasked", "masked")}
        times: dict[str, list[float]] = {name: [] for name in sides}
        for i in range(warmup + steps):
            for name, t in sides.items():
                seconds = step(t)
                if i >= warmup:
                    times[name].append(seconds)
        masked = sides["masked"]
        trained = sum(masked.loader.step_targets(s) for s in range(warmup + steps))
        all_tokens = masked.loader.tokens_in_steps(0, warmup + steps)
        for t in sides.values():
            t.batches.close()
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    return {**case, "kernels": {name: t.model.layers[0].attention.attention_fn.__name__ for name, t in sides.items()},
            "median_step_s": medians, "ratio": medians["masked"] / medians["unmasked"],
            "trained_share": trained / all_tokens, "step_times_s": times}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    logs.configure("warning")
    results = [run_case(args.device, case, args.steps, args.warmup) for case in CASES[args.device]]
    print(f"{'seq_len':>8} {'batch':>6} {'unmasked s':>11} {'masked s':>9} {'ratio':>6} {'trained':>8}  kernels")
    for r in results:
        print(f"{r['seq_len']:>8} {r['micro_batch_size']:>6} {r['median_step_s']['unmasked']:>11.4f} "
              f"{r['median_step_s']['masked']:>9.4f} {r['ratio']:>6.3f} {r['trained_share']:>8.2%}  "
              f"{r['kernels']['unmasked']} / {r['kernels']['masked']}")
    out = REPO / "bench" / "results" / f"document_mask{'-cuda' if args.device == 'cuda' else ''}.json"
    out.write_text(json.dumps({"machine": describe(), "python": platform.python_version(), "torch": torch.__version__,
                               "device": args.device, "steps": args.steps, "warmup": args.warmup,
                               "cases": results}, indent=2) + "\n")
    print(f"written {out.relative_to(REPO)}")


if __name__ == "__main__":
    main()
