"""The training worker: its entry point (entry.py, `python -m tpud.worker`), the process as
the daemon sees it (process.py), the fork server that starts it warm (forkserver.py) and the
channel between the worker and the daemon (channel.py).

Only entry.py's main() imports torch, after its arguments are checked.
"""

import signal


def record_early_signals() -> list[int]:
    """SIGTERM and SIGUSR1 recorded from a worker's first instant, for its hooks to act on once they
    exist: a stop asked while the worker starts is not fatal (SIGTERM's default); it exits 75.
    Here, not in entry.py: the imports there take a loaded machine a second."""
    early: list[int] = []
    for signum in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(signum, lambda signum, _frame: early.append(signum))
    return early
