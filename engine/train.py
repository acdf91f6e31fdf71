"""The training loop, and `python -m engine.train JOB.yaml [key=value ...]`.

Decisions live in the components (backend, attention, loss, optimizer, schedule, data,
checkpointer); this file wires them together and runs steps. Each optimizer step runs
its micro-batches (grad_accum_steps, fewer during a batch ramp); the hooks are polled at
every micro-batch and step boundary, and a checkpoint may be taken at either. Metric
tensors are read in batches every log_interval steps through the backend, so the hot
path never waits for the device.

A non-finite loss or gradient norm found in those values ends the run with exit 76 at the
next step boundary (health.nonfinite): with `rollback` the bad step's batches are recorded
as skipped first (<state>/jobs/<job>/data_skips.json), so the supervisor's restart from the
newest checkpoint trains past them. No checkpoint ever holds a non-finite step's update:
every save first waits for the values of the steps it would hold and checks them.

Every `step` event carries this process's badput so far (`Badput`): the time it spent
starting, restoring, blocked by checkpoints, and fetching data, which the supervisor's
goodput accounting cannot see from outside.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import math
import os
import resource
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch
from torch import nn

from engine import events, exit_codes
from engine.attention import build_attention
from engine.backends import build_backend
from engine.backoff import Backoff
from engine.spec.schema import JobSpec
from engine.data.corpus import stdlib_corpus
from engine.data.loader import AccumSchedule, PackedLoader, merge_skips, read_skips, write_skips
from engine.errors import ConfigError
from engine.checkpoint.checkpointer import Checkpointer, Progress
from engine.faults import Faults
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


@dataclass(frozen=True)
class NonFinite:
    step: int                # the first logged step whose loss or grad norm is not finite
    loss: float
    grad_norm: float | None  # None for a partial step (no norm yet)


@dataclass
class Badput:
    """Seconds this process has spent not training, by kind (events.Badput), since its Trainer began."""

    startup: float = 0.0
    restore: float = 0.0
    checkpoint: float = 0.0
    data: float = 0.0

    def snapshot(self) -> events.Badput:
        return events.Badput(**{kind: round(seconds, 3) for kind, seconds in vars(self).items()})


SKIPS_FILE = "data_skips.json"
FINAL_RETRY = Backoff(initial=1.0, maximum=10.0)  # a final checkpoint that failed (a full disk, say)


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
        began = time.monotonic()
        self.spec, self.hooks = spec, hooks or Hooks()
        self.job_dir = Path(state_dir) / "jobs" / spec.name
        self.badput = Badput()
        self.backend = build_backend(spec.device, cache_dir=str(self.job_dir / "xla_cache"))
        kernel, attention = build_attention(spec.attention, self.backend)
        # Initialise on the host from the seed: every backend then starts from the same weights.
        torch.manual_seed(spec.train.seed)
        self.model = Transformer(spec.model, attention, self.backend.checkpoint_fn)
        # Before the model is wrapped (DDP's constructor is collective): every rank sharing this
        # state directory (torchrun on one host) reads the fault markers before any can fire one.
        inject = spec.debug.inject
        self.faults = Faults(inject, self.job_dir, AccumSchedule.of(spec.train)) if inject is not None else None
        self.module = self.backend.prepare_model(LanguageModel(self.model, build_loss(spec.loss, spec.model)))
        self.optimizer = build_optimizer(spec.optimizer, self.model, self.backend.device)
        tokens = stdlib_corpus(spec.data.corpus_bytes)
        if int(tokens.max()) >= spec.model.vocab_size:
            raise ConfigError("model.vocab_size", f"{spec.model.vocab_size} is below the corpus's largest token id")
        self.skips_path = self.job_dir / SKIPS_FILE
        self.loader = PackedLoader(tokens, spec.data.seq_len, spec.data.micro_batch_size,
                                   AccumSchedule.of(spec.train), spec.train.seed, self.backend.data,
                                   read_skips(self.skips_path))
        precision = spec.train.mixed_precision
        self.bf16 = precision == "bf16" or (precision == "auto" and self.backend.bf16)
        self.flops_per_token = flops_per_token(spec.model, spec.data.seq_len)
        self.checkpointer = Checkpointer(spec.checkpoint, spec.name, Path(state_dir) / "checkpoints", spec_hash(spec),
                                         self.backend, self.model, self.optimizer, self.loader.state_dict(),
                                         self.hooks.emit)
        restoring = time.monotonic()
        self.progress = self.checkpointer.restore() or Progress()
        self.badput.restore = time.monotonic() - restoring
        if self.checkpointer.restored is not None:
            # A checkpoint made on another host carries skips that this host's state file lacks.
            self.loader.skips = merge_skips(self.loader.skips, self.checkpointer.restored.data_skips)
        self.checkpointer.data_skips = self.loader.skips
        self._deferred: Request | None = None
        self._micro_seconds = 0.0  # recent micro-batch time, for deadline decisions
        self.pending: list[StepResult] = []  # finished steps whose values are not read yet
        self._interval_start = time.monotonic()
        self._train_thread = threading.get_ident()
        # Non-finite values found by a read: acted on at once when the read ran on the training
        # thread (every rank reads synchronously there); when it ran on a reader thread (XLA),
        # only after the next flush, so that every host acts at the same boundary.
        self._nonfinite: NonFinite | None = None
        self._nonfinite_unflushed: NonFinite | None = None
        self._partial_checked = True  # a restored partial step was checked before it was saved
        n_params = sum(p.numel() for p in self.model.parameters())
        log.info("trainer ready", job=spec.name, params=n_params, attention=kernel,
                 loss=resolve_loss_name(spec.loss, spec.model), resumed_at=self.progress.step,
                 precision="bf16" if self.bf16 else "fp32", corpus_tokens=len(tokens),
                 data_skips=[list(s) for s in self.loader.skips], **self.backend.describe())
        self.badput.startup = time.monotonic() - began - self.badput.restore

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
        self.badput.data += time.monotonic() - started
        last = p.micro_step == accum - 1
        with self.backend.no_sync(self.module) if not last else contextlib.nullcontext():
            with self.backend.autocast(self.bf16):
                loss = self.module(batch[:, :-1], batch[:, 1:])
            if self.faults is not None and self.faults.poisons(self.loader.index(p.step, p.micro_step)):
                loss = loss * float("nan")  # NaN gradients too, and so NaN weights: a real blow-up
            (loss / accum).backward()
        p.loss_sum = loss.detach() if p.loss_sum is None else p.loss_sum + loss.detach()
        self._partial_checked = False
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
        if (code := self._save("request", wait=exiting)) is not None:
            return code
        if exiting:
            if self._committed_everywhere():
                log.info("checkpointed, stopping on request", step=self.step, micro_step=self.progress.micro_step)
            else:  # stopping was asked for; the newest committed checkpoint is untouched and resumes
                log.error("stopping on request without a checkpoint: it failed", step=self.step,
                          resumes_from=self.checkpointer.last_committed_step())
            return exit_codes.STOPPED
        return None

    def _committed_everywhere(self) -> bool:
        """Whether every rank committed the save just waited for (a rank may fail alone)."""
        failed = Request(Action.CHECKPOINT) if self.checkpointer.failures else None
        return self.backend.agree(failed) is None

    def _final_save(self) -> int:
        """The checkpoint at max_steps, retried until it commits: the trained state exists only in
        this process, so giving up would lose the whole run's work. Requests are still served
        (and heartbeats sent) while waiting: a stop ends the wait, exiting 75."""
        if (code := self._save("final", wait=True)) is not None:
            return code
        attempt = 0  # counted here, not by the checkpointer: every rank must wait (poll, agree) alike
        while not self._committed_everywhere():
            attempt += 1
            delay = FINAL_RETRY.delay(attempt)
            log.error("the final checkpoint failed; retrying", step=self.step, retry_in_s=delay,
                      failures=self.checkpointer.failures)
            for _ in range(round(delay / 0.2)):  # counted, not timed: every rank polls (agrees) alike
                request = self._request()
                if request is not None and request.action is not Action.CHECKPOINT:
                    return self._act(request)
                if request is not None:
                    break
                time.sleep(0.2)
            self._save("final", wait=True)
        return exit_codes.OK

    def _interval_due(self) -> bool:
        cfg = self.spec.checkpoint
        by_steps = cfg.interval_steps and self.step % cfg.interval_steps == 0
        by_time = cfg.interval_seconds and time.monotonic() - self.checkpointer.last_save_time >= cfg.interval_seconds
        if cfg.interval_seconds and not by_steps:
            # Each rank reads its own clock: they agree, or one rank alone would enter the save's collectives.
            by_time = self.backend.agree(Request(Action.CHECKPOINT) if by_time else None) is not None
        return bool(by_steps or by_time)

    def _save(self, reason: str, *, wait: bool = False) -> int | None:
        """Checkpoint, unless the state holds a non-finite step: then the exit code instead."""
        started = time.monotonic()
        finite = self._state_is_finite()
        if finite:
            self.checkpointer.save(self.progress, reason, wait=wait)
        self.badput.checkpoint += time.monotonic() - started
        return None if finite else self._nonfinite_exit()

    def _state_is_finite(self) -> bool:
        """Read and check the values of every step the checkpoint would hold, waiting for them.

        A checkpoint taken after a non-finite step would hold its update, and a rollback to it
        would only fail again; so no save starts before the steps it covers are known finite.
        """
        self._report_pending()
        p = self.progress
        if p.micro_step and not self._partial_checked:
            # Inside accumulation: a poisoned micro-batch is in the partial gradient already.
            def check(rows: list) -> None:
                if not math.isfinite(rows[0]):
                    self._found(NonFinite(p.step + 1, rows[0], None))

            self.backend.read_values([p.loss_sum], check)
        self._flush_reads()
        self._partial_checked = True
        return self._nonfinite is None

    # --- reporting ---

    def _report_pending(self) -> None:
        """Report the steps done since the last report: every log_interval steps, and before a save."""
        pending, self.pending = self.pending, []
        if pending:
            now = time.monotonic()
            seconds, self._interval_start = now - self._interval_start, now
            self._report(pending, seconds)

    def _report(self, pending: list[StepResult], seconds: float) -> None:
        """Emit and log the steps in `pending` once their values reach the host, checking them."""
        # The previous interval's values first: the device finished those steps long ago, and
        # from here on every host has seen the same values (see _nonfinite).
        self._flush_reads()
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
        badput = self.badput.snapshot()

        def publish(rows: list[list[float]]) -> None:
            scalars = None
            for result, row in zip(pending, rows):
                if self._nonfinite is not None or self._nonfinite_unflushed is not None:
                    break  # this step and every later one trained on non-finite weights
                if not all(math.isfinite(v) for v in row):
                    self._found(NonFinite(result.step, *row))
                    break
                scalars = dict(zip(StepResult.NAMES, row), lr=result.lr)
                self.hooks.emit(events.Step(step=result.step, **scalars, **perf, badput=badput))
                logged = result.step
            if scalars is not None:
                log.info("step", step=logged, max_steps=self.spec.train.max_steps,
                         **{k: round(v, 5) for k, v in scalars.items()},
                         **{k: v for k, v in perf.items() if v is not None})

        self.backend.read_values([result.values for result in pending], publish)

    def _found(self, bad: NonFinite) -> None:
        """A read found non-finite values (on the training thread or the backend's reader)."""
        if threading.get_ident() == self._train_thread:
            self._nonfinite = self._nonfinite or bad
        else:
            self._nonfinite_unflushed = self._nonfinite_unflushed or bad

    def _flush_reads(self) -> None:
        """Wait for every value read in flight; what they found is then acted on."""
        self.backend.flush()
        self._nonfinite = self._nonfinite or self._nonfinite_unflushed

    def _nonfinite_exit(self) -> int:
        """Exit 76 without a checkpoint; for a rollback, skip the bad step's batches from now on."""
        bad, policy = self._nonfinite, self.spec.health.nonfinite
        skip = None
        if policy == "rollback":
            # The restarted worker resumes from a checkpoint before the bad step (saves check first)
            # and reads past these micro-batches; persisted before exiting, or it would meet them again.
            skip = self.loader.skip_range(bad.step - 1)
            self.loader.skips = merge_skips(self.loader.skips, [skip])
            write_skips(self.skips_path, self.loader.skips)
        event = events.NonFinite(bad.step, bad.loss, bad.grad_norm, policy, skip)
        log.error(event.TYPE, **dataclasses.asdict(event))  # named like the event, as the checkpointer logs its events
        self.hooks.emit(event)
        return exit_codes.NONFINITE_LOSS

    # --- the loop ---

    def run(self) -> int:
        train = self.spec.train
        self.hooks.emit(events.Started(self.step, self.progress.micro_step, self.badput.snapshot()))
        began = self._interval_start = time.monotonic()
        counted = self.badput.data + self.badput.checkpoint
        first_step = True
        try:
            if self.faults is not None and (self.step, self.progress.micro_step) == (0, 0):
                self.faults.at_step_boundary(0)
            while self.step < train.max_steps:
                request = self._request()
                if request is not None and (code := self._act(request)) is not None:
                    return code
                self.micro_batch()
                if self.progress.micro_step < self.loader.accum.at(self.step):
                    continue
                self.pending.append(self.optimizer_step())
                if first_step:  # startup: under XLA the first step compiles; its data and saves count apart
                    b = self.badput
                    b.startup += max(0.0, time.monotonic() - began - (b.data + b.checkpoint - counted))
                    first_step = False
                if self.step % train.log_interval == 0 or self.step == train.max_steps:
                    self._report_pending()
                if self._nonfinite is not None:
                    return self._nonfinite_exit()
                if self.faults is not None:
                    self.faults.at_step_boundary(self.step)
                if self.step < train.max_steps and self._interval_due():
                    if (code := self._save("interval")) is not None:
                        return code
            if (code := self._final_save()) != exit_codes.OK:
                return code
        finally:
            self.backend.flush()
            self.checkpointer.close()
        log.info("training finished", step=self.step)
        return exit_codes.OK


def spec_hash(spec: JobSpec) -> str:
    return hashlib.sha256(spec.model_dump_json(by_alias=True).encode()).hexdigest()[:16]


def default_state_dir() -> Path:
    return Path(os.environ.get("TPUD_STATE_DIR", "state"))


def main(argv: list[str] | None = None, hooks: Hooks | None = None) -> int:
    from engine import logs
    from engine.spec.loader import SpecError, load_spec

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
