"""TPU readiness on the CPU mesh: the xla backend's training step as XLA compiles and runs it.

Each case trains a job with the 125m geometry (configs/models/125m.yaml; a short seq_len and a
small batch so a step takes seconds on a few cores) through the real `Trainer.run()` on the
xla backend under SPMD, in its own process with PJRT_DEVICE=CPU and CPU_NUM_DEVICES=N (4 and 8
virtual devices: the mesh is {data: 1, fsdp: N, tensor: 1}, weights sharded FSDP-style). The
job evaluates and checkpoints every --interval steps; the first --interval steps are the
warm-up, so it holds the first evaluation and the first checkpoint; the --steps steps after it
are the window, which holds at least one more of each, the final evaluation and the final
checkpoint. Measured, against an ideal computed in the same run:

(a) recompiles: torch_xla's CompileTime count at the boundary after the warm-up and after the
    run (testkit.recorders.XlaCounters); ideal 0.
(b) device-to-host transfers: its TransferFromDeviceTime count at every step boundary, after
    waiting for the backend's reader thread, so a transfer counts at the step whose report
    asked for it. Steps that neither report (log_interval), evaluate nor checkpoint must show
    none; the other kinds' counts are listed.
(c) FLOPs: XLA writes each graph it compiles into a dump directory (XLA_FLAGS=--xla_dump_to
    --xla_dump_hlo_as_text): the per-device optimized HLO, after SPMD partitioning. The sync
    points the loop calls (backend.micro_step_end, step_end) are wrapped to note which files
    each sync adds; with no recompile in the window, the graphs the window's steps ran are
    the last ones compiled at each sync point outside evaluation. torch_xla exposes no cost
    analysis, so 2*M*N*K is summed over the dot instructions of those graphs (fusion bodies
    included), times the devices, and compared with the MFU formula's count,
    engine.models.llama.flops_per_token x tokens per step (6 N + 12 L H Dh T: the causal mask
    ignored, as the eager attention also computes the whole score matrix). With
    --activation-checkpointing each block's forward runs again in backward: the HLO then
    holds the formula's count plus one more forward of the blocks, less each one's last matmul
    (w2: nothing in backward needs its output, so XLA drops it), that is 2 (N_blocks - L D F)
    + 4 L H Dh T per token (engine.models.llama.recompute_flops_per_token), which is what it is
    compared with (MFU itself never counts recomputation).
(d) collectives in the same graphs, per kind: count and bytes (the whole tensor each moves:
    an all-gather's output, a reduce-scatter's input; testkit/hlo.py). XLA's CPU pipeline has
    no pass that turns an all-reduce whose users only keep their device's slice (dynamic-slice
    by partition id) into a reduce-scatter, as TPU's does, so that pattern is counted as a
    reduce-scatter. An all-gather whose operand comes from a sharded entry parameter (through
    copies, transposes, converts) gathers a weight; any other gathers activations (the token
    ids, here). Ideal, from the model's parameters: all-gathers = every sharded weight's bytes
    once, twice when the graph gathers weights again in backward (more gathers than sharded
    weights); reduce-scatters = every sharded weight's bytes once (one micro-batch per step);
    all-reduces = the replicated weights' (norms') gradients plus scalars (loss, grad norm);
    all-to-alls = the embedding lookup's: its table is sharded over the model dim, and GSPMD
    looks each token up on every device's slice and moves the rows to their batch shard (one
    device's share of the embedded batch, forward and again for the gradient), which is far
    less than gathering the table; any other kind (collective-permute, ...) none. With
    --activation-checkpointing the ideal is the same: the weights gathered again in backward
    can serve both the recomputed forward and the gradients.

Targets: 0 recompiles; 0 transfers on plain steps; HLO FLOPs within 10% of the formula's;
per collective kind, bytes within 10% of the ideal and no unexpected kind. A missed target is
printed; the exit status stays 0 (a report). fp32 by default: CPUs have no fast bf16 matmul,
and neither count depends on the dtype (bytes would halve for bf16 gathers).

    .venv/bin/python bench/xla_step.py                      # 4 and 8 devices, ~15 min on 2 cores
    .venv/bin/python bench/xla_step.py --devices 4 --activation-checkpointing   # ~8 min: xla_step-ac.json
    .venv/bin/python bench/xla_step.py --devices 4 --model tiny --steps 6 --interval 3 --out xla_step-tiny.json

Results: a table on stdout and bench/results/xla_step.json (xla_step-ac.json).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
JOB = REPO / "configs" / "jobs" / "tiny-cpu.yaml"
TOLERANCE = 0.10  # FLOPs and collective bytes, relative to the ideal

# -----------------------------------------------------------------------------
# The child: one device count, one training run (PJRT_DEVICE=CPU, CPU_NUM_DEVICES set by the parent).


class GraphLog:
    """Which sync point compiled which graph. XLA compiles on the thread that syncs and writes the
    optimized module into the dump directory as it does, so the files a sync adds are its graphs."""

    def __init__(self, dump: Path, trainer):
        self.dump, self.phase, self.compiled = dump, "train", []  # (sync point, phase, file name)
        backend = trainer.backend
        for point in ("micro_step_end", "step_end"):
            setattr(backend, point, self._noting(point, getattr(backend, point)))
        evaluate = trainer.evaluator.run

        def evaluating(step: int):
            self.phase = "eval"
            try:
                return evaluate(step)
            finally:
                self.phase = "train"

        trainer.evaluator.run = evaluating

    def _modules(self) -> set[str]:
        return {p.name for p in self.dump.glob("*after_optimizations.txt")}

    def _noting(self, point: str, sync):
        def noted() -> None:
            before = self._modules()
            sync()
            self.compiled += [(point, self.phase, name) for name in sorted(self._modules() - before)]
        return noted

    def step_graphs(self) -> list[str]:
        """The last graph compiled at each sync point while training (not evaluating)."""
        last = {point: name for point, phase, name in self.compiled if phase == "train"}
        return sorted(set(last.values()))


def timed_counters():
    from testkit.recorders import XlaCounters

    class Timed(XlaCounters):
        """Also the wall time at each step boundary."""

        def counts(self) -> dict:
            return {**super().counts(), "seconds": time.perf_counter()}

    return Timed()


def job_spec(args, dataset: Path):
    import yaml

    from engine.data.dataset import Prepared
    from engine.spec.loader import load_spec

    model = yaml.safe_load((REPO / "configs" / "models" / f"{args.model}.yaml").read_text())["model"]
    model["activation_checkpointing"] = args.activation_checkpointing
    model["n_layers"] = args.n_layers or model["n_layers"]
    # The byte tokenizer's specials lie past the tiny model's 256 bytes.
    model["vocab_size"] = max(model["vocab_size"], Prepared.open(dataset).manifest.tokenizer.vocab_size)
    return load_spec(JOB, [
        f"name=xla-step-{args.model}", f"model={json.dumps(model)}", f"data.dataset={dataset}",
        f"data.seq_len={args.seq_len}", f"data.micro_batch_size={args.micro_batch_size}",
        f"train.max_steps={args.interval + args.steps}", f"train.log_interval={args.log_interval}",
        "train.grad_accum_steps=1", "scheduler.warmup_steps=2", f"train.mixed_precision={args.precision}",
        f"eval={{interval_steps: {args.interval}, batches: 2}}", f"checkpoint.interval_steps={args.interval}",
        "device.backend=xla", "device.compile_cache=false", "attention.kernel=eager",
    ])


def step_kinds(step: int, args) -> list[str]:
    """What the loop does after step `step` besides training (the Reporter's, Evaluator's, Checkpointer's rules)."""
    last = args.interval + args.steps
    kinds = []
    if step % args.log_interval == 0 or step % args.interval == 0 or step == last:
        kinds.append("log")  # a save reports the pending steps first
    if step % args.interval == 0 or step == last:
        kinds += ["eval", "checkpoint"]
    return kinds or ["plain"]


def measure(args) -> dict:
    import torch
    import torch_xla

    from engine import logs
    from engine.backends.xla import weight_partition
    from engine.models.llama import flops_per_token, recompute_flops_per_token
    from engine.train import Trainer
    from testkit.hlo import Hlo, collective_totals

    logs.configure("warning")
    spec = job_spec(args, args.data)
    counters = timed_counters()
    started = time.perf_counter()
    trainer = Trainer(spec, args.state, counters)
    counters.flush = trainer.backend.flush
    graphs = GraphLog(args.dump, trainer)
    try:
        code = trainer.run()
    finally:
        trainer.backend.close()
    end = counters.counts()
    wall_s = time.perf_counter() - started

    # (a), (b): counts over the window, and per step.
    warmup, last = args.interval, args.interval + args.steps
    at = {**counters.at_step, last: end}  # at[s]: before step s + 1 (at[last]: after the run)
    steps = []
    for step in range(warmup + 1, last + 1):
        delta = {k: at[step][k] - at[step - 1][k] for k in end}
        steps.append({"step": step, "kinds": step_kinds(step, args), **delta})
    plain = [s for s in steps if s["kinds"] == ["plain"]]
    window = {k: end[k] - at[warmup][k] for k in end}

    # (c), (d): the step's graphs.
    modules = {name: Hlo((args.dump / name).read_text()) for name in graphs.step_graphs()}
    per_device_flops = sum(m.dot_flops()[0] for m in modules.values())
    convolutions = sum(m.count("convolution") for m in modules.values())
    n = trainer.backend.num_devices
    tokens = spec.data.micro_batch_size * spec.data.seq_len
    cfg = spec.model
    formula = flops_per_token(cfg, spec.data.seq_len) * tokens
    recompute = recompute_flops_per_token(cfg, spec.data.seq_len) * tokens
    expected = formula + recompute
    hlo_flops = per_device_flops * n

    found = [c for m in modules.values() for c in m.collectives()]
    collectives = collective_totals(modules.values())
    params = [(name, p) for name, p in trainer.model.named_parameters()]
    sharded = [p.numel() * p.element_size() for name, p in params if weight_partition(name, p) is not None]
    replicated = [p.numel() * p.element_size() for name, p in params if weight_partition(name, p) is None]
    weight_gathers = collectives.get("all-gather (weights)", {"count": 0})["count"]
    regathered = weight_gathers > len(sharded)
    scalars = sum(size for kind, size in found if kind == "all-reduce" and size <= 8)
    embedding = trainer.model.tok_embeddings.weight
    ideal = {
        "all-gather": sum(sharded) * (2 if regathered else 1),
        "reduce-scatter": sum(sharded),
        "all-reduce": sum(replicated) + scalars,
        # The lookup's rows, from the device holding their model-dim slice to the one holding their
        # batch slice, and their gradient back: one device's share of the embedded batch, twice.
        "all-to-all": 2 * tokens // n * cfg.dim * embedding.element_size(),
    }
    measured = {kind: sum(size for k, size in found if k.startswith(kind)) for kind in ideal}
    unexpected = {kind: v for kind, v in collectives.items()
                  if not kind.startswith(("all-gather", "reduce-scatter", "all-reduce", "all-to-all"))}
    ratios = {kind: measured[kind] / ideal[kind] if ideal[kind] else None for kind in ideal}

    checks = {
        "recompiles": window["compiles"] == 0,
        "plain_step_transfers": all(s["to_host"] == 0 for s in plain),
        "flops": abs(hlo_flops / expected - 1) <= TOLERANCE and convolutions == 0,
        "collectives": not unexpected and all(r is not None and abs(r - 1) <= TOLERANCE for r in ratios.values()),
    }
    return {
        "devices": n, "exit": code, "wall_s": wall_s, "mesh": trainer.backend.describe()["mesh"],
        "params": sum(p.numel() for _, p in params), "tokens_per_step": tokens,
        "warmup_steps": warmup, "window_steps": args.steps,
        "compiles_during_warmup": at[warmup]["compiles"], "window": window, "steps": steps,
        "plain_steps": len(plain), "plain_step_to_host_max": max((s["to_host"] for s in plain), default=None),
        "step_graphs": {name: {"dots": m.dot_flops()[1], "per_device_flops": m.dot_flops()[0]}
                        for name, m in modules.items()},
        "compiled": graphs.compiled,
        "flops": {"hlo_per_device": per_device_flops, "hlo_total": hlo_flops, "formula": formula,
                  "recompute": recompute, "expected": expected, "ratio": hlo_flops / expected,
                  "convolutions": convolutions},
        "collectives": collectives, "collective_bytes": measured, "ideal_bytes": ideal, "ratios": ratios,
        "weights_gathered_again_in_backward": regathered, "sharded_weights": len(sharded),
        "unexpected": unexpected, "checks": checks,
        "versions": {"torch": torch.__version__, "torch_xla": torch_xla.__version__},
    }


# -----------------------------------------------------------------------------
# The parent: a dataset with a validation split, one child per device count, the table.


def prepare_dataset(directory: Path) -> Path:
    """The stdlib corpus (engine.data.corpus) as byte-tokenized documents, 5% held out for eval."""
    from engine.data.corpus import stdlib_corpus
    from engine.prepare.pipeline import prepare
    from engine.prepare.options import Options

    text = stdlib_corpus(2_000_000).tobytes().decode("utf-8", errors="replace")
    source = directory / "docs.jsonl"
    with open(source, "w") as f:
        for start in range(0, len(text), 4000):
            f.write(json.dumps({"text": text[start:start + 4000]}) + "\n")
    out = directory / "docs"
    prepare(Options(inputs=(str(source),), tokenizer="bytes", out=str(out), val_fraction=0.05, workers=1,
                    progress=False))
    return out


def run_case(devices: int, args, work: Path) -> dict:
    dump, state = work / f"dump-{devices}", work / f"state-{devices}"
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(devices), "TF_CPP_MIN_LOG_LEVEL": "2",
           "XLA_FLAGS": f"--xla_dump_to={dump} --xla_dump_hlo_as_text",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, __file__, "--child", "--data", str(args.data), "--state", str(state), "--dump", str(dump),
               "--devices", str(devices), *args.passed]
    out = subprocess.run(command, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{devices} devices: exit {out.returncode}\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def fmt_bytes(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def print_table(cases: list[dict]) -> None:
    print()
    header = f"{'devices':>7}  {'check':<34} {'measured':>18} {'ideal':>18} {'ratio':>7}  result"
    print(header)
    print("-" * len(header))
    for c in cases:
        ok = c["checks"]
        rows = [
            ("recompiles in window", c["window"]["compiles"], 0, None, ok["recompiles"]),
            (f"to-host transfers, {c['plain_steps']} plain steps", c["plain_step_to_host_max"] or 0, 0, None,
             ok["plain_step_transfers"]),
            ("step FLOPs (HLO dots x devices)", f"{c['flops']['hlo_total']:.4g}", f"{c['flops']['expected']:.4g}",
             c["flops"]["ratio"], ok["flops"]),
        ]
        for kind in c["ideal_bytes"]:
            r = c["ratios"][kind]
            rows.append((f"{kind} bytes", fmt_bytes(c["collective_bytes"][kind]), fmt_bytes(c["ideal_bytes"][kind]), r,
                         r is not None and abs(r - 1) <= TOLERANCE))
        for kind, v in c["unexpected"].items():
            rows.append((f"{kind} (not FSDP's)", f"{v['count']} x, {fmt_bytes(v['bytes'])}", "0", None, False))
        for label, measured, ideal, ratio, passed in rows:
            print(f"{c['devices']:>7}  {label:<34} {str(measured):>18} {str(ideal):>18} "
                  f"{'' if ratio is None else f'{ratio:.3f}':>7}  {'pass' if passed else 'FAIL'}")
        counts = ", ".join(f"{k} {v['count']} x {fmt_bytes(v['bytes'])}" for k, v in sorted(c["collectives"].items()))
        print(f"{'':>9}collectives per step: {counts}")
        print(f"{'':>9}per step kind, to-host transfers: " + ", ".join(
            f"{'+'.join(s['kinds'])}@{s['step']}={s['to_host']}" for s in c["steps"] if s["kinds"] != ["plain"]))
        print()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", default="4,8", help="comma-separated CPU_NUM_DEVICES values, one run each")
    parser.add_argument("--model", default="125m", help="configs/models/<name>.yaml")
    parser.add_argument("--n-layers", type=int, default=None, help="fewer layers than the model's, for a quick look")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=8, help="global; a multiple of every device count")
    parser.add_argument("--interval", type=int, default=10,
                        help="evaluate and checkpoint every N steps; the first N steps are the warm-up")
    parser.add_argument("--steps", type=int, default=20, help="the measured window after the warm-up")
    parser.add_argument("--log-interval", type=int, default=5)
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--out", type=Path, default=None,
                        help="default: bench/results/xla_step.json (xla_step-ac.json with --activation-checkpointing)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    for internal in ("--data", "--state", "--dump"):
        parser.add_argument(internal, type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps < args.interval:
        parser.error("--steps must be at least --interval: the window must hold an evaluation and a checkpoint")
    if args.child:
        print(json.dumps(measure(args)))
        return 0

    from machine import describe

    name = "xla_step-ac" if args.activation_checkpointing else "xla_step"
    args.out = args.out or REPO / "bench" / "results" / f"{name}.json"

    args.passed = strip_options(sys.argv[1:], ("--devices", "--out"))
    started = time.perf_counter()
    cases = []
    with tempfile.TemporaryDirectory(prefix="tpud-xla-step-") as tmp:
        work = Path(tmp)
        args.data = prepare_dataset(work)
        for devices in (int(d) for d in args.devices.split(",")):
            print(f"running {args.model} on {devices} CPU devices ...", flush=True)
            cases.append(run_case(devices, args, work))
    wall_s = time.perf_counter() - started
    print_table(cases)
    missed = [f"{c['devices']} devices: {k}" for c in cases for k, ok in c["checks"].items() if not ok]
    print(f"MISSED TARGETS: {'; '.join(missed)}" if missed else "all targets met")
    print(f"wall time {wall_s:.0f} s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {"benchmark": "xla_step", "machine": describe(**cases[0]["versions"]),
              "settings": {k: v for k, v in vars(args).items() if k not in ("passed", "data", "state", "dump", "child", "out")},
              "tolerance": TOLERANCE, "wall_s": wall_s, "cases": cases}
    args.out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(f"wrote {args.out}")
    return 0


def strip_options(argv: list[str], names: tuple[str, ...]) -> list[str]:
    """argv without the named options (and their values): the parent's own, not passed to the children."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in names:
            skip = True
        elif not arg.startswith(tuple(f"{n}=" for n in names)):
            kept.append(arg)
    return kept


if __name__ == "__main__":
    raise SystemExit(main())
