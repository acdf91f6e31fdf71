"""When the loop saves: a disk checkpoint every interval_steps steps and once interval_seconds
have passed since the last save (`due`), and a memory one every memory.interval_steps steps
while its saves stay within their share of the loop's time (`memory_due`). An interval of
`auto` follows the tier's `IntervalPolicy` (engine.checkpoint.policy), fed here with the step
times and what each save held the loop for.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from engine.backends.base import Backend
from engine.checkpoint.policy import Interval, IntervalPolicy
from engine.requests import Action, Request
from engine.spec.schema import CheckpointConfig


class SaveSchedule:
    def __init__(self, cfg: CheckpointConfig, backend: Backend, disruptions_per_hour: float | None = None,
                 clock: Callable[[], float] = time.monotonic):
        """disruptions_per_hour: the supervisor's estimate for this job; None: the job's prior."""
        self.cfg, self.backend, self.clock = cfg, backend, clock
        rate = disruptions_per_hour or cfg.disruptions_per_hour
        self.last_save_time = clock()
        self._memory_budget: tuple[float | None, float] = (None, 0.0)  # (first memory save, seconds they held the loop)
        self.policies: dict[str, IntervalPolicy] = {}  # tier -> its policy, for the tiers set to auto
        if cfg.interval_steps == "auto":
            self.policies["local"] = IntervalPolicy(rate, min_steps=cfg.min_interval_steps,
                                                    max_seconds=cfg.max_interval_seconds, max_overhead=cfg.max_overhead)
        memory = cfg.memory
        if memory is not None and memory.interval_steps == "auto":
            self.policies["memory"] = IntervalPolicy(rate, min_steps=memory.min_interval_steps,
                                                     max_seconds=memory.max_interval_seconds,
                                                     max_overhead=memory.max_overhead)
        self._last_step: dict[str, int] = {"local": 0, "memory": 0}  # the step each tier last saved
        self._step_began: float | None = None
        self._saving = 0.0  # seconds saves held the loop since the step began

    def restored(self, step: int) -> None:
        """The loop resumes after `step`: intervals count from there."""
        self._last_step = {"local": step, "memory": step}

    def step_done(self) -> None:
        """A step ended (called once per step, before `due`): its time, saves left out, for the policies."""
        now = self.clock()
        if self._step_began is not None:
            for policy in self.policies.values():
                policy.step_took(now - self._step_began - self._saving)
        self._step_began, self._saving = now, 0.0

    def intervals(self) -> dict[str, Interval]:
        """What each auto tier's policy decides now."""
        return {tier: policy.interval() for tier, policy in self.policies.items()}

    def local_interval_s(self, step_time_s: float) -> float | None:
        """The local tier's interval in seconds as `due` applies it: whichever of interval_seconds and
        the step interval (its auto policy's seconds, or interval_steps at `step_time_s` a step) ends
        first; None when neither is set."""
        policy = self.policies.get("local")
        if policy is not None:
            by_steps = policy.interval().seconds
        else:
            by_steps = self.cfg.interval_steps * step_time_s if self.cfg.interval_steps else None
        intervals = [s for s in (self.cfg.interval_seconds, by_steps) if s]
        return min(intervals) if intervals else None

    def due(self, step: int) -> bool:
        """Whether an interval checkpoint is due now, `step` steps done; every rank gets the same answer."""
        policy = self.policies.get("local")
        if policy is not None:
            by_steps = step - self._last_step["local"] >= policy.interval().steps
        else:
            by_steps = bool(self.cfg.interval_steps) and step % self.cfg.interval_steps == 0
        by_time = self.cfg.interval_seconds and self.clock() - self.last_save_time >= self.cfg.interval_seconds
        if (self.cfg.interval_seconds or policy is not None) and self.backend.data.world > 1:
            # Each rank reads its own clock and measures its own costs: they agree, or one rank alone would
            # enter the save's collectives.
            wants = by_time or (policy is not None and by_steps)
            agreed = self.backend.agree(Request(Action.CHECKPOINT) if wants else None) is not None
            return agreed or (policy is None and by_steps)
        return bool(by_steps or by_time)

    def saved(self, step: int, blocked: float) -> None:
        """A disk save of `step` was staged now, after holding the loop for `blocked` seconds."""
        self.last_save_time = self.clock()
        self._last_step["local"] = step
        self._saving += blocked
        if (policy := self.policies.get("local")) is not None:
            policy.save_took(blocked)

    def memory_due(self, step: int) -> bool:
        """Whether the memory tier saves at this step: every interval_steps steps (auto: its policy's
        interval since the last), while the time its saves held the loop stays within max_overhead
        of the time since the first. No collective: each host's tier is its own."""
        policy = self.policies.get("memory")
        if policy is not None:
            if step - self._last_step["memory"] < policy.interval().steps:
                return False
        elif step % self.cfg.memory.interval_steps:
            return False
        since, spent = self._memory_budget
        return since is None or spent <= self.cfg.memory.max_overhead * (self.clock() - since)

    def memory_saved(self, step: int, started: float) -> None:
        """A memory save of `step` that began at `started` (the clock's time) has given the loop back."""
        blocked = self.clock() - started
        since, spent = self._memory_budget
        self._memory_budget = (since or started, spent + blocked)
        self._last_step["memory"] = step
        self._saving += blocked
        if (policy := self.policies.get("memory")) is not None:
            policy.save_took(blocked)
