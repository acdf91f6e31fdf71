"""Learning-rate schedules as pure functions of the step, so resuming needs only the step.

Every schedule is the smaller of a warmup ramp and a decay curve:

- warmup: (step + 1) / warmup_steps for the first warmup_steps steps, then 1 (the peak);
- decay: 1 before the decay start, then down to min_lr_ratio at the last step (max_steps - 1).
  cosine and linear decay right after warmup (the first step after it is still at the peak,
  so they start at warmup_steps + 1); wsd holds the peak and decays over the last
  round(decay_fraction * max_steps) steps (at least one), so its decay starts at step
  (1 - decay_fraction) * max_steps, with a 1 - sqrt (default) or linear curve; constant
  never decays.

Taking the minimum keeps a schedule continuous when a wsd decay is longer than the steps
after warmup: the warmup ramp then caps the start of the decay.
"""

from __future__ import annotations

import math

from engine.spec.schema import SchedulerConfig


def decay_start(cfg: SchedulerConfig, max_steps: int) -> int:
    """The first step below the peak lr after warmup; max_steps if there is none (constant)."""
    if cfg.name == "constant":
        return max_steps
    if cfg.name == "wsd":
        return max_steps - max(1, round(cfg.decay_fraction * max_steps))
    return cfg.warmup_steps + 1


def lr_factor(cfg: SchedulerConfig, step: int, max_steps: int) -> float:
    """Multiplier of the peak lr at `step` (0-based) of a run of max_steps steps."""
    warmup = (step + 1) / cfg.warmup_steps if step < cfg.warmup_steps else 1.0
    start = decay_start(cfg, max_steps)
    if step < start:
        return warmup
    progress = min(1.0, (step - start + 1) / (max_steps - start))  # 1/n at the start .. 1 at the last step
    if cfg.name == "cosine":
        remaining = 0.5 * (1.0 + math.cos(math.pi * progress))
    elif cfg.name == "wsd" and cfg.decay_shape == "1-sqrt":
        remaining = 1.0 - math.sqrt(progress)
    else:  # linear, and wsd's linear shape
        remaining = 1.0 - progress
    return min(warmup, cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * remaining)
