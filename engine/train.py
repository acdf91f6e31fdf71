"""The training loop, and `python -m engine.train JOB.yaml [key=value ...]`.

Decisions live in the components (backend, attention, loss, optimizer, schedule, data,
checkpointer); this file wires them together and runs steps. Each optimizer step runs
its micro-batches (grad_accum_steps, fewer during a batch ramp); the hooks are polled at
every micro-batch and step boundary, and a checkpoint may be taken at either. Metric
tensors are read in batches every log_interval steps through the backend (engine.report),
so the hot path never waits for the device.

A bad step found in those values (a non-finite loss or gradient norm, a loss spike) is rolled
back in place at the next step boundary, its batches skipped (engine.health), and no checkpoint
ever holds a bad step's update. Every `step` event carries this process's badput so far
(engine.badput): the time it spent starting, restoring, blocked by checkpoints, and
fetching data, which the supervisor's goodput accounting cannot see from outside.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from itertools import chain
from pathlib import Path

import structlog
import torch
from torch import nn
from torch.profiler import record_function

from engine import events, exit_codes
from engine.attention import build_attention, build_mask
from engine.backends import build_backend
from engine.backoff import Backoff
from engine.badput import Badput
from engine.spec.fingerprint import check_resume, fingerprint
from engine.spec.schema import HiddenDistillConfig, JobSpec
from engine.data.dataset import open_data
from engine.data.loader import PackedLoader, batch_geometry
from engine.data.skips import Skips, merge_skips, regeometry
from engine.data.prefetch import Prefetcher
from engine.errors import ConfigError, WorkerExit
from engine.checkpoint.checkpointer import Checkpointer, Progress
from engine.checkpoint.hosts import Hosts
from engine.evaluation import Evaluator
from engine.fitting import MicroBatchFit, memory_now
from engine.health.faults import Faults, NoFaults, limit_address_space
from engine.health.guard import StepGuard
from engine.health.healing import Healer
from engine.health.ledger import SkipLedger
from engine.health.replicas import ReplicaCheck
from engine.health.stragglers import StragglerWatch
from engine.layout import StateLayout
from engine.hooks import Boundary, Hooks, SignalHooks
from engine.requests import Action, Request, merge
from engine.distill import hidden as distill_hidden
from engine.distill.hidden import ATTRIBUTE as PROJECTIONS, HIDDEN, hidden_loss
from engine.distill.teacher import IDENTITY, Teacher
from engine.losses import DistillFn, LossFn, build_distill_loss, build_loss, resolve_loss_name
from engine.losses.distill import TERMS
from engine.checkpoint.manifest import parts
from engine.hf.local import local_model
from engine.hf.weights import hf_values
from engine.models.llama import Transformer, flops_per_token, initial_values
from engine.models.moe import STATS, require_static_capacity, router_terms
from engine.optim import build_optimizer
from engine.optim.schedule import lr_factor
from engine.report import Reporter, StepResult
from engine.resume import Warm, check_same_data, check_same_teacher, take_live_state
from engine.runtime import Runtime

log = structlog.get_logger()

FINAL_RETRY = Backoff(initial=1.0, maximum=10.0)  # a final checkpoint that failed (a full disk, say)


class LanguageModel(nn.Module):
    """The model plus its loss, so one forward call (and one DDP/SPMD wrapper) covers both. With a
    distillation teacher (engine.distill), the teacher too: frozen, in eval mode, wrapped and sharded
    with the student, and its loss is distill_fn's while gradients are taken (an evaluation's loss
    stays the language model's cross-entropy, comparable with a run without a teacher)."""

    def __init__(self, model: Transformer, loss_fn: LossFn, teacher: Transformer | None = None,
                 distill_fn: DistillFn | None = None, hidden: HiddenDistillConfig | None = None):
        super().__init__()
        self.model, self.loss_fn = model, loss_fn
        self.teacher, self.distill_fn, self.hidden = teacher, distill_fn, hidden

    def train(self, mode: bool = True) -> LanguageModel:
        super().train(mode)
        if self.teacher is not None:
            self.teacher.eval()
        return self

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor, segments: torch.Tensor | None = None,
                positions: torch.Tensor | None = None, teacher_ids: torch.Tensor | None = None,
                teacher_logp: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the mean loss over the targets not ignored (engine.data.batch), the extras): while
        gradients are taken, [a loss to add, *statistics to report] with experts (their weighted
        loss, then STATS: engine.models.moe) or a teacher (then its TERMS: engine.losses.distill, and
        with distill.hidden its HIDDEN: engine.distill.hidden), else None (an evaluation's loss is the
        language model's alone). teacher_ids, teacher_logp: an offline teacher's top k from the batch
        (engine.distill.offline), in place of a teacher model."""
        moe = self.model.cfg.moe
        distilling = self.distill_fn is not None and torch.is_grad_enabled()
        pairs = self.hidden.layers if distilling and self.hidden is not None else ()
        hidden, routing, taps = self.model.features(inputs, segments, positions, [s for s, _ in pairs])
        extras = None
        if moe is not None and torch.is_grad_enabled():
            loss, stats = router_terms(routing, moe)
            extras = torch.cat([loss.reshape(1), stats])
        device = hidden.device.type
        if torch.is_autocast_enabled(device):
            # The residual stream is fp32 even under autocast; the head's matmuls should not be.
            hidden = hidden.to(torch.get_autocast_dtype(device))
        if not distilling:
            with record_function("tpud.loss"):
                loss = self.loss_fn(hidden.flatten(0, 1), self.model.output_weight, targets.flatten())
            return loss, extras
        if self.teacher is not None:
            with torch.no_grad(), record_function("tpud.teacher"):
                teacher_hidden, _, teacher_taps = self.teacher.features(inputs, segments, positions,
                                                                        [t for _, t in pairs])
            teacher = teacher_hidden.flatten(0, 1).to(hidden.dtype), self.teacher.output_weight
        else:
            teacher = teacher_ids.flatten(0, 1), teacher_logp.flatten(0, 1)
        with record_function("tpud.loss"):
            loss, terms = self.distill_fn(hidden.flatten(0, 1), self.model.output_weight, targets.flatten(),
                                          *teacher)
            extras = torch.cat([loss.new_zeros(1) if extras is None else extras, terms])
            if pairs:
                mse = hidden_loss(taps, teacher_taps, getattr(self.model, PROJECTIONS, None), targets)
                extras = torch.cat([extras[:1] + self.hidden.weight * mse, extras[1:], mse.reshape(1)])
        return loss, extras


class Trainer:
    def __init__(self, spec: JobSpec, state_dir: Path, hooks: Hooks | None = None, hosts: Hosts | None = None,
                 warm: Warm | None = None, runtime: Runtime = Runtime()):
        """runtime: what the supervisor told this worker (engine.runtime); by default none, as alone."""
        self.badput = Badput()  # startup counts from here
        self.spec, self.hooks, self.runtime = spec, hooks or Hooks(), runtime
        layout = StateLayout(Path(state_dir))
        self.job_dir = layout.job_dir(spec.name)
        self.backend = build_backend(spec.device, xla_cache=str(layout.xla_cache(spec.name)),
                                     inductor_cache=str(layout.inductor_cache(spec.name)), gang=hosts is not None)
        require_static_capacity(spec.model.moe, self.backend.name)
        checkpoints = layout.checkpoints(spec.name, spec.checkpoint.dir)
        if (inject := spec.debug.inject) is not None and inject.address_space_mib is not None:
            limit_address_space(inject.address_space_mib)
        micro_batch_size, accum = self._fitted_geometry()
        kernel, source = self._build_model(layout, checkpoints, micro_batch_size, accum, warm)
        data = self._open_data(layout, source, micro_batch_size, accum)
        if self.teacher is not None:
            self.teacher.check_tokenizer(data.tokenizer)
        # What each checkpoint records of the teacher: a model's weights, or the data's stored top k.
        self.teacher_identity = self.teacher.identity if self.teacher is not None else data.teacher
        self.checkpointer = Checkpointer(spec.checkpoint, spec.name, checkpoints, self._fingerprint(),
                                         self.backend, self.model, self.optimizer, self.loader.state_dict(),
                                         self.hooks.emit, hosts, memory_dir=runtime.memory_dir,
                                         disruptions_per_hour=runtime.disruptions_per_hour,
                                         wandb_run_id=runtime.wandb_run_id)
        with self.badput.timing("restore"):
            self._restore(hosts, warm)
        self._watch_health()
        self.reporter = Reporter(spec.train, self.backend, self.loader, flops_per_token(spec.model, spec.data.seq_len),
                                 self.guard, self.badput, self.hooks.emit,
                                 stats=(STATS if spec.model.moe is not None else ()) + (TERMS if spec.distill else ())
                                 + (HIDDEN if spec.distill and spec.distill.hidden else ()),
                                 intervals=self.checkpointer.intervals,
                                 interval_s=self.checkpointer.schedule.local_interval_s)
        self._deferred: Request | None = None
        self.hooks.on_request(self._between_boundaries)
        self._micro_seconds = 0.0  # recent micro-batch time, for deadline decisions
        n_params = sum(p.numel() for p in self.model.parameters())
        log.info("trainer ready", job=spec.name, params=n_params, attention=kernel,
                 loss=self.loss_name, resumed_at=self.progress.step, micro_batch_size=self.loader.micro_batch_size,
                 grad_accum_steps=self.loader.accum.final,
                 precision="bf16" if self.bf16 else "fp32", **data.description,
                 data_skips=[list(s) for s in self.loader.skips], **self.backend.describe())
        self.badput.startup_ends()

    def _fitted_geometry(self):
        """The micro-batch and micro-batches per step: the job's, made smaller where a larger one was
        found not to fit (engine.fitting); every rank runs the smallest any of them recorded."""
        spec, world = self.spec, self.backend.data.world
        self.fit = MicroBatchFit(self.job_dir, spec.data.micro_batch_size, spec.train.fit_micro_batch)
        micro, _ = batch_geometry(spec.train, spec.data.micro_batch_size, world)
        agreed = self.backend.smallest(min(micro, self.fit.cap or micro))
        if agreed < micro:
            self.fit.agreed(agreed)
        return batch_geometry(spec.train, spec.data.micro_batch_size, world, agreed)

    def _build_model(self, layout: StateLayout, checkpoints: Path, micro_batch_size: int, accum,
                     warm: Warm | None) -> tuple[str, str | None]:
        """The model (kept, or built and given its weights), its loss, wrapper and optimizer; (the
        attention kernel, the init_from directory when this start takes its weights)."""
        spec = self.spec
        kernel, attention = build_attention(spec.attention, self.backend, spec.data.document_mask)
        torch.manual_seed(spec.train.seed)
        source = None
        online = spec.distill is not None and not spec.distill.offline
        self.teacher = Teacher(spec.distill, layout.models(), spec.data.seq_len) if online else None
        if warm is not None:
            self.model, weights, teacher = warm.model, None, warm.teacher
        else:
            teacher = None if self.teacher is None else self.teacher.build(attention, build_mask(kernel))
            # Built on the meta device, then given its weights one tensor at a time in their final
            # placement: made on the host from the seed, so every backend starts from the same weights.
            with torch.device("meta"):
                self.model = Transformer(spec.model, attention, self.backend.checkpoint_fn, build_mask(kernel))
                if teacher is not None and spec.distill.hidden is not None:
                    distill_hidden.attach(self.model, spec.distill.hidden, teacher.cfg)
            generator = torch.Generator().manual_seed(spec.train.seed)
            if spec.model.init_from is not None and not parts(checkpoints):  # parts: committed or not
                source = spec.model.init_from  # a resume takes the job's own checkpoint instead
                source = local_model(source, layout.models(), "model.init_from")
                weights = chain(hf_values(self.model, source, skip=PROJECTIONS),
                                distill_hidden.initial_values(self.model, generator))
            else:
                weights = initial_values(self.model, generator)
        self.teacher_model = teacher
        # What one device holds of a micro-batch decides the loss (XLA: one process drives several).
        per_device = max(1, micro_batch_size * spec.data.seq_len * self.backend.data.world // self.backend.num_devices)
        self.capacity = capacity = self.backend.memory_capacity()  # collective: read once, by every rank
        self.loss_name = (f"distill:{'offline' if spec.distill.offline else spec.distill.loss}" if spec.distill
                          else resolve_loss_name(spec.loss, spec.model, per_device, capacity))
        language_model = LanguageModel(self.model, build_loss(spec.loss, spec.model, per_device, self.backend.compile,
                                                              capacity),
                                       teacher, build_distill_loss(spec.distill, self.backend.compile) if spec.distill else None,
                                       spec.distill.hidden if spec.distill else None)
        if warm is None:
            for block in [*self.model.layers, *(teacher.layers if teacher is not None else ())]:
                self.backend.compile(block)
            self.backend.shard(language_model)
            self.backend.materialise(self.model, weights)
            if teacher is not None:
                self.backend.materialise(teacher, self.teacher.values(teacher))
        # Before the model is wrapped (DDP's constructor is collective): every rank sharing this
        # state directory (torchrun on one host) reads the fault markers before any can fire one.
        inject = spec.debug.inject
        self.faults = Faults(inject, self.job_dir, accum, self.runtime.gang_host) if inject is not None else NoFaults()
        self.module = self.backend.prepare_model(language_model)
        if warm is not None:
            self.optimizer = warm.optimizer
            self.optimizer.zero_grad(set_to_none=True)  # a step in flight is redone
        else:
            self.optimizer = build_optimizer(spec.optimizer, self.model, self.backend.device)
        return kernel, source

    def _fingerprint(self) -> dict:
        """What each checkpoint records of the spec: the spec's fingerprint, and the teacher's identity."""
        values = fingerprint(self.spec)
        if self.teacher_identity is not None:
            values[IDENTITY] = self.teacher_identity
        return values

    def _open_data(self, layout: StateLayout, source: str | None, micro_batch_size: int, accum):
        """The training batches (loader, prefetcher, skip ledger) and the evaluator: the opened data."""
        spec = self.spec
        offline = spec.distill is not None and spec.distill.offline
        data = open_data(spec.data, spec.train.seed, layout.datasets(), spec.model.vocab_size, source,
                         validation=spec.eval is not None, offline_teacher=spec.distill.temperature if offline else None)
        self.ledger = SkipLedger(layout.skips_file(spec.name), micro_batch_size * self.backend.data.world,
                                 spec.data.skip)
        self.loader = PackedLoader(data.train, micro_batch_size, accum,
                                   spec.train.seed, self.backend.data, self.ledger.ranges, data.identity,
                                   spec.data.document_mask, self.backend.global_loss, offline)
        self.batches = Prefetcher(self.loader, self.backend.host_ready)
        precision = spec.train.mixed_precision
        self.bf16 = precision == "bf16" or (precision == "auto" and self.backend.bf16)
        configured = spec.data.micro_batch_size
        self.evaluator = None if spec.eval is None else Evaluator(
            spec.eval, data.val, micro_batch_size, self.backend, self.module, self.bf16, self.badput,
            self.hooks.emit, spec.data.document_mask,
            n_batches=None if configured == "auto" else -(-spec.eval.batches * configured // micro_batch_size))
        return data

    def _restore(self, hosts: Hosts | None, warm: Warm | None) -> None:
        """Where training goes on from: a live gang's state (kept, or sent by a peer), else the newest
        checkpoint (checked against this spec and data), else step 0."""
        if hosts is not None and hosts.source is not None:  # a live gang: its state, not a checkpoint
            self.progress = Progress(warm.progress.step, 0, warm.progress.tokens_seen) if warm else Progress()
            if warm is not None:
                self._add_skips(warm.skips_for(self.ledger.per_micro_batch))
            if hosts.transfer:
                try:
                    rank = self.backend.data.rank
                    self.progress, theirs = take_live_state(rank, hosts.source, self.model, self.optimizer,
                                                            self.progress, self.loader.skips)
                except BaseException:  # the gang changed again: the next trainer wraps this model anew
                    self.backend.release(self.module)
                    raise
                if rank != hosts.source:
                    self._add_skips(theirs)
            self.checkpointer.schedule.restored(self.progress.step)
        else:
            self.progress = self.checkpointer.restore() or Progress()
        if (restored := self.checkpointer.restored) is not None:
            allowed = self.spec.checkpoint.allow_spec_changes
            if hosts is not None or restored.hosts > 1:  # a gang's commit, or a gang resuming
                check_resume(restored.fingerprint, self.checkpointer.fingerprint, allowed, restored.step)
            else:
                where = self.teacher.source.path if self.teacher is not None else "the data's offline teacher"
                check_same_teacher((restored.fingerprint or {}).get(IDENTITY), self.teacher_identity, restored.step,
                                   allowed, where)
            saved = self.checkpointer.restored_loader
            check_same_data(saved.get("data", "stdlib"), self.loader.identity, self.spec.data, self.step)
            # A checkpoint made on another host carries skips that this host's state file lacks, in
            # micro-batches of the geometry it was saved with.
            per = self.ledger.per_micro_batch
            saved_per = saved.get("micro_batch_size", 0) * saved.get("world", 0) or per
            self._add_skips(regeometry(restored.data_skips, saved_per, per))
        self.checkpointer.data_skips = self.loader.skips

    def _add_skips(self, skips: Skips) -> None:
        """Skips another state carried (a checkpoint, a peer's, a kept one) in this loader's micro-batches."""
        self.ledger.adopt(skips)
        self.loader.skips = merge_skips(self.loader.skips, skips)

    def _watch_health(self) -> None:
        """The bad-step guard, the replicas' check, the healer and the straggler watch."""
        spec = self.spec
        self.guard = StepGuard(spec.health, self.backend, self.loader, self.ledger, self.hooks.emit, self.progress)
        self.replicas = ReplicaCheck(spec.health.replicas, self.backend, self.model, self.optimizer, self.job_dir)
        self.replicas.restored(self.progress)
        self.replicas.agreed = self.progress.step  # restored states were compared before their commit
        self.healer = Healer(spec.health, self.guard, self.ledger, self.loader, self.checkpointer, self.badput,
                             self.hooks.emit, self.replicas)
        self.stragglers = StragglerWatch(spec.health.stragglers, self.backend, self.hooks.emit,
                                         self.runtime.evict_stragglers)

    @property
    def step(self) -> int:
        return self.progress.step

    def warm(self) -> Warm:
        """What a gang that changes in place keeps of this trainer, which lets go of what it hung on
        the model (its wrapper's gradient hooks, the replicas' forward hook): the next one hangs its own."""
        self.backend.release(self.module)
        self.replicas.close()
        p = self.progress  # the step in flight is redone: its micro-batches' tokens are not seen yet
        unseen = p.micro_step * self.loader.micro_batch_size * self.spec.data.seq_len * self.backend.data.world
        return Warm(self.model, self.optimizer, Progress(p.step, 0, p.tokens_seen - unseen), list(self.loader.skips),
                    self.ledger.per_micro_batch, self.teacher_model)

    # --- the loop ---

    def run(self) -> int:
        """Train to max_steps, or until a request, a bad step that cannot be healed or a fault ends
        it: the exit code (each of those raises WorkerExit where it is decided)."""
        p, max_steps = self.progress, self.spec.train.max_steps
        self._started_at = p.step
        self.hooks.emit(events.Started(p.step, p.micro_step, self.badput.snapshot()))
        self.badput.startup_begins()  # until the first step is done: under XLA it compiles
        self.reporter.start()
        try:
            if (p.step, p.micro_step) == (0, 0):
                self.faults.at_step_boundary(0)
            while True:  # once more when the final save finds the last steps bad and rolls them back
                while p.step < max_steps:
                    if (request := self._request()) is not None:
                        self._act(request)
                    self.micro_batch()
                    if p.micro_step < self.loader.accum.at(p.step):
                        continue
                    result = self.optimizer_step()
                    self.replicas.record(result.step, result.values)
                    self.reporter.record(result)
                    self._judge_stragglers()
                    if self.guard.found is not None:
                        self.healer.heal(self)
                        continue
                    self.faults.at_step_boundary(p.step, self.model, self.backend.data.rank)
                    if self.replicas.due(p.step):
                        self._compare_replicas()
                    if self.evaluator is not None and self.evaluator.due(p.step, max_steps):
                        self.evaluator.run(p.step)
                    self._save_if_due()
                if self.evaluator is not None and self.evaluator.last_step != p.step:
                    self.evaluator.run(p.step)
                self._final_save()
        except WorkerExit as e:
            return e.code
        except Exception as e:
            if not self.fit.applies(e, p.step, self._started_at):
                raise
            return self._refit(e)
        finally:
            self.batches.close()
            self.backend.flush()
            self.checkpointer.close()

    def _refit(self, error: Exception) -> int:
        """An out-of-memory error in the first steps: the next smaller micro-batch recorded, exit REFIT
        (engine.fitting); at one sequence, ConfigError naming the memory needed and available."""
        spec, micro = self.spec, self.loader.micro_batch_size
        # The sequences the micro-batch must divide: the per-rank batch, or the job's fixed micro-batch.
        batch = micro * self.loader.accum.final if spec.train.global_batch_size else spec.data.micro_batch_size
        memory = memory_now(self.backend.device_memory(), self.capacity)
        try:
            self.fit.refit(error, self.progress.step, micro, batch, memory)
        except ValueError as e:
            raise ConfigError("data.micro_batch_size", str(e)) from error
        log.warning("the micro-batch does not fit; the worker starts again with a smaller one",
                    micro_batch_size=micro, next=self.fit.cap, reason=self.fit.record.reason)
        return exit_codes.REFIT

    # --- the work ---

    def micro_batch(self) -> None:
        """Forward and backward of the next micro-batch of the current step."""
        p = self.progress
        accum = self.loader.accum.at(p.step)
        started = time.monotonic()
        # The phases are record_function scopes so `tpud profile` (engine.profiling) can tell them apart.
        with self.badput.timing("data"), record_function("tpud.data"):
            batch = self.batches.batch(p.step, p.micro_step).map(self.backend.to_device)
            # Device data, not a constant: under XLA every weight runs the same graph.
            weight = self.backend.to_device(torch.tensor(self.loader.loss_weight(p.step, p.micro_step)))
        last, rank = p.micro_step == accum - 1, self.backend.data.rank
        with self.backend.no_sync(self.module) if not last else contextlib.nullcontext():
            began = time.monotonic()
            with self.backend.autocast(self.bf16), record_function("tpud.forward"):
                # Weighted by its share of the step's targets (1.0 without masks): divided by the
                # micro-batch count below, the step's loss is that of one batch of all its targets.
                loss, extras = self.module(batch.inputs, batch.targets, batch.segments, batch.positions,
                                           batch.teacher_ids, batch.teacher_logp)
                loss = loss * weight
            self.faults.slow_down(p.step, rank, time.monotonic() - began)
            self.stragglers.forward_took(time.monotonic() - began)  # no collective waits inside (stragglers.py)
            factor = self.faults.poison(self.loader.index(p.step, p.micro_step)) * self.faults.glitch(p.step + 1, rank)
            if factor != 1.0:
                loss = loss * factor  # NaN: NaN gradients and weights, a real blow-up; else a spike
            began = time.monotonic()
            with record_function("tpud.backward"):
                ((loss if extras is None else loss + extras[0]) / accum).backward()
            self.faults.slow_down(p.step, rank, time.monotonic() - began)
        # With experts or a teacher, their statistics ride along: [loss, *STATS, *TERMS], summed like the loss.
        values = loss.detach() if extras is None else torch.cat([loss.detach().reshape(1), extras[1:].detach()])
        p.loss_sum = values if p.loss_sum is None else p.loss_sum + values
        if not last:  # the step's last micro-batch runs on into the optimizer step: one graph under XLA
            self.backend.micro_step_end()
        p.micro_step += 1
        p.tokens_seen += batch.inputs.numel() * self.backend.data.world
        self._micro_seconds = time.monotonic() - started

    @record_function("tpud.optimizer")
    def optimizer_step(self) -> StepResult:
        p, train = self.progress, self.spec.train
        factor = lr_factor(self.spec.scheduler, p.step, train.max_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = group["base_lr"] * factor
        # max_norm=inf still returns the norm, which is worth logging when clipping is off.
        self.faults.before_update(p.step + 1, self.model, self.backend.data.rank)
        grad_norm = self.backend.clip_grad_norm(self.model.parameters(), train.grad_clip or float("inf"))
        # Stacked inside the step's graph, so reading them later is one plain copy.
        mean = (p.loss_sum / p.micro_step).reshape(-1)  # the loss, then any statistics
        values = torch.cat([mean[:1], grad_norm.to(mean.dtype).reshape(1), mean[1:]])
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.replicas.step_done()
        self.backend.step_end()
        p.step, p.micro_step, p.loss_sum = p.step + 1, 0, None
        self.badput.startup_ends()  # the first step is startup's last part; a no-op after it
        return StepResult(p.step, values, self.optimizer.param_groups[0]["lr"], self.loader.step_targets(p.step - 1))

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

    def _act(self, request: Request) -> None:
        """Carry out a request; WorkerExit when the worker must stop."""
        if request.action is Action.STOP:
            log.info("stopping on request", step=self.step)
            raise WorkerExit(exit_codes.STOPPED)
        exiting = request.action is Action.CHECKPOINT_AND_EXIT
        self._save("request", wait=exiting)
        if exiting:
            if self._committed_everywhere():
                log.info("checkpointed, stopping on request", step=self.step, micro_step=self.progress.micro_step)
            else:  # stopping was asked for; the newest committed checkpoint is untouched and resumes
                log.error("stopping on request without a checkpoint: it failed", step=self.step,
                          resumes_from=self.checkpointer.last_committed_step())
            raise WorkerExit(exit_codes.STOPPED)

    def _committed_everywhere(self) -> bool:
        """Whether every rank committed the save just waited for (a rank may fail alone)."""
        failed = Request(Action.CHECKPOINT) if self.checkpointer.failures else None
        return self.backend.agree(failed) is None

    def _final_save(self) -> None:
        """The checkpoint at max_steps, retried until it commits: the trained state exists only in
        this process, so giving up would lose the whole run's work. Requests are still served
        (and heartbeats sent) while waiting: a stop ends the wait, exiting 75. Returns when the last
        steps were bad and rolled back: the loop trains on to max_steps; else WorkerExit(0)."""
        self._save("final", wait=True)
        if self.step < self.spec.train.max_steps:
            return
        attempt = 0  # counted here, not by the checkpointer: every rank must wait (poll, agree) alike
        while not self._committed_everywhere():
            attempt += 1
            delay = FINAL_RETRY.delay(attempt)
            log.error("the final checkpoint failed; retrying", step=self.step, retry_in_s=delay,
                      failures=self.checkpointer.failures)
            for _ in range(round(delay / 0.2)):  # counted, not timed: every rank polls (agrees) alike
                request = self._request()
                if request is not None and request.action is not Action.CHECKPOINT:
                    self._act(request)  # a stop: it raises
                if request is not None:
                    break
                time.sleep(0.2)
            self._save("final", wait=True)
            if self.step < self.spec.train.max_steps:
                return  # the save found the last steps bad and rolled them back: train them again
        log.info("training finished", step=self.step)
        raise WorkerExit(exit_codes.OK)

    def _save_if_due(self) -> None:
        """An interval checkpoint when the checkpointer says one is due (to disk, or to the memory
        tier only); at max_steps the final save follows."""
        self.checkpointer.step_done()
        if self.step >= self.spec.train.max_steps:
            return
        if self.checkpointer.due(self.step):
            self._save("interval")
        elif self.checkpointer.memory_due(self.step):
            self._save("interval", memory_only=True)

    def _save(self, reason: str, *, wait: bool = False, memory_only: bool = False) -> None:
        """Checkpoint, unless the state holds a bad step: then it is healed (rolled back) instead,
        or WorkerExit when it cannot be."""
        with self.badput.timing("checkpoint"):
            if memory_only:  # the finished steps' values, for the guard to check
                self.reporter.check_pending()
            else:
                self.reporter.report_pending()
            clean = self.guard.state_is_clean(self.progress)
        if not clean:
            self.healer.heal(self)
            return
        # No commit of a state the replicas differ on (a replay's time is not the checkpoint's; a
        # save before exiting has a deadline near, and no time for one).
        if not memory_only:
            self._compare_replicas(replay=not (reason == "request" and wait))
        with self.badput.timing("checkpoint"):
            if memory_only:
                self.checkpointer.save_memory(self.progress)
            else:
                self.checkpointer.save(self.progress, reason, wait=wait)

    def _compare_replicas(self, replay: bool = True) -> None:
        """The replicas' fingerprints (engine.health.replicas): returns when they agree or a replay
        healed them in place, else WorkerExit."""
        if (mismatch := self.replicas.compare(self.step)) is None:
            return
        self.checkpointer.wait()
        self.checkpointer.forget_after(self.replicas.agreed)
        if not mismatch.odd and replay:
            with self.badput.timing("rollback"):
                mismatch = self.replicas.replay(mismatch, self)
            self.guard.rewound(self.progress)
            self.stragglers.reset()
        self.replicas.settle(mismatch, self.hooks.emit)

    def _judge_stragglers(self) -> None:
        """Every process's forward time against the others' (engine.health.stragglers): WorkerExit
        when a straggler is evicted, after a save of the step all reached."""
        if (code := self.stragglers.eviction(self.stragglers.step_done(self.step))) is not None:
            self._save("evict", wait=True)
            raise WorkerExit(code)

    # --- healing (engine.health.healing) ---

    def rewind(self, at_most: int) -> Progress | None:
        """Restore the newest state of step `at_most` or earlier in place; None if there is none."""
        self._keep_polling()
        self.checkpointer.wait()
        # A save's last act is rank 0's commit (its rename), after the others' waits return: once
        # every rank has waited, each finds the same committed steps.
        self.backend.agree(None)
        # Mid-step (a request served before the step's end) the gradients hold part of a step the
        # restored state never took; a boundary state's restore leaves them as they are.
        self.optimizer.zero_grad(set_to_none=True)
        restored = self.checkpointer.restore(at_most=at_most)
        if restored is None:
            return None
        self.progress.__dict__.update(vars(restored))  # the loop holds this object
        self.reporter.rewound()
        self.replicas.restored(restored)
        self.stragglers.reset()
        return self.progress

    def _keep_polling(self) -> None:
        """While healing: the hooks' heartbeats go on (a replay can outlast the supervisor's hang
        bound), and what they are asked is kept for the loop's next boundary."""
        p = self.progress
        self._deferred = merge(self._deferred, self.hooks.poll(Boundary(p.step, p.micro_step)))

    def replay_step(self, local: bool = False) -> list[float]:
        """Train the current step to its end as the loop does, unreported: its values, read now
        (the processes' mean, or with `local` this process's own)."""
        p = self.progress
        while p.micro_step < self.loader.accum.at(p.step):
            self._keep_polling()
            self.micro_batch()
        result, values = self.optimizer_step(), []
        self.replicas.replayed(result.step, result.values)
        if local:
            values.append(result.values.tolist())
        else:
            self.backend.read_values([result.values], values.extend)
        self.backend.flush()
        return values[0]

    def _between_boundaries(self, request: Request) -> bool:
        """A request heard while a step runs (the hooks' thread): the newest memory state goes to
        disk at once. True when that answers it: a checkpoint that lets training go on, of every
        step done so far (the memory tier may have passed over the last ones); else the loop
        still saves at its next boundary."""
        if request.action is Action.STOP:
            return False
        written = self.checkpointer.promote()
        return (written is not None and request.action is Action.CHECKPOINT
                and written >= (self.progress.step, 0))


def default_state_dir() -> Path:
    return Path(os.environ.get("TPUD_STATE_DIR", "state"))


def main(argv: list[str] | None = None, hooks: Hooks | None = None) -> int:
    from engine import logs
    from engine.spec.loader import SpecError, load_spec

    parser = argparse.ArgumentParser(
        prog="python -m engine.train", description="Train a job without the tpud supervisor (local only).")
    parser.add_argument("job", help="job YAML file")
    parser.add_argument("overrides", nargs="*", default=[], metavar="key=value", help="dotted overrides, e.g. train.max_steps=50")
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
    return train(spec, args.state_dir or default_state_dir(), hooks or SignalHooks(), runtime=Runtime.from_env())


def train(spec: JobSpec, state_dir: Path, hooks: Hooks, hosts: Hosts | None = None,
          kept: list[Warm] | None = None, runtime: Runtime = Runtime()) -> int:
    """Train a validated spec to its end or a stop; the worker's exit code. `kept`: a gang's worker
    that may change its gang in place passes a list: it holds the Warm state to start from (if any),
    and the trainer's when training raised (engine.errors.GangChanged, a peer gone)."""
    try:
        trainer = Trainer(spec, state_dir, hooks, hosts, kept[0] if kept else None, runtime)
    except ConfigError as e:
        log.error("job cannot run here", key=e.key, error=str(e))
        return exit_codes.BAD_INPUT
    try:
        return trainer.run()
    except BaseException:
        if kept is not None:
            kept[:] = [trainer.warm()]
        raise
    finally:
        trainer.backend.close()


if __name__ == "__main__":
    sys.exit(main())
