"""Reads for tests of the job-file reader (tpud/jobfiles/offloop.py), which runs them in its helper
process: pickled by name, so the helper imports this module to run one. Kept apart from the tests'
own modules, whose imports (the daemon, GCS's client) took seconds on a loaded machine: a read with
a 2 s timeout then timed out while importing its own function."""

from __future__ import annotations

import os
import time
from pathlib import Path


def echo(value):
    return value


def wait_for(path: str, started: str | None = None) -> str:
    if started is not None:
        Path(started).touch()
    while not os.path.exists(path):
        time.sleep(0.01)
    return "gate"


def fail():
    raise ValueError("a strange file")


def sleep_forever():
    time.sleep(3600)
