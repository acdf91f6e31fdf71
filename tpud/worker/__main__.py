from tpud.worker import record_early_signals

early_signals = record_early_signals()

from tpud.worker.entry import main, run_and_exit  # noqa: E402  (after the handlers: its imports take the time)

run_and_exit(lambda: main(early_signals=early_signals))
