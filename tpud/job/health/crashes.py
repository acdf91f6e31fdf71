"""Why a worker exited: a restart reason and a one-line error for `tpud status`.

The daemon keeps the last lines of the worker's merged stdout and stderr. Most are structlog
JSON records (a logged exception's traceback rendered into "exception"), but what kills a
worker usually bypasses structlog: an uncaught exception's plain traceback, torch_xla/PJRT
status errors, glog's fatal "F..." line before an abort, faulthandler's "Fatal Python error".
Torch-free; classify() never raises, since a garbled tail must not break the daemon's exit handling.
"""

from __future__ import annotations

import json
import re
import signal
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

REASONS = ("oom", "killed", "signal", "exception", "xla_error", "crash")
MAX_MESSAGE = 500
MAX_DETAIL = 10
_MAX_LINE = 1000  # a worker printing without newlines must not bloat `tpud status -o json`


@dataclass(frozen=True)
class Crash:
    reason: str  # tpud_job_restarts_total{reason}: one of REASONS
    message: str  # one line of at most MAX_MESSAGE characters, for `tpud status`
    detail: list[str] = field(default_factory=list)  # the last relevant lines, for `tpud status -o json`


_OOM = re.compile(r"MemoryError\b|out of memory|RESOURCE_EXHAUSTED", re.IGNORECASE)
# absl status codes as XLA/PJRT prefix them: at the start of a line or after "SomeError: ".
_CODES = "INTERNAL|UNAVAILABLE|ABORTED|DEADLINE_EXCEEDED|FAILED_PRECONDITION|DATA_LOSS|UNIMPLEMENTED|UNKNOWN|" \
         "INVALID_ARGUMENT|OUT_OF_RANGE|CANCELLED"
_GLOG = re.compile(r"^(?P<severity>[FE])\d{4} [\d:.]+\s+\d+ (?P<where>[^\]\s]+)\] (?P<text>.*)")
_XLA = re.compile(rf"XlaRuntimeError|Bad StatusOr access|Check failed:|^F\d{{4}} [\d:.]+\s|(?:^|: )(?:{_CODES}): ")
_ERRORISH = re.compile(r"error|exception|fatal|fail|abort|panic|segmentation fault|killed", re.IGNORECASE)
_FRAME = re.compile(r'^\s+File "(?P<file>[^"]*)", line (?P<line>\d+)(?:, in (?P<func>.*))?')
_HEADER = "Traceback (most recent call last):"
_EXCEPTION = re.compile(r"[A-Za-z_][\w.]*(?::|$)")  # "ValueError: ...", "pkg.mod.Error: ...", "MemoryError"
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


class _Line(NamedTuple):
    text: str
    source: str  # "plain" (printed outside structlog), "log" (an ordinary record), "error" (an error
    #              record's event), "exception" (a line of a record's rendered traceback)


class _Traceback(NamedTuple):
    start: int  # its first line (the header, unless the tail cut it off)
    end: int  # its exception line
    frame: re.Match  # the innermost frame
    rank: int  # 2: uncaught (printed plain), 1: logged, 0: a thread's or an "Exception ignored"


def classify(status: int, tail: Sequence[str], *, oom_kills_before: int | None = None,
             oom_kills_after: int | None = None) -> Crash:
    """Classify a worker's exit: status is shell-style (128 + N when killed by signal N)."""
    try:
        return _classify(status, tail, oom_kills_before, oom_kills_after)
    except Exception:  # a bug here must not cost the daemon its exit handling
        signum = _signum(status)
        if signum is None:
            return Crash("crash", f"exited with status {status}")
        return Crash("killed" if signum == signal.SIGKILL else "signal", f"killed by {_signal_name(signum)}")


def oom_kill_count(cgroup_root: Path = Path("/sys/fs/cgroup"),
                   proc_cgroup: Path = Path("/proc/self/cgroup")) -> int | None:
    """The oom_kill counter of this process's cgroup v2 memory.events; None when unavailable.

    Workers share the daemon's cgroup, so a rise across a worker's life that ends in SIGKILL
    says the kernel's OOM killer (not an operator) killed it.
    """
    try:
        paths = [line[3:] for line in proc_cgroup.read_text().splitlines() if line.startswith("0::")]
        if not paths:
            return None  # cgroup v1 only
        events = cgroup_root / paths[0].strip().lstrip("/") / "memory.events"
        for line in events.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
    except (OSError, ValueError):
        pass
    return None


