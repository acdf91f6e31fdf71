"""The CUDA path end to end: real jobs under `tpud run` on a GPU, killed and resumed.

For each preset the job trains under `tpud run` with `device.backend: cuda` (compiled: the
backend's default there), each arm in its own home: `whole` uninterrupted (the reference), and
`killed`, its worker SIGKILLed once a step past its first interval checkpoint is logged, so the
supervisor restarts it and the new worker resumes from that checkpoint. Reported per preset:
tokens/s and MFU (the median over the step lines after the first two, as the worker computes
them against the GPU's peak bf16 FLOP/s); of the killed arm, the median step time before the kill
and after the resume (the resumed worker's first two lines left out) and their ratio (issue 41's
target: within 5 %), each start's startup badput (the compile caches under the job's state make
the second start's shorter), checkpoint write seconds, the step resumed from; and how far the
two arms' final weights are apart (bitwise equality only where every kernel is deterministic:
`--deterministic` sets device.deterministic). Unless --no-export, the reference's final
checkpoint is exported with `tpud export --dtype fp32` and loaded with transformers on the GPU:
its logits against the engine's on the same tokens (fp32). A GPU is required.

    python bench/cuda.py                                   # tiny and 125m, both arms, ~4 min on an H100
    python bench/cuda.py --presets tiny --deterministic --steps 120 --interval 50 --no-export
    python bench/cuda.py --presets 125m --seq-len 2048 --steps 200 --arms killed --no-export

Results: a table on stdout and bench/results/cuda.json (--out).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from machine import describe

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the engine, also where the project is not pip-installed (a bare GPU machine)
PRESETS = {  # preset: (seq_len, micro_batch_size, max_steps, checkpoint interval)
    "tiny": (256, 16, 300, 100),
    "125m": (1024, 16, 300, 100),
}
KILL_AFTER = 20  # steps past the first interval checkpoint


def job_file(root: Path, preset: str, seq_len: int, mbs: int, steps: int, interval: int,
             deterministic: bool, backend: str = "cuda") -> Path:
    text = f"""name: cuda-{preset}
