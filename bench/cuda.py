"""The CUDA path end to end: real jobs under `tpud run` on a GPU, killed and resumed.

For each preset (tiny, 125m) the job trains twice under `tpud run` with `device.backend: cuda`,
each in its own home: once uninterrupted (the reference), once with the worker SIGKILLed right
after its first interval checkpoint is committed plus a few steps, so the supervisor restarts
it and the new worker resumes from that checkpoint. Reported per preset: tokens/s and MFU (the
median over the step lines after the first two, as the worker computes them against the GPU's
peak bf16 FLOP/s), checkpoint write seconds, the step resumed from, and how far the resumed
run's final weights are from the reference's (bitwise equality is expected only where every
kernel is deterministic; the largest absolute difference is printed either way). The reference's
final checkpoint is then exported with `tpud export --dtype fp32` and loaded with transformers'
AutoModelForCausalLM on the GPU: its logits against the engine's on the same tokens (fp32). A GPU is
required: there is no CPU fallback, this is the proof that the CUDA path works.

    python bench/cuda.py                        # on a machine with a CUDA GPU; ~4 min on an H100
    python bench/cuda.py --presets tiny --out /tmp/cuda.json

Results: a table on stdout and bench/results/cuda.json.
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


def job_file(root: Path, preset: str) -> Path:
    seq_len, mbs, steps, interval = PRESETS[preset]
    text = f"""name: cuda-{preset}
include: [{REPO}/configs/models/{preset}.yaml, {REPO}/configs/attention/auto.yaml]
data: {{seq_len: {seq_len}, micro_batch_size: {mbs}}}
train: {{max_steps: {steps}, log_interval: 10, seed: 0}}
optimizer: {{lr: 1.0e-3, weight_decay: 0.1}}
scheduler: {{warmup_steps: 20}}
device: {{backend: cuda}}
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


def measure(preset: str, scratch: Path) -> dict:
    _, _, steps, interval = PRESETS[preset]
    job = job_file(scratch, preset)
    reference = run(job, scratch / f"{preset}-whole", None)
    resumed = run(job, scratch / f"{preset}-killed", kill_after=interval + 20)
    step_lines = [r for r in reference if r.get("event") == "step"][2:]
    a, b = (final_weights(scratch / f"{preset}-{arm}", f"cuda-{preset}", scratch) for arm in ("whole", "killed"))
    diff = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
    export_s, logits_diff = exported_logits_diff(job, scratch / f"{preset}-whole", scratch, a)
    ready = [r for r in resumed if r.get("event") == "trainer ready"]
    final_loss = {arm: [r["loss"] for r in recs if r.get("event") == "step"][-1]
                  for arm, recs in (("whole", reference), ("killed", resumed))}
    return {
        "preset": preset, "steps": steps,
        "params": ready[0]["params"], "precision": ready[0]["precision"], "attention": ready[0]["attention"],
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in step_lines),
        "mfu": statistics.median(r["mfu"] for r in step_lines) if step_lines[0].get("mfu") is not None else None,
        "step_time_s": statistics.median(r["step_time_s"] for r in step_lines),
        "checkpoint_s": [r["seconds"] for r in reference if r.get("event") == "checkpoint committed"],
        "resumed_at": [r["resumed_at"] for r in ready],
        "final_loss": final_loss,
        "weights_bitwise_equal": diff == 0.0, "weights_max_abs_diff": diff,
        "export_s": export_s, "exported_logits_max_abs_diff": logits_diff,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", default=",".join(PRESETS), help="comma-separated: " + ",".join(PRESETS))
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "cuda.json")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench/cuda.py needs a CUDA GPU")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for preset in args.presets.split(","):
            rows.append(measure(preset, Path(tmp)))
    print(f"{'preset':<6} {'params':>11} {'tokens/s':>10} {'MFU':>6} {'step s':>7} {'ckpt s':>7} "
          f"{'resumed':>9} {'loss whole/killed':>18} {'weights':>10} {'export s':>9} {'HF logits diff':>15}")
    for r in rows:
        mfu = f"{r['mfu'] * 100:.1f}%" if r["mfu"] is not None else "-"
        weights = "bitwise" if r["weights_bitwise_equal"] else f"{r['weights_max_abs_diff']:.1e}"
        print(f"{r['preset']:<6} {r['params']:>11,} {r['tokens_per_s']:>10,.0f} {mfu:>6} {r['step_time_s']:>7.4f} "
              f"{max(r['checkpoint_s']):>7.2f} {str(r['resumed_at']):>9} "
              f"{r['final_loss']['whole']:>8.4f}/{r['final_loss']['killed']:<8.4f} {weights:>10} "
              f"{r['export_s']:>9.1f} {r['exported_logits_max_abs_diff']:>15.2e}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"benchmark": "cuda", "machine": describe(gpu=torch.cuda.get_device_name()),
                                    "presets": rows}, indent=2))


if __name__ == "__main__":
    main()
