"""How often a tier saves when its interval is `auto`: Young's interval from what a save costs
and how often the job is disrupted. Torch-free.

A save every T seconds of training that holds the loop for C seconds, with disruptions (a
crash, a hang, a preemption without time to save, a lost host) arriving at rate r, costs C / T
of the loop saving and T / 2 of redone work per disruption on average: a share C / T + r T / 2,
least at T* = sqrt(2 C / r) (Young 1974; Daly's higher-order terms matter only when T* nears
1 / r). The interval in steps is T* over the step time, then bounded:

- no shorter than C / max_overhead: saves never take more than that share of the loop;
- no longer than max_interval_seconds of steps, and never under min_interval_steps.

C and the step time are running averages of what this worker measured. Until a save has been
measured the tier saves after min_interval_steps, to measure one. r comes from the supervisor
(the disruptions it has seen for this job on this host, with a prior: `DisruptionRate`),
handed to each worker at its start: every disruption starts a new worker, which gets the
updated rate. A preemption notice still saves at once, whatever the interval.

The GCS uploads (`SecondsPolicy`) follow the same rule in seconds: the supervisor makes them
beside the running loop, so their cost C is the upload's own time; the supervisor updates
their rate as each worker starts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SMOOTHING = 0.2  # weight of each new measurement in the running averages


@dataclass(frozen=True)
class Interval:
    """What a tier's policy decided, as status and metrics show it."""

    steps: int | None                  # None: a tier timed in seconds (the GCS uploads)
    seconds: float | None              # steps x the step time (None before a step was timed)
    save_seconds: float | None         # what a save costs (None before one was measured)
    disruptions_per_hour: float        # the rate assumed
    expected_loss_seconds: float | None  # per disruption: half an interval of work redone, and a save

    def as_dict(self) -> dict:
        return {"steps": self.steps, "seconds": _round(self.seconds), "save_seconds": _round(self.save_seconds),
                "disruptions_per_hour": round(self.disruptions_per_hour, 4),
                "expected_loss_seconds": _round(self.expected_loss_seconds)}


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


class IntervalPolicy:
    def __init__(self, disruptions_per_hour: float, *, min_steps: int = 1, max_seconds: float = 3600.0,
                 max_overhead: float = 0.05):
        if disruptions_per_hour <= 0 or min_steps < 1 or max_seconds <= 0 or not 0 < max_overhead <= 1:
            raise ValueError("invalid interval policy")
        self.disruptions_per_hour, self.min_steps = disruptions_per_hour, min_steps
        self.max_seconds, self.max_overhead = max_seconds, max_overhead
        self.save_seconds: float | None = None
        self.step_seconds: float | None = None

    def step_took(self, seconds: float) -> None:
        """A training step took `seconds`, saves left out."""
        self.step_seconds = _average(self.step_seconds, seconds)

    def save_took(self, seconds: float) -> None:
        """A save held the loop for `seconds`."""
        self.save_seconds = _average(self.save_seconds, seconds)

    def interval(self) -> Interval:
        step, save = self.step_seconds, self.save_seconds
        if step is None or save is None or step <= 0:
            steps = self.min_steps
        else:
            seconds = young_seconds(save, self.disruptions_per_hour, self.max_overhead)
            most = max(self.min_steps, math.floor(self.max_seconds / step + 1e-9))
            steps = min(most, max(self.min_steps, round(seconds / step)))
        seconds = None if step is None else steps * step
        loss = None if seconds is None else seconds / 2 + (save or 0.0)
        return Interval(steps, seconds, save, self.disruptions_per_hour, loss)


def young_seconds(save_seconds: float, disruptions_per_hour: float, max_overhead: float) -> float:
    """sqrt(2 C / r), and no shorter than C / max_overhead."""
    return max(math.sqrt(2.0 * save_seconds * 3600.0 / disruptions_per_hour), save_seconds / max_overhead)


class SecondsPolicy:
    """Young's interval for a tier timed in seconds rather than steps: the GCS uploads, which
    the supervisor makes while the loop runs on. C is what an upload takes (the host's uplink
    and CPUs busy beside the training), bounded by max_overhead and max_seconds as above."""

    def __init__(self, disruptions_per_hour: float, *, max_seconds: float, max_overhead: float):
        self.disruptions_per_hour, self.max_seconds, self.max_overhead = disruptions_per_hour, max_seconds, max_overhead
        self.save_seconds: float | None = None

    def save_took(self, seconds: float) -> None:
        self.save_seconds = _average(self.save_seconds, seconds)

    def interval(self) -> Interval:
        """Before an upload was measured: 0, upload at once (and measure one)."""
        rate, save = self.disruptions_per_hour, self.save_seconds
        seconds = 0.0 if save is None else min(self.max_seconds, young_seconds(save, rate, self.max_overhead))
        return Interval(None, seconds, save, rate, seconds / 2 + (save or 0.0))


def _average(mean: float | None, value: float) -> float:
    return value if mean is None else (1 - SMOOTHING) * mean + SMOOTHING * value


class DisruptionRate:
    """The supervisor's estimate of a job's disruptions per hour on this host: the posterior mean of
    a Poisson rate with a gamma prior worth one disruption at `prior_per_hour`, (1 + n) / (1 /
    prior + hours). It starts at the prior and follows what was seen as the hours add up."""

    def __init__(self, prior_per_hour: float):
        if prior_per_hour <= 0:
            raise ValueError("the prior disruption rate must be positive")
        self.prior_per_hour = prior_per_hour

    def per_hour(self, disruptions: int, seconds: float) -> float:
        return (1 + disruptions) / (1 / self.prior_per_hour + max(0.0, seconds) / 3600.0)
