"""`tpud profile JOB.yaml`: a trace of a few training steps after warm-up, and where their time went.

The job's own Trainer runs in a scratch state directory (its checkpoints, the memory tier and
the job's real state are never touched), warms up, and then runs `steps` steps under
torch.profiler. The loop marks its phases with record_function scopes (data, forward, loss,
backward, optimizer: engine.train), so the shares come from the same trace a person opens:

- the trace itself, `trace.json` (Chrome trace format: Perfetto and chrome://tracing open it), and
  with a TensorBoard directory (the job's `logging.tensorboard`, local or gs://) a gzipped copy,
  named as torch.profiler.tensorboard_trace_handler names its files, in the job's run beside its
  scalars, where TensorBoard's PyTorch Profiler plugin finds it;
- a table of the top operations by self time, and each phase's share of the measured step
  time; what no phase covers is the host's own time between them (polls, reports, saves), on
  cuda the time the device stood idle;
- advice where a known waste shows: host syncs per step, a loss that takes a large share
  while a faster one would fit, a data loader that stalls the step, compilation left off.

On cuda a phase's time is its kernels' time on the device (backward's: the device's busy time
less the other phases', as autograd launches its kernels from a thread of its own); on cpu and xla it is the host's
(under xla the host traces the graph and the device runs it at the step's end, so the
optimizer phase holds the device time: torch_xla's metrics add the compile and transfer counts).
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from engine import exit_codes
from engine.hooks import Boundary, Hooks
from engine.requests import Action, Request
from engine.spec.schema import JobSpec

PHASES = ("data", "forward", "loss", "backward", "optimizer")
SCOPE = "tpud."  # the loop's record_function names: tpud.data, tpud.forward, ...
# What a host sync looks like in a trace: .item() and device-to-host copies waited on.
SYNCS = ("aten::_local_scalar_dense", "cudaStreamSynchronize", "cudaDeviceSynchronize")


@dataclass
class Report:
    job: str
    backend: str
    steps: int
    step_s: float  # mean wall time of a profiled step (the phases are means too)
    phases: dict[str, float]  # seconds per step in each phase
    host_gaps_s: float  # step time no phase covers
    top: list[dict] = field(default_factory=list)  # name, self seconds per step, calls per step
    syncs_per_step: float | None = None  # cuda only: elsewhere the host runs the ops (or xla's counts tell)
    xla: dict[str, int] | None = None  # compiles and device-to-host transfers in the window
    advice: list[str] = field(default_factory=list)
    trace: str = ""
    tensorboard_trace: str | None = None  # the copy in the TensorBoard directory, if one was given
    tensorboard_error: str | None = None  # ... why it is not there (the profile itself stands)

    def table(self) -> str:
        lines = [f"{self.job}: {self.steps} steps on {self.backend}, {self.step_s * 1000:.1f} ms a step", "",
                 f"{'phase':<14} {'ms/step':>9} {'share':>7}"]
        for name, seconds in [*self.phases.items(), ("host gaps", self.host_gaps_s)]:
            lines.append(f"{name:<14} {seconds * 1000:>9.2f} {seconds / self.step_s:>7.1%}")
        lines += ["", f"{'top operations (self time)':<48} {'ms/step':>9} {'calls/step':>11}"]
        lines += [f"{op['name'][:48]:<48} {op['seconds'] * 1000:>9.2f} {op['calls']:>11.1f}" for op in self.top]
        lines += ["", f"trace: {self.trace}"]
        lines += [f"TensorBoard: {self.tensorboard_trace}"] if self.tensorboard_trace else []
        lines += [f"advice: {line}" for line in self.advice]
        return "\n".join(lines)


class _Window(Hooks):
    """Starts the profiler after `warmup` steps, times each step boundary to boundary, stops the loop."""

    def __init__(self, warmup: int, steps: int):
        self.warmup, self.steps = warmup, steps
        self.profiler: profile | None = None
        self.sync: Callable[[], None] = lambda: None
        self.boundaries: list[float] = []
        self.xla_counts: tuple[dict, dict] | None = None  # torch_xla's counts at the window's start and end

    def poll(self, at: Boundary) -> Request | None:
        if at.micro_step or at.step < self.warmup:
            return None
        self.sync()  # the device's work of the step belongs to the step
        self.boundaries.append(time.perf_counter())
        if at.step == self.warmup:
            if self.xla_counts is not None:
                self.xla_counts[0].update(_xla_counts())
            self.profiler.start()
        elif at.step == self.warmup + self.steps:
            self.profiler.stop()
            if self.xla_counts is not None:
                self.xla_counts[1].update(_xla_counts())
            return Request(Action.STOP)
        return None


def run(spec: JobSpec, steps: int, warmup: int, out: Path, tensorboard: str | None = None) -> Report:
    """Profile `steps` steps of `spec` after `warmup` steps; the trace and report.json go to `out`,
    and the trace to the TensorBoard directory `tensorboard` too when one is given."""
    from engine.train import Trainer  # the Trainer pulls in the model and backends: only when profiling

    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="tpud-profile-") as state:
        spec = _scratch(spec, warmup + steps, Path(state) / "checkpoints")
        hooks = _Window(warmup, steps)
        trainer = Trainer(spec, Path(state), hooks)
        backend = trainer.backend
        cuda = backend.device.type == "cuda"
        hooks.sync = (lambda: torch.cuda.synchronize(backend.device)) if cuda else backend.flush
        hooks.profiler = profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])])
        hooks.xla_counts = ({}, {}) if backend.name == "xla" else None
        try:
            code = trainer.run()
        finally:
            backend.close()
        if code != exit_codes.STOPPED or len(hooks.boundaries) != steps + 1:
            raise RuntimeError(f"the job ended (exit {code}) before {warmup + steps} steps")
        trace = out / "trace.json"
        hooks.profiler.export_chrome_trace(str(trace))
        report = _report(spec, trainer, hooks, cuda)
    report.trace = str(trace)
    if tensorboard:
        try:
            report.tensorboard_trace = tensorboard_trace(trace, tensorboard, spec.name, out)
        except Exception as e:  # a full disk, a bucket that refuses: the profile itself stands
            report.tensorboard_error = f"the trace could not be written to {tensorboard}: {type(e).__name__}: {e}"
    (out / "report.json").write_text(json.dumps(asdict(report), indent=2) + "\n")
    return report


def tensorboard_trace(trace: Path, directory: str, job: str, staging: Path) -> str:
    """A gzipped copy of `trace` in DIR/<job>/ (the job's TensorBoard run), named as
    torch.profiler.tensorboard_trace_handler names its files (a profile exports once, so the handler
    itself cannot write a second copy); a gs:// directory's copy is written in `staging` first and
    uploaded. Where it went."""
    remote = directory.startswith("gs://")
    local = staging / "tensorboard" if remote else Path(directory) / job
    local.mkdir(parents=True, exist_ok=True)
    written = local / f"{socket.gethostname()}_{os.getpid()}.{time.time_ns()}.pt.trace.json.gz"
    with open(trace, "rb") as source, gzip.open(written, "wb") as copy:
        shutil.copyfileobj(source, copy)
    if not remote:
        return str(written)
    from engine.data.remote import client, join, split

    bucket, prefix = split(directory)
    name = join(join(prefix, job), written.name)
    client().bucket(bucket).blob(name).upload_from_filename(str(written))
    return f"gs://{bucket}/{name}"


def _scratch(spec: JobSpec, steps: int, checkpoints: Path) -> JobSpec:
    """The job as it trains, less what would write beside it: no saves, no eval. (model_copy's
    updates skip validation: a job's warm-up may well be longer than the profiled steps.)"""
    # The loop is stopped after the window, before a final save.
    train = spec.train.model_copy(update={"max_steps": steps + 1})
    checkpoint = spec.checkpoint.model_copy(update={"dir": str(checkpoints), "interval_steps": 0,
                                                    "interval_seconds": 0, "memory": None})
    return spec.model_copy(update={"train": train, "checkpoint": checkpoint, "eval": None})


def _report(spec: JobSpec, trainer, hooks: _Window, cuda: bool) -> Report:
    steps = hooks.steps
    step_s = (hooks.boundaries[-1] - hooks.boundaries[0]) / steps
    events = hooks.profiler.key_averages()

    def total(e) -> float:  # a scope's time: its kernels' on cuda, the host's elsewhere
        return (e.device_time_total if cuda else e.cpu_time_total) / 1e6

    phases = {name: 0.0 for name in PHASES}
    for e in events:
        if e.key.startswith(SCOPE) and e.key[len(SCOPE):] in phases:
            phases[e.key[len(SCOPE):]] = total(e) / steps
    # The loss runs inside forward: forward's own share is what is left of it.
    phases["forward"] = max(0.0, phases["forward"] - phases["loss"])
    if cuda:
        phases, gaps = _device_phases(phases, device_busy_s(hooks.profiler.events()) / steps, step_s)
    else:
        gaps = max(0.0, step_s - sum(phases.values()))

    def self_time(e) -> float:
        return (e.self_device_time_total if cuda else e.self_cpu_time_total) / 1e6

    ops = sorted((e for e in events if not e.key.startswith((SCOPE, "ProfilerStep"))), key=self_time, reverse=True)
    top = [{"name": e.key, "seconds": self_time(e) / steps, "calls": e.count / steps} for e in ops[:15]]
    # On a cpu every op is the host's own (fused AdamW reads each step count back: no stall).
    syncs = sum(e.count for e in events if e.key in SYNCS) / steps if cuda else None
    xla = None if hooks.xla_counts is None else {k: v - hooks.xla_counts[0][k] for k, v in hooks.xla_counts[1].items()}
    report = Report(spec.name, trainer.backend.name, steps, step_s, phases, gaps, top, syncs, xla)
    report.advice = _advice(report, trainer)
    return report


def device_busy_s(trace_events) -> float:
    """Seconds the GPU ran kernels and copies in a profiler's events: the union of their spans, as
    kernels of two streams overlap, and without the loop's scopes that the trace mirrors onto the
    GPU's timeline (user annotations, which span their kernels and the idle time between them)."""
    from torch.autograd import DeviceType

    spans = sorted((e.time_range.start, e.time_range.end) for e in trace_events
                   if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False))
    busy_us, reach = 0, float("-inf")
    for start, end in spans:
        if end > reach:
            busy_us += end - max(start, reach)
            reach = end
    return busy_us / 1e6


def _device_phases(phases: dict[str, float], busy_s: float, step_s: float) -> tuple[dict[str, float], float]:
    """On cuda: backward's kernels are launched by autograd's own device thread, outside the loop's
    tpud.backward scope, so the profiler credits them to no phase. Backward is the device's busy time
    less the other phases', and the gaps are the time the device stood idle (the host behind)."""
    others = sum(seconds for name, seconds in phases.items() if name != "backward")
    return {**phases, "backward": max(phases["backward"], busy_s - others)}, max(0.0, step_s - busy_s)


def _advice(r: Report, trainer) -> list[str]:
    advice = []
    share = {name: seconds / r.step_s for name, seconds in r.phases.items()}
    if r.syncs_per_step is not None and r.syncs_per_step >= 1:
        advice.append(f"host syncs per step: {r.syncs_per_step:.0f} (each one stalls the device until it is "
                      "idle: read values at log intervals)")
    if share["loss"] > 0.25 and trainer.loss_name != "ce":
        advice.append(f"the loss takes {share['loss']:.0%} of the step: try loss.name=ce where its logits fit "
                      f"(now {trainer.loss_name})")
    if share["data"] > 0.10:
        advice.append(f"data takes {share['data']:.0%} of the step: the loader stalls it")
    if r.host_gaps_s / r.step_s > 0.20:
        advice.append(f"{r.host_gaps_s / r.step_s:.0%} of the step is outside the model's phases "
                      "(the host between kernels: try device.compile=true, a larger micro-batch)"
                      if r.backend != "cuda" else f"the GPU stands idle {r.host_gaps_s / r.step_s:.0%} of the step "
                      "(the host launches too slowly: try device.compile=true, a larger micro-batch)")
    if trainer.backend.name == "cuda" and not getattr(trainer.backend, "compiling", False):
        advice.append("device.compile is off on cuda: each block runs op by op")
    if r.xla and r.xla["transfers_to_host"] >= r.steps:
        advice.append(f"host syncs per step: {r.xla['transfers_to_host'] / r.steps:.0f} device-to-host transfers")
    if r.xla and r.xla["compiles"] > 0:
        advice.append(f"XLA compiled {r.xla['compiles']} graphs during the window: the step's graph changes "
                      "from step to step")
    return advice


def _xla_counts() -> dict[str, int]:
    import torch_xla.debug.metrics as met

    def count(name: str) -> int:
        data = met.metric_data(name)
        return int(data[0]) if data else 0

    return {"compiles": count("CompileTime"), "transfers_to_host": count("TransferFromDeviceTime")}
