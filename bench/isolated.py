"""One measured function in a process of its own, so that its peak memory is its own (the loss
benchmarks: bench/cce.py, bench/distill.py).

On cpu the kernel's peak-RSS mark (VmHWM) is reset through /proc/self/clear_refs once the inputs
exist and one warm-up pass is done (compilation and first-touch page faults happen there), and the
peak above the RSS at that moment is reported. On cuda the caching allocator's peak above the
allocation once the inputs exist, its mark reset after the warm-up. Time is the median of the
timed passes (time.perf_counter, after a synchronize on cuda).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def peak_and_times(step: Callable[[], None], repeats: int, cuda: bool, reset: Callable[[], None]) -> dict:
    """Run `step` (one forward and backward) once to warm up, then `repeats` times, each after
    `reset` (untimed: it drops the previous pass's gradients): the peak bytes above the memory held
    before the first timed pass, and each pass's seconds."""
    import torch

    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def timed() -> float:
        reset()
        sync()
        start = time.perf_counter()
        step()
        sync()
        return time.perf_counter() - start

    timed()
    reset()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        baseline = torch.cuda.memory_allocated()
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak-RSS mark to the current RSS
        baseline = _status_kib("VmRSS") * 1024
    times = [timed()]
    peak = torch.cuda.max_memory_allocated() if cuda else _status_kib("VmHWM") * 1024
    times += [timed() for _ in range(repeats - 1)]
    return {"peak_bytes": peak - baseline, "median_s": statistics.median(times), "times_s": times,
            "torch": torch.__version__, "gpu": torch.cuda.get_device_name() if cuda else None}


def run(script: str, args: Sequence[str]) -> dict:
    """`python SCRIPT --worker ARGS...` in a process of its own: the JSON its last line prints, or
    {"error": its last line of stderr}."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, script, "--worker", *args], capture_output=True, text=True, cwd=REPO, env=env)
    if out.returncode:
        return {"error": (out.stderr.strip().splitlines() or ["no output"])[-1]}
    return json.loads(out.stdout.strip().splitlines()[-1])
