"""structlog set-up shared by the engine and tpud (torch-free).

JSON lines when stdout is not a terminal (a supervisor or journald reads them), readable
console lines when it is. TPUD_LOG_FORMAT=json|console overrides the guess, which is how
`tpud run` keeps a worker's output readable when its own stdout is a terminal.
"""

from __future__ import annotations

import logging
import os
import sys

import structlog


def configure(level: str = "info", fmt: str | None = None, stream=None) -> None:
    stream = stream or sys.stdout
    fmt = fmt or os.environ.get("TPUD_LOG_FORMAT") or ("console" if stream.isatty() else "json")
    renderer = structlog.dev.ConsoleRenderer() if fmt == "console" else structlog.processors.JSONRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        # One write a record, its newline included (print writes them apart, and an unbuffered
        # worker killed between the two leaves a record its reader splices the next line onto).
        logger_factory=structlog.WriteLoggerFactory(stream),
        cache_logger_on_first_use=False,
    )
