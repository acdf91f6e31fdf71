"""`tpud run JOB.yaml`: one job in the foreground under the daemon's supervisor, with the live view on a
terminal."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def run(args: argparse.Namespace) -> int:
    from engine import exit_codes, logs
    from engine.spec.loader import SpecError, load_job
    from tpud.daemon import Daemon
    from tpud.paths import Paths

    logs.configure()
    try:
        loaded = load_job(args.job, args.overrides)
    except SpecError as e:
        print(e, file=sys.stderr)
        return exit_codes.BAD_INPUT
    view = None
    if sys.stdout.isatty() and os.environ.get("TPUD_LOG_FORMAT") != "json":
        from tpud.view.live import LiveView

        view = LiveView(args.job)
    daemon = Daemon(Paths.resolve(args.home), metrics_addr=args.metrics_addr, single=(loaded.spec, Path(args.job)),
                    view=view)
    if refused := daemon.refusal(loaded):
        print(refused, file=sys.stderr)
        return exit_codes.BAD_INPUT
    if view is None:
        return daemon.run()
    view.start()
    logs.configure(level="warning", fmt="console")  # through the view: only what needs a reader's eye
    status = None
    try:
        status = daemon.run()
        return status
    finally:
        jobs = list(daemon.jobs.values())
        view.close(jobs[0].snapshot if jobs else None, status)
