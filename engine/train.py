"""The training loop, and `python -m engine.train JOB.yaml [key=value ...]`.

Decisions live in the components (backend, attention, loss, optimizer, schedule, data);
this file wires them together and runs steps. Each optimizer step runs
grad_accum_steps micro-batches; the supervisor's hooks are polled at every micro-batch
and step boundary. Metric tensors are read in batches every log_interval steps through
the backend, so the hot path never waits for the device.
"""

from __future__ import annotations

import argparse
import contextlib
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
from engine.hooks import Boundary, Hooks, Request
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
        self.step = 0
        self.flops_per_token = flops_per_token(spec.model, spec.data.seq_len)
        n_params = sum(p.numel() for p in self.model.parameters())
        log.info("trainer ready", job=spec.name, params=n_params, attention=kernel,
                 loss=resolve_loss_name(spec.loss, spec.model),
                 precision="bf16" if self.bf16 else "fp32", corpus_tokens=len(tokens), **self.backend.describe())

    def train_step(self) -> StepResult | None:
        """One optimizer step over this step's micro-batches (grad_accum_steps, fewer during a
        batch_ramp); None if stopped inside it."""
        train, step = self.spec.train, self.step
        accum = self.loader.accum.at(step)
        factor = lr_factor(self.spec.scheduler, step, train.max_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = group["base_lr"] * factor
        lr = self.optimizer.param_groups[0]["lr"]
        loss_sum = None
        for micro in range(accum):
            if micro and self._poll(micro) is Request.STOP:
                return None
            batch = self.backend.to_device(self.loader.batch(step, micro))
            last = micro == accum - 1
            with self.backend.no_sync(self.module) if not last else contextlib.nullcontext():
                with self.backend.autocast(self.bf16):
                    loss = self.module(batch[:, :-1], batch[:, 1:])
                (loss / accum).backward()
            loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
            self.backend.micro_step_end()
        # max_norm=inf still returns the norm, which is worth logging when clipping is off.
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), train.grad_clip or float("inf"))
        # Stacked inside the step's graph, so reading them later is one plain copy.
        values = torch.stack([loss_sum / accum, grad_norm.to(loss_sum.dtype)])
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.backend.step_end()
        self.step += 1
        return StepResult(self.step, values, lr)

    def _poll(self, micro: int) -> Request | None:
        request = self.hooks.poll(Boundary(self.step, micro))
        if request is not None and request is not Request.STOP:
            log.warning("request not supported by this worker, ignored", request=request.value)
            return None
        return request

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

    def run(self) -> int:
        train = self.spec.train
        self.hooks.emit("started", step=self.step)
        pending: list[StepResult] = []
        interval_start = time.monotonic()
        try:
            while self.step < train.max_steps:
                result = self.train_step() if self._poll(0) is not Request.STOP else None
                if result is None:
                    log.info("stopping on request", step=self.step)
                    return exit_codes.STOPPED
                pending.append(result)
                if self.step % train.log_interval == 0 or self.step == train.max_steps:
                    self._report(pending, time.monotonic() - interval_start)
                    pending, interval_start = [], time.monotonic()
        finally:
            self.backend.flush()
        log.info("training finished", step=self.step)
        self.hooks.emit("finished", step=self.step)
        return exit_codes.OK


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
    try:
        trainer = Trainer(spec, args.state_dir or default_state_dir(), hooks)
    except ConfigError as e:
        log.error("job cannot run here", key=e.key, error=str(e))
        return exit_codes.BAD_INPUT
    try:
        return trainer.run()
    finally:
        trainer.backend.close()


if __name__ == "__main__":
    sys.exit(main())
