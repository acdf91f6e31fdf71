"""The worker process: `python -m tpud.worker SPEC.json --state-dir DIR`.

The supervisor validates the job file and hands the worker the resolved spec as JSON,
so the worker trains exactly what was validated even if the file changes meanwhile.
This is the one tpud module that imports torch (through engine); the supervisor runs it
as a separate process so a crash or hang here never touches the supervisor.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import structlog

from engine import exit_codes, logs
from engine.config import JobSpec
from engine.errors import ConfigError
from engine.hooks import SignalHooks
from tpud.supervisor import die_with_parent

log = structlog.get_logger()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tpud.worker", description="tpud training worker (internal).")
    parser.add_argument("spec", type=Path, help="resolved job spec, JSON")
    parser.add_argument("--state-dir", type=Path, required=True)
    args = parser.parse_args(argv)
    parent = os.environ.get("TPUD_SUPERVISOR_PID")
    die_with_parent(int(parent) if parent else None)
    spec = JobSpec.model_validate_json(args.spec.read_text())
    logs.configure(spec.logging.level)
    structlog.contextvars.bind_contextvars(job=spec.name)
    from engine.train import Trainer  # torch is imported here, after argument checks

    try:
        trainer = Trainer(spec, args.state_dir, SignalHooks())
    except ConfigError as e:
        log.error("job cannot run here", key=e.key, error=str(e))
        return exit_codes.BAD_INPUT
    try:
        return trainer.run()
    finally:
        trainer.backend.close()


if __name__ == "__main__":
    sys.exit(main())
