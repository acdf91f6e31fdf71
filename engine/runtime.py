"""What the supervisor tells a worker beyond its job spec, read once where the worker starts.

tpud's daemon passes these in the worker's environment (docs/architecture.md, "The worker");
`Runtime.from_env` reads them at the entry point (tpud/worker/entry.py, `python -m engine.train`)
and the Trainer hands each component its part. A Trainer made without one (tests, a library
caller) runs as if alone: no memory tier, the job's own disruption prior, no gang.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Runtime:
    memory_dir: Path | None = None  # the memory tier's root, which the supervisor owns (TPUD_MEMORY_DIR)
    disruptions_per_hour: float | None = None  # seen on this host, for auto intervals (TPUD_DISRUPTIONS_PER_HOUR)
    gang_host: int | None = None  # this host's index in a gang, which injected faults name (TPUD_GANG_HOST)
    evict_stragglers: bool = False  # tpud.yaml's gang.evict_stragglers (TPUD_GANG_EVICT_STRAGGLERS)
    wandb_run_id: str | None = None  # written into every manifest (TPUD_WANDB_RUN_ID)

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> Runtime:
        try:
            rate = float(env.get("TPUD_DISRUPTIONS_PER_HOUR", ""))
        except ValueError:
            rate = None
        host = env.get("TPUD_GANG_HOST", "")
        return cls(memory_dir=Path(env["TPUD_MEMORY_DIR"]) if env.get("TPUD_MEMORY_DIR") else None,
                   disruptions_per_hour=rate if rate is not None and 0 < rate < math.inf else None,
                   gang_host=int(host) if host.isdigit() else None,
                   evict_stragglers=env.get("TPUD_GANG_EVICT_STRAGGLERS") == "1",
                   wandb_run_id=env.get("TPUD_WANDB_RUN_ID") or None)
