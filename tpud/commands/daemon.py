"""`tpud daemon`: the service systemd runs."""

from __future__ import annotations

import argparse


def daemon(args: argparse.Namespace) -> int:
    from engine import logs
    from tpud.daemon import Daemon
    from tpud.paths import Paths

    logs.configure(fmt="json")  # journald and the tests read it as JSON lines
    return Daemon(Paths.resolve(args.home), metrics_addr=args.metrics_addr).run()
