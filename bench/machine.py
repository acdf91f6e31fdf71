"""The machine a benchmark result was measured on, for every bench/results/*.json."""

from __future__ import annotations

import os
import platform
import sys


def describe(**extra) -> dict:
    """CPU, Python and load; torch's version and thread count when the benchmark loaded torch."""
    info = {"cpu_count": os.cpu_count(), "python": platform.python_version(),
            "processor": platform.processor() or platform.machine(), "load": os.getloadavg()}
    torch = sys.modules.get("torch")
    if torch is not None:
        info.update(torch=torch.__version__, torch_threads=torch.get_num_threads())
    return {**info, **extra}
