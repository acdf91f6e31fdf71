"""Loss spikes: a step whose loss or gradient norm stands far above the recent steps'.

Each finished step's values are compared with the median of the last `window_steps` steps'
(in log space: a spike is a ratio), measured in robust standard deviations, 1.4826 times the
median absolute deviation, which a few outliers do not inflate as they would a mean's. A spike
must clear both the threshold in deviations and a plain ratio to the median (`loss_ratio`, or
`grad_norm_ratio` for the noisier gradient norm): a window of nearly equal losses has a tiny
spread, and a deviation of 6 of them may still be noise a run should train through.

No spike is called before `warmup_steps` (early losses fall fast and their norms swing), nor
before a quarter window of history after a start. A spike is not added to the history, so the
next steps are judged against the run as it was. Torch-free and pure.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

from engine.spec.schema import SpikeConfig

MAD_TO_SIGMA = 1.4826  # a normal distribution's standard deviation over its median absolute deviation


@dataclass(frozen=True)
class Spike:
    step: int
    signal: str      # "loss" or "grad_norm": the value that stood out
    value: float
    median: float    # the window's median of that signal
    deviations: float  # how many robust standard deviations above it

    def describe(self) -> str:
        return (f"{self.signal.replace('_', ' ')} {self.value:.4g} at step {self.step}: {self.value / self.median:.2f}x "
                f"the median of the last steps, {self.deviations:.1f} deviations above it")


class SpikeDetector:
    def __init__(self, cfg: SpikeConfig):
        self.cfg = cfg
        # signal -> (step, log value) of the recent steps
        self.history: dict[str, deque[tuple[int, float]]] = {s: deque(maxlen=cfg.window_steps)
                                                             for s in ("loss", "grad_norm")}
        self.judged = 0  # the last step observed: the loop may check a step before it reports it

    def observe(self, step: int, loss: float, grad_norm: float | None) -> Spike | None:
        """A finished step's values (finite): the spike they make, else None (and they join the history)."""
        if step <= self.judged:
            return None  # judged clean already
        self.judged = step
        values = {"loss": loss, "grad_norm": grad_norm}
        ratios = {"loss": self.cfg.loss_ratio, "grad_norm": self.cfg.grad_norm_ratio}
        judged = step > self.cfg.warmup_steps
        for signal, value in values.items():
            history = [x for _, x in self.history[signal]]
            if value is None or value <= 0 or not judged or len(history) < self.cfg.window_steps // 4:
                continue
            centre = statistics.median(history)
            spread = MAD_TO_SIGMA * statistics.median(abs(x - centre) for x in history)
            rise = math.log(value) - centre
            if rise >= math.log(ratios[signal]) and rise > self.cfg.threshold * spread:
                return Spike(step, signal, value, math.exp(centre), rise / spread if spread else math.inf)
        for signal, value in values.items():
            if value is not None and value > 0:
                self.history[signal].append((step, math.log(value)))
        return None

    def rewound(self, step: int) -> None:
        """The loop went back to `step` (a rollback): the later steps' values no longer happened."""
        self.judged = step
        for signal, history in self.history.items():
            self.history[signal] = deque(((s, x) for s, x in history if s <= step), maxlen=history.maxlen)
