"""The training loop, and `python -m engine.train JOB.yaml [key=value ...]`.

Decisions live in the components (backend, attention, loss, optimizer, schedule, data,
checkpointer); this file wires them together and runs steps. Each optimizer step runs
its micro-batches (grad_accum_steps, fewer during a batch ramp); the hooks are polled at
every micro-batch and step boundary, and a checkpoint may be taken at either. Metric tensors are read in batches every log_interval steps through
the backend, so the hot path never waits for the device.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch
from torch import nn

from engine import exit_codes
from engine.attention import build_attention
from engine.backends import build_backend
from engine.config import JobSpec
from engine.data.corpus import stdlib_corpus
from engine.data.loader import AccumSchedule, PackedLoader
from engine.errors import ConfigError
from engine.checkpoint.checkpointer import Checkpointer, Progress
from engine.hooks import Action, Boundary, Hooks, Request, SignalHooks, merge
from engine.losses import LossFn, build_loss, resolve_loss_name
from engine.models.llama import Transformer, flops_per_token
from engine.optim import build_optimizer
from engine.optim.schedule import lr_factor

log = structlog.get_logger()


@dataclass
class StepResult:
    NAMES = ("loss", "grad_norm")

    step: int              # steps completed, this one included
    values: torch.Tensor   # NAMES, on the device, not yet read
    lr: float


class LanguageModel(nn.Module):
    """The model plus its loss, so one forward call (and one DDP/SPMD wrapper) covers both."""

    def __init__(self, model: Transformer, loss_fn: LossFn):
        super().__init__()
        self.model, self.loss_fn = model, loss_fn

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        hidden = self.model(inputs)
        device = hidden.device.type
        if torch.is_autocast_enabled(device):
            # The residual stream is fp32 even under autocast; the head's matmuls should not be.
            hidden = hidden.to(torch.get_autocast_dtype(device))
        return self.loss_fn(hidden.flatten(0, 1), self.model.output_weight, targets.flatten())


def host_rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # not Linux: peak instead of current
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Trainer:
    def __init__(self, spec: JobSpec, state_dir: Path, hooks: Hooks | None = None):
        self.spec, self.hooks = spec, hooks or Hooks()
        self.job_dir = Path(state_dir) / "jobs" / spec.name
        self.backend = build_backend(spec.device, cache_dir=str(self.job_dir / "xla_cache"))
        kernel, attention = build_attention(spec.attention, self.backend)
        # Initialise on the host from the seed: every backend then starts from the same weights.
        torch.manual_seed(spec.train.seed)
        self.model = Transformer(spec.model, attention, self.backend.checkpoint_fn)
        self.module = self.backend.prepare_model(LanguageModel(self.model, build_loss(spec.loss, spec.model)))
        self.optimizer = build_optimizer(spec.optimizer, self.model, self.backend.device)
        tokens = stdlib_corpus(spec.data.corpus_bytes)
        if int(tokens.max()) >= spec.model.vocab_size:
            raise ConfigError("model.vocab_size", f"{spec.model.vocab_size} is below the corpus's largest token id")
        self.loader = PackedLoader(tokens, spec.data.seq_len, spec.data.micro_batch_size,
                                   AccumSchedule.of(spec.train), spec.train.seed, self.backend.data)
        precision = spec.train.mixed_precision
        self.bf16 = precision == "bf16" or (precision == "auto" and self.backend.bf16)
        self.flops_per_token = flops_per_token(spec.model, spec.data.seq_len)
        self.checkpointer = Checkpointer(spec.checkpoint, spec.name, Path(state_dir) / "checkpoints", spec_hash(spec),
                                         self.backend, self.model, self.optimizer, self.loader.state_dict(),
                                         self.hooks.emit)
        self.progress = self.checkpointer.restore() or Progress()
        self._deferred: Request | None = None
        self._micro_seconds = 0.0  # recent micro-batch time, for deadline decisions
        n_params = sum(p.numel() for p in self.model.parameters())
        log.info("trainer ready", job=spec.name, params=n_params, attention=kernel,
                 loss=resolve_loss_name(spec.loss, spec.model), resumed_at=self.progress.step,
                 precision="bf16" if self.bf16 else "fp32", corpus_tokens=len(tokens), **self.backend.describe())

    @property
    def step(self) -> int:
        return self.progress.step

    # --- the work ---

    def micro_batch(self) -> None:
        """Forward and backward of the next micro-batch of the current step."""
        p = self.progress
        accum = self.loader.accum.at(p.step)
        started = time.monotonic()
        batch = self.backend.to_device(self.loader.batch(p.step, p.micro_step))
        last = p.micro_step == accum - 1
        with self.backend.no_sync(self.module) if not last else contextlib.nullcontext():
            with self.backend.autocast(self.bf16):
                loss = self.module(batch[:, :-1], batch[:, 1:])
            (loss / accum).backward()
        p.loss_sum = loss.detach() if p.loss_sum is None else p.loss_sum + loss.detach()
        self.backend.micro_step_end()
        p.micro_step += 1
        p.tokens_seen += batch.shape[0] * (batch.shape[1] - 1) * self.backend.data.world
        self._micro_seconds = time.monotonic() - started

    def optimizer_step(self) -> StepResult:
        p, train = self.progress, self.spec.train
        factor = lr_factor(self.spec.scheduler, p.step, train.max_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = group["base_lr"] * factor
        # max_norm=inf still returns the norm, which is worth logging when clipping is off.
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), train.grad_clip or float("inf"))
        # Stacked inside the step's graph, so reading them later is one plain copy.
        values = torch.stack([p.loss_sum / p.micro_step, grad_norm.to(p.loss_sum.dtype)])
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.backend.step_end()
        p.step, p.micro_step, p.loss_sum = p.step + 1, 0, None
        return StepResult(p.step, values, self.optimizer.param_groups[0]["lr"])

    def train_step(self) -> StepResult:
        """The rest of the current step: its remaining micro-batches, then the update."""
        while self.progress.micro_step < self.loader.accum.at(self.progress.step):
            self.micro_batch()
        return self.optimizer_step()

    # --- requests and checkpoints ---

    def _request(self) -> Request | None:
        """The request to act on at this boundary, agreed by every rank; others wait."""
        p = self.progress
        request = self._deferred = merge(self._deferred, self.hooks.poll(Boundary(p.step, p.micro_step)))
        now = None
        if request is not None:
            remaining = (self.loader.accum.at(p.step) - p.micro_step) * self._micro_seconds
            # Mid-step, act only if the step would not finish within the deadline.
            if p.micro_step == 0 or (request.deadline_s is not None and remaining >= request.deadline_s):
                now = request
        now = self.backend.agree(now)
        if now is not None:
            self._deferred = None
        return now

    def _act(self, request: Request) -> int | None:
        """Carry out a request; an exit code when the worker must stop."""
        if request.action is Action.STOP:
            log.info("stopping on request", step=self.step)
            return exit_codes.STOPPED
        exiting = request.action is Action.CHECKPOINT_AND_EXIT
        self.checkpointer.save(self.progress, "request", wait=exiting)
        if exiting:
            log.info("checkpointed, stopping on request", step=self.step, micro_step=self.progress.micro_step)
            return exit_codes.STOPPED
        return None

    def _interval_due(self) -> bool:
        cfg = self.spec.checkpoint
        by_steps = cfg.interval_steps and self.step % cfg.interval_steps == 0
        by_time = cfg.interval_seconds and time.monotonic() - self.checkpointer.last_save_time >= cfg.interval_seconds
        return bool(by_steps or by_time)

    # --- reporting ---

    def _report(self, pending: list[StepResult], seconds: float) -> None:
        """Emit and log the steps in `pending` once their values reach the host."""
        # Steps pending[0].step - 1 .. pending[-1].step - 1, whose micro-batch counts may differ (batch_ramp).
        tokens = self.loader.tokens_in_steps(pending[0].step - 1, pending[-1].step) * self.backend.data.world
        tokens_per_s = tokens / seconds
        peak = self.backend.peak_flops()
        perf = {
            "tokens_per_s": round(tokens_per_s, 1),
            "step_time_s": round(seconds / len(pending), 4),
            # MFU = achieved model FLOP/s / (peak FLOP/s per device x devices), FLOPs per PaLM.
            "mfu": round(tokens_per_s * self.flops_per_token / (peak * self.backend.num_devices), 4) if peak else None,
            "rss_bytes": host_rss_bytes(),
            "device_memory_bytes": self.backend.memory_bytes(),
        }

        def publish(rows: list[list[float]]) -> None:
            for result, row in zip(pending, rows):
                scalars = dict(zip(StepResult.NAMES, row), lr=result.lr)
                self.hooks.emit("step", step=result.step, **scalars, **perf)
            log.info("step", step=pending[-1].step, max_steps=self.spec.train.max_steps,
                     **{k: round(v, 5) for k, v in scalars.items()}, **{k: v for k, v in perf.items() if v is not None})

        self.backend.read_values([result.values for result in pending], publish)

    # --- the loop ---

    def run(self) -> int:
        train = self.spec.train
        self.hooks.emit("started", step=self.step, micro_step=self.progress.micro_step)
        pending: list[StepResult] = []
        interval_start = time.monotonic()
        try:
            while self.step < train.max_steps:
                request = self._request()
                if request is not None and (code := self._act(request)) is not None:
                    return code
                self.micro_batch()
                if self.progress.micro_step < self.loader.accum.at(self.step):
                    continue
                pending.append(self.optimizer_step())
                if self.step % train.log_interval == 0 or self.step == train.max_steps:
                    self._report(pending, time.monotonic() - interval_start)
                    pending, interval_start = [], time.monotonic()
                if self.step < train.max_steps and self._interval_due():
                    self.checkpointer.save(self.progress, "interval")
            self.checkpointer.save(self.progress, "final", wait=True)
        finally:
            self.backend.flush()
            self.checkpointer.close()
        log.info("training finished", step=self.step)
        self.hooks.emit("finished", step=self.step)
        return exit_codes.OK


def spec_hash(spec: JobSpec) -> str:
    return hashlib.sha256(spec.model_dump_json(by_alias=True).encode()).hexdigest()[:16]


def default_state_dir() -> Path:
    return Path(os.environ.get("TPUD_STATE_DIR", "state"))


def main(argv: list[str] | None = None, hooks: Hooks | None = None) -> int:
    from engine import logs
    from engine.specfile import SpecError, load_spec

    parser = argparse.ArgumentParser(
        prog="python -m engine.train", description="Train a job without the tpud supervisor (local only).")
    parser.add_argument("job", help="job YAML file")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. train.max_steps=50")
    parser.add_argument("--state-dir", type=Path, default=None,
                        help="where jobs/<name>/ and checkpoints/ live (default: $TPUD_STATE_DIR or ./state)")
    args = parser.parse_args(argv)
    logs.configure()
    try:
        spec = load_spec(args.job, args.overrides)
    except SpecError as e:
        log.error("invalid job spec", problems=str(e).splitlines())
        return exit_codes.BAD_INPUT
    logs.configure(spec.logging.level)
    return train(spec, args.state_dir or default_state_dir(), hooks or SignalHooks())


def train(spec: JobSpec, state_dir: Path, hooks: Hooks) -> int:
    """Train a validated spec to its end or a stop; the worker's exit code."""
    try:
        trainer = Trainer(spec, state_dir, hooks)
    except ConfigError as e:
        log.error("job cannot run here", key=e.key, error=str(e))
        return exit_codes.BAD_INPUT
    try:
        return trainer.run()
    finally:
        trainer.backend.close()


if __name__ == "__main__":
    sys.exit(main())