include: [{REPO}/configs/models/{preset}.yaml, {REPO}/configs/attention/auto.yaml]
data: {{seq_len: {seq_len}, micro_batch_size: {mbs}}}
train: {{max_steps: {steps}, log_interval: 10, seed: 0}}
optimizer: {{lr: 1.0e-3, weight_decay: 0.1}}
scheduler: {{warmup_steps: 20}}
device: {{backend: {backend}, deterministic: {str(deterministic).lower()}}}
checkpoint: {{interval_steps: {interval}}}
"""
    path = root / f"cuda-{preset}.yaml"
    path.write_text(text)
    return path


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


def run(job: Path, home: Path, kill_after: int | None) -> list[dict]:
    """`tpud run` the job; with kill_after, SIGKILL the worker once that step is logged."""
    proc = subprocess.Popen([sys.executable, "-m", "tpud", "run", str(job), "--home", str(home)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(), cwd=REPO)
    records, lines, worker, killed = [], [], None, False
    for line in proc.stdout:
        lines.append(line.rstrip())
        try:
            record = json.loads(line)
        except ValueError:
            continue
        records.append(record)
        if record.get("event") == "worker started":
            worker = record["pid"]
        if (kill_after is not None and not killed and record.get("event") == "step"
                and record["step"] >= kill_after):
            os.kill(worker, signal.SIGKILL)
            killed = True
    if proc.wait() != 0:
        tail = "\n".join(lines[-15:])
        raise SystemExit(f"tpud run {job.name} exited {proc.returncode}:\n{tail}")
    return records


def final_weights(home: Path, name: str, scratch: Path) -> dict:
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    step_dir = max((home / "state" / "checkpoints" / name).glob("step_*"))
    out = scratch / f"{home.name}.pt"
    dcp_to_torch_save(step_dir, out)
    return torch.load(out, weights_only=False)["model"]


def exported_logits_diff(job: Path, home: Path, scratch: Path, weights: dict) -> tuple[float, float]:
    """(export seconds, max |logits difference|) of transformers' model against the engine's."""
    import time

    import torch
    import transformers

    from engine.attention.sdpa import sdpa_attention
    from engine.models.llama import Transformer
    from engine.spec.loader import load_spec

    out = scratch / f"{home.name}-hf"
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "tpud", "export", str(job), str(out), "--dtype", "fp32", "--home", str(home)],
                   check=True, env=_env(), cwd=REPO)
    seconds = time.monotonic() - started
    spec = load_spec(job)
    ours = Transformer(spec.model, sdpa_attention).cuda().eval()
    ours.load_state_dict(weights)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).cuda().eval()
    tokens = torch.randint(0, 256, (2, 256), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    with torch.no_grad():
        diff = (ours.logits(ours(tokens)) - theirs(tokens).logits).abs().max().item()
    return seconds, diff


def step_lines(records: list[dict]) -> list[list[dict]]:
    """The step lines of each worker start, in order."""
    starts: list[list[dict]] = []
    for r in records:
        if r.get("event") == "worker started":
            starts.append([])
        elif r.get("event") == "step" and starts:
            starts[-1].append(r)
    return [lines for lines in starts if lines]


def seconds_to_ready(records: list[dict]) -> list[float]:
    """Each worker start's seconds from its start to its first step line: construction, restore,
    compilation (the second start reads the compile cache the first one wrote) and the first steps."""
    from datetime import datetime

    def at(r: dict) -> float:
        return datetime.fromisoformat(r["timestamp"].replace("Z", "+00:00")).timestamp()

    spans, started = [], None
    for r in records:
        if r.get("event") == "worker started":
            started = at(r)
        elif r.get("event") == "step" and started is not None:
            spans.append(round(at(r) - started, 2))
            started = None
    return spans


def settled(lines: list[dict]) -> list[dict]:
    """A start's step lines once compilation and caches have warmed: the first two left out."""
    return lines[2:] if len(lines) > 3 else lines[1:] or lines