def _classify(status: int, tail: Sequence[str], before: int | None, after: int | None) -> Crash:
    signum = _signum(status)
    lines = _lines(tail)
    tracebacks = _tracebacks(lines)
    if signum == signal.SIGKILL and before is not None and after is not None and after > before:
        return Crash("oom", "out of memory: killed by the kernel's OOM killer", _last(lines))
    for reason, pattern in (("oom", _OOM), ("xla_error", _XLA)):
        i = _find(lines, lambda line: pattern.search(line.text))
        if i is not None:
            return Crash(reason, *_explain(lines, i, tracebacks))

    best = max(tracebacks, key=lambda t: (t.rank, t.end), default=None)
    # A signal ends a process without a Python exception: only an uncaught one before it (torch_xla
    # may crash at exit after one) is the cause, not one logged earlier and handled.
    if best is not None and (signum is None or best.rank == 2):
        return Crash("exception", *_explain(lines, best.end, tracebacks))

    if signum is None:
        reason, head = "crash", f"exited with status {status}"
    else:
        reason, head = "killed" if signum == signal.SIGKILL else "signal", f"killed by {_signal_name(signum)}"
    i = _find(lines, lambda line: line.source == "error" or _ERRORISH.search(line.text) or _GLOG.match(line.text))
    if i is None:
        return Crash(reason, head, _last(lines))
    error, detail = _explain(lines, i, tracebacks)
    return Crash(reason, f"{head} ({_squash(error, MAX_MESSAGE - len(head) - 3)})", detail)


def _lines(tail: Sequence[str]) -> list[_Line]:
    """The tail as text lines, with each JSON record's rendered traceback unfolded into its lines."""
    lines = []
    for raw in tail:
        text = raw.decode(errors="replace") if isinstance(raw, (bytes, bytearray)) else str(raw)
        # A progress bar's "\r" redraws the line: keep what a terminal would show.
        text = _ANSI.sub("", text).rstrip().rsplit("\r", 1)[-1]
        record = json_record(text)
        if record is None:
            lines.append(_Line(text[:_MAX_LINE], "plain"))
            continue
        if str(record.get("level", "")).lower() in ("error", "critical", "fatal", "exception"):
            event, error = str(record.get("event", "")), record.get("error")
            lines.append(_Line((f"{event}: {error}" if error else event)[:_MAX_LINE], "error"))
        else:
            lines.append(_Line(text[:_MAX_LINE], "log"))
        if isinstance(record.get("exception"), str):
            lines.extend(_Line(line[:_MAX_LINE], "exception") for line in record["exception"].splitlines())
    return lines


def json_record(text: str) -> dict | None:
    """A structlog JSON line as its record; None for any other line, however garbled."""
    if not (text.startswith("{") and text.endswith("}")):
        return None
    try:
        record = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return record if isinstance(record, dict) else None


def _indented(text: str) -> bool:
    return text[:1] in (" ", "\t")


def _tracebacks(lines: list[_Line]) -> list[_Traceback]:
    """Python tracebacks: a header, indented frames, then the exception line."""
    found = []
    i = 0
    while i < len(lines):
        if not _indented(lines[i].text):
            i += 1
            continue
        start = i
        while i < len(lines) and _indented(lines[i].text):
            i += 1
        frames = [m for line in lines[start:i] if (m := _FRAME.match(line.text))]
        headed = start > 0 and lines[start - 1].text.endswith(_HEADER)
        # Without its header, an indented run is a traceback only where the tail cut the header off:
        # faulthandler and glog print indented stacks too.
        if not frames or not (headed or start == 0) or i == len(lines) or not _EXCEPTION.match(lines[i].text):
            continue
        if lines[i].source == "exception":
            rank = 1
        else:
            before = lines[start - 2].text if headed and start > 1 else ""
            rank = 0 if before.startswith(("Exception in thread", "Exception ignored")) else 2
        found.append(_Traceback(start - 1 if headed else start, i, frames[-1], rank))
    return found


def _find(lines: list[_Line], predicate) -> int | None:
    """The last line that predicate accepts, not counting ordinary log records and indented lines
    (source lines and stack frames, where "MemoryError" may just be code)."""
    for i in range(len(lines) - 1, -1, -1):
        line = lines[i]
        if line.source != "log" and line.text.strip() and not _indented(line.text) and predicate(line):
            return i
    return None


def _explain(lines: list[_Line], i: int, tracebacks: list[_Traceback]) -> tuple[str, list[str]]:
    """A message for lines[i] and the lines that explain it."""
    for t in tracebacks:
        if t.end == i:
            where = f"{Path(t.frame['file']).name}:{t.frame['line']}"
            where = _squash(where + (f" in {t.frame['func']}" if t.frame["func"] else ""), 200)
            message = f"{_squash(lines[i].text, MAX_MESSAGE - len(where) - 3)} ({where})"
            return message, [line.text for line in lines[max(t.start, i - MAX_DETAIL + 1):i + 1]]
    glog = _GLOG.match(lines[i].text)
    if glog:  # "F0000 00:00:1731.5 4242 file.cc:12] text": the text first, its source after
        where = _squash(glog["where"], 200)
        message = f"{_squash(glog['text'], MAX_MESSAGE - len(where) - 3)} ({where})"
    else:
        message = _squash(lines[i].text)
    # What follows an error line without a traceback is its stack (faulthandler, glog) or continuation.
    return message, [line.text for line in lines[i:i + MAX_DETAIL]]


def _last(lines: list[_Line]) -> list[str]:
    return [line.text for line in lines if line.text.strip()][-MAX_DETAIL:]


def _squash(text: str, limit: int = MAX_MESSAGE) -> str:
    """One line of at most limit characters."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:max(limit - 3, 0)] + "..."


def _signum(status: int) -> int | None:
    signum = status - 128
    return signum if signum in signal.valid_signals() else None


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:  # a real-time signal
        return f"signal {signum}"
