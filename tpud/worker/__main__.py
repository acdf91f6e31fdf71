import signal
import sys

# A stop asked while the worker starts (the imports before its hooks take over can take a loaded
# machine a second, and a standby waits for its release) is recorded from the first instant,
# not fatal as SIGTERM's default would be: the hooks act on it, and the worker exits 75 as asked.
early_signals: list[int] = []
for _signum in (signal.SIGTERM, signal.SIGUSR1):
    signal.signal(_signum, lambda signum, _frame: early_signals.append(signum))

from tpud.worker.entry import main  # noqa: E402  (after the handlers: its imports take the time)

sys.exit(main(early_signals=early_signals))