def measure(preset: str, scratch: Path, args) -> dict:
    seq_len, mbs, steps, interval = PRESETS[preset]
    seq_len, mbs = args.seq_len or seq_len, args.micro_batch_size or mbs
    steps, interval = args.steps or steps, args.interval or interval
    job = job_file(scratch, preset, seq_len, mbs, steps, interval, args.deterministic, args.backend)
    arms = {arm: run(job, scratch / f"{preset}-{arm}", interval + KILL_AFTER if arm == "killed" else None)
            for arm in args.arms}
    first = next(iter(arms.values()))
    ready = [r for r in first if r.get("event") == "trainer ready"]
    timed = settled(step_lines(first)[0])
    row = {
        "preset": preset, "steps": steps, "seq_len": seq_len, "micro_batch_size": mbs,
        "deterministic": args.deterministic, "arms": list(arms),
        "params": ready[0]["params"], "precision": ready[0]["precision"], "attention": ready[0]["attention"],
        "loss": ready[0].get("loss"), "compile": ready[0].get("compile"),
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
        "mfu": statistics.median(r["mfu"] for r in timed) if timed[0].get("mfu") is not None else None,
        "step_time_s": statistics.median(r["step_time_s"] for r in timed),
        "checkpoint_s": [r["seconds"] for r in first if r.get("event") == "checkpoint committed"],
        "final_loss": {arm: [r["loss"] for r in recs if r.get("event") == "step"][-1] for arm, recs in arms.items()},
    }
    if "killed" in arms:
        starts = step_lines(arms["killed"])
        before, after = settled(starts[0]), settled(starts[-1])
        row["resumed_at"] = [r["resumed_at"] for r in arms["killed"] if r.get("event") == "trainer ready"]
        row["step_time_before_kill_s"] = statistics.median(r["step_time_s"] for r in before)
        row["step_time_after_resume_s"] = statistics.median(r["step_time_s"] for r in after)
        row["after_over_before"] = row["step_time_after_resume_s"] / row["step_time_before_kill_s"]
        row["ready_s"] = seconds_to_ready(arms["killed"])
        # The supervisor's goodput ledger of the job (both starts): startup, restore, lost work, down time.
        ledger = json.loads((scratch / f"{preset}-killed" / "state" / "jobs" / f"cuda-{preset}" / "job.json").read_text())
        row["badput_s"] = {k: round(v, 2) for k, v in ledger["goodput"]["badput"].items() if v}
    if set(arms) == {"whole", "killed"}:
        a, b = (final_weights(scratch / f"{preset}-{arm}", f"cuda-{preset}", scratch) for arm in ("whole", "killed"))
        diff = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
        row.update(weights_bitwise_equal=diff == 0.0, weights_max_abs_diff=diff)
        if args.export:
            row["export_s"], row["exported_logits_max_abs_diff"] = exported_logits_diff(
                job, scratch / f"{preset}-whole", scratch, a)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", default=",".join(PRESETS), help="comma-separated: " + ",".join(PRESETS))
    parser.add_argument("--arms", default="whole,killed", type=lambda v: v.split(","),
                        help="whole (uninterrupted), killed (SIGKILLed and resumed), or both (default)")
    parser.add_argument("--seq-len", type=int, help="default: per preset")
    parser.add_argument("--micro-batch-size", type=int, help="default: per preset")
    parser.add_argument("--steps", type=int, help="max_steps (default: per preset)")
    parser.add_argument("--interval", type=int, help="checkpoint interval (default: per preset); the kill comes "
                        f"{KILL_AFTER} steps after the first")
    parser.add_argument("--deterministic", action="store_true", help="device.deterministic: true")
    parser.add_argument("--no-export", dest="export", action="store_false",
                        help="skip the export to transformers and its logits check")
    parser.add_argument("--backend", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: this script's own check on a machine without a GPU (tiny only)")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "cuda.json")
    args = parser.parse_args()
    if not set(args.arms) <= {"whole", "killed"} or not args.arms:
        parser.error(f"--arms: whole, killed or both, not {','.join(args.arms)}")
    import torch

    if args.backend == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench/cuda.py needs a CUDA GPU (--backend cpu checks the script without one)")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for preset in args.presets.split(","):
            rows.append(measure(preset, Path(tmp), args))
    print(f"{'preset':<6} {'params':>11} {'tokens/s':>10} {'MFU':>6} {'step s':>7} {'ckpt s':>7} "
          f"{'after/before kill':>17} {'to 1st step s':>13} {'weights':>10} {'HF logits diff':>15}")
    for r in rows:
        mfu = f"{r['mfu'] * 100:.1f}%" if r["mfu"] is not None else "-"
        weights = ("-" if "weights_bitwise_equal" not in r else
                   "bitwise" if r["weights_bitwise_equal"] else f"{r['weights_max_abs_diff']:.1e}")
        ratio = f"{r['after_over_before']:.3f}" if "after_over_before" in r else "-"
        startup = "/".join(f"{s:.1f}" for s in r.get("ready_s", [])) or "-"
        logits = f"{r['exported_logits_max_abs_diff']:.2e}" if "exported_logits_max_abs_diff" in r else "-"
        print(f"{r['preset']:<6} {r['params']:>11,} {r['tokens_per_s']:>10,.0f} {mfu:>6} {r['step_time_s']:>7.4f} "
              f"{max(r['checkpoint_s'], default=0):>7.2f} {ratio:>17} {startup:>13} {weights:>10} {logits:>15}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"benchmark": "cuda", "machine": describe(),
                                    "presets": rows}, indent=2))


if __name__ == "__main__":
    main()
