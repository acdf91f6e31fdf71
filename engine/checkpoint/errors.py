"""A failed checkpoint's cause in one line, for the `checkpoint_failed` event and the log: both
tiers (engine.checkpoint.writer, engine.checkpoint.memory) describe their failures with it."""

from __future__ import annotations

import errno
import os


def describe_error(error: BaseException) -> str:
    """One line for the operator: the operating system's reason when there is one under DCP's wrapping."""
    seen: list[BaseException] = []
    todo = [error]
    while todo and len(seen) < 32:
        e = todo.pop(0)
        if e in seen:
            continue
        seen.append(e)
        if isinstance(e, OSError) and e.errno:
            code = errno.errorcode.get(e.errno, str(e.errno))
            where = f": {e.filename}" if e.filename else ""
            return f"{e.strerror or os.strerror(e.errno)} ({code}){where}"
        # DCP's CheckpointException keeps each rank's exception in `failures` (with its traceback).
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values() if f is not None]
        todo += [x for x in (e.__cause__, e.__context__) if x is not None]
    text = f"{type(error).__name__}: {error}"
    return text if len(text) <= 300 else text[:297] + "..."
