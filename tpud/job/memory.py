"""The memory tier from the supervisor's side: its share of host RAM over every job, and its
directories (engine.checkpoint.memory writes them; the daemon owns them). Torch-free.

A job's tier holds two states, each as large as the training state (fp32 weights, the
optimizer's moments, and a partial step's gradients). Before a worker starts, the job reserves
that much of the budget, `memory_tier_max_share` of the host's RAM, counting every job that
holds a reservation. A job that asked for the tier (checkpoint.memory in its file) and does not
fit is refused with what it would need; one that has it by default runs without it.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from engine.spec.schema import JobSpec

log = structlog.get_logger()

SLOTS = 2
_MOMENTS = {"adamw": 2, "lion": 1, "muon": 2}  # fp32 tensors per weight in the optimizer's state


def state_bytes(spec: JobSpec) -> int:
    """The largest state the job's memory tier copies: weights, moments and a partial step's gradients."""
    m = spec.model
    q_dim = m.n_heads * m.head_dim
    attention = m.dim * (q_dim + 2 * m.kv_heads * m.head_dim) + q_dim * m.dim + (2 * m.head_dim if m.qk_norm else 0)
    if m.moe is None:
        feed_forward = 3 * m.dim * m.hidden_dim
    else:  # every expert, and the router
        feed_forward = m.moe.num_experts * (3 * m.dim * m.expert_dim + m.dim)
    per_layer = attention + feed_forward + 2 * m.dim  # and two norms
    weights = m.n_layers * per_layer + m.dim * m.vocab_size * (1 if m.tie_embeddings else 2) + m.dim
    return 4 * weights * (2 + _MOMENTS[spec.optimizer.name])


def host_memory_bytes() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.2f} GiB"


@dataclass
class MemoryBudget:
    """Every job's reservation, against `share` of the host's RAM."""

    share: float
    total: int = field(default_factory=host_memory_bytes)
    reserved: dict[str, int] = field(default_factory=dict)

    def reserve(self, job: str, need: int) -> str | None:
        """Reserve `need` bytes for `job` (again: its reservation is replaced); why not, or None."""
        others = sum(n for name, n in self.reserved.items() if name != job)
        limit = int(self.share * self.total)
        if others + need > limit:
            held = ", ".join(f"{name} {_gib(n)}" for name, n in sorted(self.reserved.items()) if name != job)
            return (f"the memory tier needs {_gib(need)} ({SLOTS} states of {_gib(need / SLOTS)}), and "
                    f"memory_tier_max_share {self.share:g} of this host's {_gib(self.total)} is {_gib(limit)}"
                    + (f", of which other jobs hold {_gib(others)} ({held})" if others else "")
                    + "; set checkpoint.memory: null, or raise memory_tier_max_share in tpud.yaml")
        self.reserved[job] = need
        return None

    def release(self, job: str) -> None:
        self.reserved.pop(job, None)


class JobMemory:
    """One job's memory tier: whether its worker gets one, and its directory."""

    def __init__(self, name: str, root: Path, budget: MemoryBudget, *, blank: bool = False):
        """blank: the job has no record (a new state directory: "delete it to start over")."""
        self.name, self.root, self.budget = name, root, budget
        self.refused: str | None = None  # why a tier the job asked for cannot be had
        self.env: dict[str, str] = {}  # what the last worker started was given
        if blank:
            self.discard()  # states a former life of this home left in shared memory

    @property
    def job_dir(self) -> Path:
        return self.root / self.name

    def worker_env(self, spec: JobSpec) -> dict[str, str] | None:
        """TPUD_MEMORY_DIR for the next worker when the job has the tier; None when a tier the job
        asked for does not fit (self.refused says why); {} when it runs without one."""
        env = self._env(spec)
        if env is not None:
            self.env = env
        return env

    def _env(self, spec: JobSpec) -> dict[str, str] | None:
        cfg, self.refused = spec.checkpoint.memory, None
        if cfg is None or not cfg.interval_steps:
            self.discard()
            return {}
        why = self.budget.reserve(self.name, SLOTS * state_bytes(spec))
        if why is None:
            return {"TPUD_MEMORY_DIR": str(self.root)}
        if "memory" in spec.checkpoint.model_fields_set:
            self.refused = why
            return None
        log.warning("running without a memory tier", job=self.name, why=why)
        self.discard()
        return {}

    def discard(self) -> None:
        """The job no longer needs its states in memory (it ended, or runs without the tier)."""
        self.budget.release(self.name)
        shutil.rmtree(self.job_dir, ignore_errors=True)
