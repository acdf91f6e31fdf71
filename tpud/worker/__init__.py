"""The processes that run torch: the training worker (entry.py, `python -m tpud.worker`), the fork
server that starts it warm (forkserver.py), the gang's coordinator and the worker's membership
(gang/); and the channel between the worker and the daemon (channel.py, which both sides import).

The daemon imports from here only what stays torch-free at import (channel.py, the coordinator's
and fork server's launchers): tests/test_torch_free.py and test_imports.py check where torch goes.
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
