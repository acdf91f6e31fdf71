"""A micro-batch that fits itself (data.micro_batch_size: auto, train.fit_micro_batch).

An out-of-memory error in a worker's first WINDOW steps is a micro-batch too large for this
device, not a fault: the worker records the next smaller size in the job's state directory
(<state>/jobs/<job>/micro_batch.json) and exits REFIT; the supervisor starts it again at once,
and the new worker reads the record and runs that size, with as many more micro-batches per step
(engine.data.loader.batch_geometry): the same samples per step, the same maths up to summation
order. Sizes only shrink, each by at least half, so a job fits within log2(size) restarts.

Why a restart rather than a retry in place: an allocation failure can strike anywhere in the step
(forward, backward, the optimizer's first state), leaving partial gradients, half-updated
moments and, on cuda, a fragmented cache; the restart starts clean from the last checkpoint,
and XLA compiles the smaller shapes anew anyway. A gang's ranks run the smallest size any of
them recorded (agreed at start), so replicas keep one geometry.

At one sequence nothing smaller is left: the job fails (exit 78) naming the memory the step
needed and the memory available. Torch-free: the daemon reads the record for `tpud status`.
"""

from __future__ import annotations

import json
import math
import re
import resource
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from engine.files import Refused, read_regular_file
from engine.layout import atomic_write

RECORD = "micro_batch.json"
WINDOW = 2  # steps after a worker starts in which an out-of-memory error refits; later it is a crash
MAX_BYTES = 64 << 10

# Out-of-memory errors as each runtime words them: torch's CPU allocator, CUDA's caching
# allocator (torch.OutOfMemoryError), XLA's RESOURCE_EXHAUSTED; MemoryError is Python's own.
_OOM = re.compile(r"out of memory|can't allocate memory|Cannot allocate memory|RESOURCE_EXHAUSTED", re.IGNORECASE)
_ASKED = re.compile(r"allocate\s+([\d.]+)\s*(bytes|[KMGT]i?B?|B)?", re.IGNORECASE)
_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


@dataclass(frozen=True)
class Fitted:
    size: int                 # the micro-batch that fits: every later start runs it (or smaller)
    configured: int | str     # data.micro_batch_size then: a job file that changes it starts over
    reason: str               # what did not fit, and where
    step: int | None = None   # the step that met it
    unix: float | None = None


def read(path: Path) -> Fitted | None:
    """The job's record; None when there is none, or it is unreadable (then the job starts over)."""
    try:
        data = json.loads(read_regular_file(path, MAX_BYTES))
        fitted = Fitted(int(data["size"]), data["configured"], str(data["reason"]), data.get("step"), data.get("unix"))
    except (OSError, Refused, ValueError, KeyError, TypeError):
        return None
    return fitted if fitted.size >= 1 else None


def write(path: Path, fitted: Fitted) -> None:
    atomic_write(path, json.dumps(asdict(fitted)))


def largest_divisor(n: int, at_most: int) -> int:
    """The largest divisor of n not above at_most (>= 1)."""
    return next(d for d in range(min(n, max(at_most, 1)), 0, -1) if n % d == 0)


def is_out_of_memory(error: BaseException) -> bool:
    return isinstance(error, MemoryError) or (isinstance(error, RuntimeError) and bool(_OOM.search(str(error))))


class MicroBatchFit:
    def __init__(self, job_dir: Path, configured: int | str, enabled: bool):
        """configured: data.micro_batch_size; enabled: auto, or train.fit_micro_batch."""
        self.path, self.configured = Path(job_dir) / RECORD, configured
        self.enabled = enabled or configured == "auto"
        record = read(self.path) if self.enabled else None  # fitting off: the job file's size, as written
        # The record belongs to the job file that made it: a changed micro_batch_size starts over.
        self.record = record if record is not None and record.configured == configured else None

    @property
    def cap(self) -> int | None:
        """The largest micro-batch known to fit; None: no limit known."""
        return None if self.record is None else self.record.size

    def agreed(self, size: int) -> None:
        """The gang runs `size` (the smallest any rank recorded): recorded here too, for status and the next start."""
        if self.cap is None or size < self.cap:
            self.record = Fitted(size, self.configured, "the gang's smallest", None, time.time())
            write(self.path, self.record)

    def applies(self, error: BaseException, step: int, started_at: int) -> bool:
        """Whether `error`, met at `step` by a worker that started at step `started_at`, is one to refit on."""
        return self.enabled and step < started_at + WINDOW and is_out_of_memory(error)

    def refit(self, error: BaseException, step: int, micro_batch_size: int, batch: int, memory: dict) -> None:
        """Record the next smaller micro-batch (a divisor of `batch`, the per-rank sequences it must divide).
        At one sequence: ValueError naming the memory needed and available (`memory`: see memory_now)."""
        if micro_batch_size <= 1:
            raise ValueError(f"a micro-batch of one sequence does not fit in memory at step {step}: "
                             f"{shortfall(error, memory)}")
        size = largest_divisor(batch, micro_batch_size // 2)
        reason = f"out of memory at {micro_batch_size} at step {step}: {shortfall(error, memory)}"
        self.record = Fitted(size, self.configured, reason, step, time.time())
        write(self.path, self.record)


def memory_now(device: dict | None, capacity: int | None) -> dict:
    """What this process holds and may hold: the device's (cuda, xla: `device` is the backend's
    device_memory(), `capacity` its memory_capacity()), else the host's address space and limit."""
    if device is not None:
        return {"in_use": device.get("in_use"), "available": device.get("limit") or capacity, "of": "device memory"}
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    if limit != resource.RLIM_INFINITY:
        return {"in_use": _status_kib("VmSize"), "available": limit, "of": "the worker's address-space limit (RLIMIT_AS)"}
    return {"in_use": _status_kib("VmRSS"), "available": _meminfo_kib("MemAvailable"), "of": "host memory"}


def shortfall(error: BaseException, memory: dict) -> str:
    """'needed at least X (Y in use + Z asked for), W available (of what)', from the error's own words."""
    asked = asked_bytes(str(error))
    in_use, available = memory.get("in_use"), memory.get("available")
    parts = []
    if in_use is not None and asked is not None:
        parts.append(f"needed at least {size(in_use + asked)} ({size(in_use)} in use + {size(asked)} asked for)")
    elif asked is not None:
        parts.append(f"{size(asked)} more asked for")
    if available is not None:
        parts.append(f"{size(available)} available ({memory.get('of')})")
    return ", ".join(parts) or str(error).splitlines()[0][:200]


def asked_bytes(message: str) -> int | None:
    """The size of the allocation that failed, as the runtime's message gives it."""
    if (match := _ASKED.search(message)) is None:
        return None
    unit = (match.group(2) or "B").upper()
    return int(float(match.group(1)) * (1 if unit in ("B", "BYTES") else _UNITS[unit[0]]))


def size(n: float) -> str:
    if n < 1024:
        return f"{int(n)} B"
    exponent = min(int(math.log(n, 1024)), 4)
    return f"{n / 1024 ** exponent:.1f} {'KMGT'[exponent - 1]}iB"


def _status_kib(key: str) -> int | None:
    return _kib_line(Path("/proc/self/status"), key)


def _meminfo_kib(key: str) -> int | None:
    return _kib_line(Path("/proc/meminfo"), key)


def _kib_line(path: Path, key: str) -> int | None:
    try:
        for line in path.read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
