"""Step reports: each finished step's loss and gradient norm, with its interval's throughput.

Finished steps are kept with their values still on the device, and reported together every
log_interval steps, at the last step, and before each save: their values are read in one
batch through the backend (on XLA by a reader thread), so the hot path never waits for the
device. Each step passes the step guard (engine.health.guard) before it is emitted (`events.Step`, with the
interval's tokens/s, step time, MFU, memory in use and the badput so far); the last one
reported is logged.
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog
import torch

from engine import events
from engine.backends.base import Backend
from engine.badput import Badput
from engine.data.loader import PackedLoader
from engine.health.guard import StepGuard
from engine.spec.schema import TrainConfig

log = structlog.get_logger()


@dataclass
class StepResult:
    NAMES = ("loss", "grad_norm")  # then the statistics the loop reports (Reporter's stats)

    step: int              # steps completed, this one included
    values: torch.Tensor   # NAMES, on the device, not yet read
    lr: float
    trained_tokens: int    # the global batch's targets that the loss counted (all but the ignored ones)


def host_rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # not Linux: peak instead of current
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Reporter:
    def __init__(self, train: TrainConfig, backend: Backend, loader: PackedLoader, flops_per_token: float,
                 guard: StepGuard, badput: Badput, emit: Callable[[events.Event], None],
                 stats: tuple[str, ...] = (), intervals: Callable[[], dict] = dict,
                 interval_s: Callable[[float], float | None] = lambda step_time_s: None):
        self.train, self.backend, self.loader, self.flops_per_token = train, backend, loader, flops_per_token
        # With experts engine.models.moe.STATS, with a teacher engine.losses.distill.TERMS: step event fields.
        self.names = StepResult.NAMES + stats
        self.intervals = intervals  # the auto checkpoint intervals in force (engine.checkpoint.policy)
        self.interval_s = interval_s  # the local tier's interval in seconds, at a step time
        self.guard, self.badput, self.emit = guard, badput, emit
        self.pending: list[StepResult] = []  # finished steps whose values are not read yet
        self._checked = 0  # of pending, how many the step guard has seen (check_pending)
        self._interval_start = time.monotonic()

    def start(self) -> None:
        """The loop begins: the first interval is timed from here."""
        self._interval_start = time.monotonic()

    def rewound(self) -> None:
        """The loop went back to an earlier state (engine.health.healing): the pending steps never
        happened, and the next report's time starts now."""
        self.pending, self._checked = [], 0
        self._interval_start = time.monotonic()

    def record(self, result: StepResult) -> None:
        """Keep a finished step; report the kept ones every log_interval steps and at the last."""
        self.pending.append(result)
        if result.step % self.train.log_interval == 0 or result.step == self.train.max_steps:
            self.report_pending()

    def check_pending(self) -> None:
        """Read the finished steps' values for the step guard only, before a memory save:
        the memory tier saves every step or few, and the log still gets a line every
        log_interval steps."""
        unchecked, self._checked = self.pending[self._checked:], len(self.pending)
        if not unchecked:
            return

        def check(rows: list[list[float]]) -> None:
            for result, row in zip(unchecked, rows):
                if not self.guard.publishable(result.step, *row[:2]):
                    break

        self.backend.read_values([result.values for result in unchecked], check)

    def report_pending(self) -> None:
        """Report the steps done since the last report (the trainer also calls this before a disk save)."""
        pending, self.pending, self._checked = self.pending, [], 0
        if pending:
            now = time.monotonic()
            seconds, self._interval_start = now - self._interval_start, now
            self.report(pending, seconds)

    def report(self, pending: list[StepResult], seconds: float) -> None:
        """Emit and log the steps in `pending` once their values reach the host, checking them."""
        # The previous interval's values first: the device finished those steps long ago, and
        # from here on every host has seen the same values (engine.health.guard).
        self.guard.flush()
        # Steps pending[0].step - 1 .. pending[-1].step - 1, whose micro-batch counts may differ (batch_ramp).
        tokens = self.loader.tokens_in_steps(pending[0].step - 1, pending[-1].step) * self.backend.data.world
        tokens_per_s = tokens / seconds
        # Tokens fed to the model, and of them the targets trained on (fewer with masks), in the log line.
        counts = {"tokens": tokens, "trained_tokens": (trained := sum(r.trained_tokens for r in pending)),
                  "trained_tokens_per_s": round(trained / seconds, 1)}
        peak = self.backend.peak_flops()
        perf = {
            "tokens_per_s": round(tokens_per_s, 1),
            "step_time_s": round(seconds / len(pending), 4),
            # MFU = achieved model FLOP/s / (peak FLOP/s per device x devices), FLOPs per PaLM.
            "mfu": round(tokens_per_s * self.flops_per_token / (peak * self.backend.num_devices), 4) if peak else None,
            "rss_bytes": host_rss_bytes(),
            **device_truth(self.backend),
            "checkpoint_intervals": self.intervals() or None,
        }
        perf["checkpoint_interval_s"] = self.interval_s(perf["step_time_s"])
        badput = self.badput.snapshot()
        intervals = perf["checkpoint_intervals"]

        def publish(rows: list[list[float]]) -> None:
            scalars = None
            for result, row in zip(pending, rows):
                if not self.guard.publishable(result.step, *row[:2]):
                    break  # this step is the first non-finite one, or trained on its weights
                scalars = dict(zip(self.names, row), lr=result.lr)
                self.emit(events.Step(step=result.step, **scalars, **perf, badput=badput))
                logged = result.step
            if scalars is not None:
                log.info("step", step=logged, max_steps=self.train.max_steps,
                         **{k: round(v, 5) for k, v in scalars.items()},
                         **{k: v for k, v in perf.items() if v is not None and k not in ("checkpoint_intervals", "checkpoint_interval_s")}, **counts,
                         **({"auto_intervals": {t: i["steps"] for t, i in intervals.items()}} if intervals else {}))

        self.backend.read_values([result.values for result in pending], publish)


def device_truth(backend: Backend) -> dict:
    """What the device says of this process now: its memory (peak and in use) and the graphs it
    compiled so far, with their seconds (each None where the backend cannot tell)."""
    memory, compiled = backend.device_memory() or {}, backend.compilations()
    return {"device_memory_bytes": memory.get("peak"), "device_memory_in_use_bytes": memory.get("in_use"),
            "compilations": None if compiled is None else compiled[0],
            "compile_seconds": None if compiled is None else round(compiled[1], 3)}
