"""Distillation end to end: a student distilled from a teacher against the same student on hard labels.

The data: the standard library's docstrings, bytes, a tenth held out. The teacher (a wider,
deeper model) trains `--teacher-steps` on it; then the student (the tiny preset) trains
`--steps` twice from the same seed, once on hard labels alone and once with `distill:` (forward
KL from the teacher's committed checkpoint, alpha 0), both evaluated on the same held-out batches
every `--eval-every` steps. Target (issue 45): the distilled student's held-out loss is the lower
one. Then the teacher's top `--top-k` is stored with the data (`tpud prepare --teacher`'s pass) and
the student trains a third time from it (`distill.teacher: offline`): its bytes per token, the
pass's time, and its step time against the teacher in memory. A fourth run adds `distill.hidden`
(the student's 2nd and 4th blocks learn the teacher's 3rd and 6th through projections from width
128 to 256, `--hidden-weight`): reported beside the others, no target. Every run is in this process
on CPU.

    .venv/bin/python bench/distill_run.py          # about 5 minutes on 2 cores
Results: a table on stdout and bench/results/distill_run.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TEACHER = ("model.dim=256", "model.n_layers=6", "model.n_heads=8", "model.n_kv_heads=4", "model.ffn_dim=768",
           "optimizer.lr=1e-3")


def run(home: Path, data: Path, name: str, steps: int, eval_every: int, *overrides: str) -> dict:
    """One training run in this process: its held-out losses by step, and its time."""
    from engine import events
    from engine.spec.loader import load_spec
    from engine.train import Trainer
    from testkit import TINY_JOB
    from testkit.recorders import Recorder

    spec = load_spec(TINY_JOB, [f"name={name}", f"data.dataset={data}", "model.vocab_size=264", "data.seq_len=128",
                                "data.micro_batch_size=8", "train.log_interval=10", "scheduler.warmup_steps=5",
                                f"train.max_steps={steps}", f"eval.interval_steps={eval_every}", "eval.batches=8",
                                "checkpoint.interval_steps=0", *overrides])
    started, recorder = time.monotonic(), Recorder()
    code = Trainer(spec, home, recorder).run()
    if code != 0:
        raise SystemExit(f"{name}: the run exited {code}")
    steps = recorder.of(events.Step)
    return {"seconds": round(time.monotonic() - started, 1),
            "eval": {e.step: round(e.loss, 4) for e in recorder.of(events.Eval)},
            "train_loss_last": round(steps[-1].loss, 4),
            # After the first report (startup, warm-up): the steady steps' time.
            "step_time_s": round(statistics.median(s.step_time_s for s in steps[1:] or steps), 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--teacher-steps", type=int, default=300)
    parser.add_argument("--steps", type=int, default=100, help="the student's, in each run")
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--docs", type=int, default=600, help="docstrings in the dataset")
    parser.add_argument("--top-k", type=int, default=32, help="the offline teacher's predictions per token")
    parser.add_argument("--hidden-weight", type=float, default=0.05, help="distill.hidden.weight of the fourth run")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "distill_run.json")
    args = parser.parse_args()

    from engine import logs
    from engine.prepare.options import Options
    from engine.prepare.pipeline import prepare
    from testkit import corpus
    from machine import describe

    logs.configure("warning")
    with tempfile.TemporaryDirectory(prefix="distill-run-") as scratch:
        home = Path(scratch)
        source = corpus.write(home / "docstrings.jsonl", corpus.docstrings(args.docs), "jsonl")
        prepare(Options(inputs=(str(source),), tokenizer="bytes", out=str(home / "data"), workers=1, progress=False,
                        val_fraction=0.1))
        teacher = run(home, home / "data", "teacher", args.teacher_steps, args.teacher_steps, *TEACHER)
        hard = run(home, home / "data", "hard", args.steps, args.eval_every)
        teacher_dir = home / "checkpoints" / "teacher"
        distilled = run(home, home / "data", "distilled", args.steps, args.eval_every, f"distill.teacher={teacher_dir}")
        offline = store_and_train(home, teacher_dir, args)
        hidden = run(home, home / "data", "hidden", args.steps, args.eval_every, f"distill.teacher={teacher_dir}",
                     f'distill.hidden={{"layers": [[2, 3], [4, 6]], "weight": {args.hidden_weight}}}')
    final = args.steps
    result = {"machine": describe(), "teacher": {"overrides": list(TEACHER), "steps": args.teacher_steps, **teacher},
              "student_steps": args.steps, "hard": hard, "distilled": distilled, "offline": offline,
              "hidden": {"weight": args.hidden_weight, **hidden},
              "held_out_loss": {"hard": hard["eval"][final], "distilled": distilled["eval"][final],
                                "offline": offline["eval"][final], "hidden": hidden["eval"][final]},
              "offline_step_time_ratio": round(offline["step_time_s"] / distilled["step_time_s"], 3),
              "target_met": distilled["eval"][final] < hard["eval"][final]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"teacher: {args.teacher_steps} steps, held-out loss {teacher['eval'][args.teacher_steps]} "
          f"({teacher['seconds']} s)")
    print(f"{'step':>6} {'hard labels':>12} {'distilled':>10} {'offline':>8} {'+ hidden':>9}")
    for step in sorted(hard["eval"]):
        print(f"{step:>6} {hard['eval'][step]:>12.4f} {distilled['eval'][step]:>10.4f} {offline['eval'][step]:>8.4f} "
              f"{hidden['eval'][step]:>9.4f}")
    print(f"step time: teacher in memory {distilled['step_time_s']} s, offline top {args.top_k} "
          f"{offline['step_time_s']} s ({result['offline_step_time_ratio']}x); offline teacher "
          f"{offline['bytes_per_token']} bytes/token, stored in {offline['pass_seconds']} s")
    print(f"distilled below hard labels at step {final}: {result['target_met']}  ({args.out})")


def store_and_train(home: Path, teacher: Path, args: argparse.Namespace) -> dict:
    """The teacher's top k stored beside the data (timed, its bytes per token), then the offline run."""
    from engine.data import manifest as mf
    from engine.distill.offline import annotate

    started = time.monotonic()
    annotate(home / "data", str(teacher), args.top_k, 128, models_cache=home / "models")
    seconds = time.monotonic() - started
    stored = mf.read(home / "data")
    tokens = sum(s.tokens for s in stored.splits.values())
    size = sum(entry.bytes for files in stored.teacher.splits.values() for entry in files)
    return {"pass_seconds": round(seconds, 1), "bytes_per_token": round(size / tokens, 1), "top_k": args.top_k,
            **run(home, home / "data", "offline", args.steps, args.eval_every, "distill.teacher=offline")}


if __name__ == "__main__":
    main()
