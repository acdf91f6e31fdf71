"""job.json: what the daemon keeps of a job across its own restarts.

Restart counts, the operator's hold, the goodput ledger, the wandb run and recent state
history. Written atomically; a full or read-only disk keeps the previous record and the job
runs on.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import structlog
from pydantic import TypeAdapter, ValidationError

from engine.layout import atomic_write

log = structlog.get_logger()
HISTORY = 50  # state changes kept


@dataclass
class JobRecord:
    restarts_total: int = 0
    rollbacks: int = 0
    first_started: float | None = None  # wall time
    held: bool = False  # an operator's `tpud stop` holds the job until `tpud start`
    goodput: dict | None = None
    wandb: dict = field(default_factory=dict)  # run_id, step
    history: list[dict] = field(default_factory=list)

    @classmethod
    def load(cls, path: Path) -> JobRecord:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return cls()
        if not isinstance(data, dict):
            return cls()
        try:  # typed: a record whose counts are not numbers must not break the job later
            return TypeAdapter(cls).validate_python(data)
        except ValidationError as e:
            log.warning("the job record is damaged; starting it afresh", path=str(path), error=str(e).splitlines()[0])
            return cls()

    def save(self, path: Path, job: str) -> None:
        self.history = self.history[-HISTORY:]
        try:
            atomic_write(path, json.dumps(asdict(self), indent=1))
        except OSError as e:  # a full or read-only disk must not stop the job; the previous record stays
            log.warning("cannot write the job record; keeping the previous one", job=job, path=str(path),
                        error=str(e))
