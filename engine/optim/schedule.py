"""Learning-rate schedules as pure functions of the step, so resuming needs only the step."""

from __future__ import annotations

import math

from engine.config import SchedulerConfig


def lr_factor(cfg: SchedulerConfig, step: int, max_steps: int) -> float:
    """Multiplier of the peak lr at `step` (0-based): linear warmup, then cosine decay
    from 1 at the end of warmup to min_lr_ratio at the last step."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    decay_steps = max(1, max_steps - 1 - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine
